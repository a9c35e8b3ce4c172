"""Every ``pgbroker`` command against a real database, with its errors (exit status 2).

Most commands run in-process through :func:`pgbroker.cli.main` (fast); the entry point itself,
``sweep --loop`` and ``serve`` run as real subprocesses. With real ``celery worker`` processes
(a paused queue is not claimed, a retried dead job runs): tests/e2e/test_cli_worker.py; the help
and an unreachable database: tests/unit/test_cli_usage.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psycopg
import pytest

from pgbroker.cli import main
from pgbroker.migrate import MIGRATIONS
from pgbroker.ops import os_user
from tests.support.processes import REPO_ROOT, Run, pgbroker_process, wait_for
from tests.support.db import CHILD_KILLED, LOST, add_job, add_jobs, job_state

@pytest.fixture
def queue(pg: psycopg.Connection) -> str:
    pg.execute("INSERT INTO pgbroker.queues (name) VALUES ('q1'), ('q2')")
    return "q1"


def audit_rows(pg: psycopg.Connection, action: str) -> list[tuple]:
    return pg.execute("SELECT actor, target, detail FROM pgbroker.audit WHERE action = %s"
                      " ORDER BY id", (action,)).fetchall()


# -- help, migrate, stats ------------------------------------------------------------------------

def test_the_entry_point_runs_and_reports_usage_errors(db_url: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pgbroker", "--database-url", db_url, "stats"],
                          capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr
    assert "QUEUE" in done.stdout
    done = subprocess.run([sys.executable, "-m", "pgbroker", "jobs", "list", "--state", "nope"],
                          capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert done.returncode == 2
    assert "invalid choice: 'nope'" in done.stderr


def test_migrate_creates_and_then_finds_nothing_to_do(cli: Run) -> None:
    code, out, _ = cli("--schema", "other", "migrate")
    every = ", ".join(str(m.version) for m in MIGRATIONS)
    assert (code, out.strip()) == (0, f"schema other: applied migration(s) {every}")
    code, out, _ = cli("--schema", "other", "migrate")
    assert code == 0 and "up to date" in out


def test_commands_refuse_an_unmigrated_schema(cli: Run) -> None:
    code, _, err = cli("--schema", "nothere", "stats")
    assert code == 1
    assert "does not exist" in err and "pgbroker migrate" in err


def test_bad_database_url_and_schema_are_usage_errors(cli: Run, capsys: pytest.CaptureFixture[str]
                                                      ) -> None:
    code, _, err = cli("--schema", "Bad-Name", "stats")
    assert code == 2 and "not a valid pgbroker schema name" in err
    assert main(["--database-url", "mysql://x@y/z", "stats"]) == 2
    assert "is not a PostgreSQL URL" in capsys.readouterr().err


def test_stats_table_and_json(cli: Run, pg: psycopg.Connection, queue: str) -> None:
    add_jobs(pg, 3, "pending")
    add_job(pg, "dead", last_error=LOST)
    add_jobs(pg, 2, "completed", queue="q2", task="t.b")
    code, out, _ = cli("stats", "--window", "3600")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:6] == ["QUEUE", "PAUSED", "PENDING", "SCHEDULED", "RUNNING", "DEAD"]
    assert lines[1].split()[:7] == ["q1", "no", "3", "0", "0", "1", "1"]
    code, out, _ = cli("stats", "--json")
    data = json.loads(out)
    q = {x["queue"]: x for x in data["queues"]}
    assert (q["q1"]["pending"], q["q1"]["dead"], q["q1"]["poison"]) == (3, 1, 1)
    assert q["q2"]["completed"] == 2
    assert {(t["queue"], t["task"]) for t in data["tasks"]} == {("q1", "t.a"), ("q2", "t.b")}
    code, out, _ = cli("stats", "--by-task")
    assert code == 0 and "t.b" in out


# -- jobs ----------------------------------------------------------------------------------------

def test_jobs_list_filters(cli: Run, pg: psycopg.Connection, queue: str) -> None:
    ids = {s: add_job(pg, s) for s in ("pending", "running", "dead")}
    other = add_job(pg, "pending", queue="q2", task="t.b")
    code, out, _ = cli("jobs", "list", "--json")
    assert {r["id"] for r in json.loads(out)} == {str(i) for i in [*ids.values(), other]}
    code, out, _ = cli("jobs", "list", "--state", "pending", "--json")
    assert {r["id"] for r in json.loads(out)} == {str(ids["pending"]), str(other)}
    code, out, _ = cli("jobs", "list", "--queue", "q2", "--json")
    assert [r["id"] for r in json.loads(out)] == [str(other)]
    code, out, _ = cli("jobs", "list", "--task", "t.a", "--state", "dead")
    assert str(ids["dead"]) in out and str(other) not in out
    code, out, _ = cli("jobs", "list", "--limit", "1", "--json")
    assert len(json.loads(out)) == 1
    code, _, err = cli("jobs", "list", "--limit", "0")
    assert code == 2 and "limit must be at least 1" in err


def test_jobs_show_by_id_task_id_and_idempotency_key(cli: Run, pg: psycopg.Connection) -> None:
    job_id = add_job(pg, "dead", task_id="celery-task-1", idempotency_key="order-42",
                     last_error="ValueError: boom", last_traceback="Traceback (most recent...)",
                     content_type="application/json", body=b'[[1, 2], {}, {}]')
    for key in (str(job_id), "celery-task-1", "order-42"):
        code, out, _ = cli("jobs", "show", key)
        assert code == 0, key
        assert str(job_id) in out and "ValueError: boom" in out and "Traceback" in out
    code, out, _ = cli("jobs", "show", str(job_id), "--json")
    shown = json.loads(out)
    assert (shown["state"], shown["idempotency_key"]) == ("dead", "order-42")
    assert json.loads(shown["body"]) == [[1, 2], {}, {}]


def test_jobs_show_unknown_is_exit_2(cli: Run) -> None:
    for key in (str(uuid.uuid4()), "no-such-key"):
        code, _, err = cli("jobs", "show", key)
        assert code == 2
        assert "no job has the id, Celery task id or idempotency key" in err


def test_lookup_by_key_finds_jobs_of_every_task(cli: Run, pg: psycopg.Connection) -> None:
    ids = {add_job(pg, "completed", task=t, idempotency_key="k") for t in ("a", "b", "c")}
    add_job(pg, "completed", task="d", idempotency_key="other")
    plain = add_job(pg, "completed", task=None, idempotency_key="k")
    code, out, _ = cli("jobs", "show", "k")
    assert out.startswith("4 jobs match 'k'")
    assert all(str(i) in out for i in ids | {plain})


# -- dead letters --------------------------------------------------------------------------------

def test_dead_list_marks_poison_jobs(cli: Run, pg: psycopg.Connection) -> None:
    lost = add_job(pg, "dead", last_error=LOST)
    killed = add_job(pg, "dead", last_error=CHILD_KILLED)
    failed = add_job(pg, "dead", last_error="ValueError: boom\nmore")
    code, out, _ = cli("dead", "list")
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert "POISON" in lines[str(lost)] and "POISON" in lines[str(killed)]
    assert "POISON" not in lines[str(failed)] and "ValueError: boom" in lines[str(failed)]
    code, out, _ = cli("dead", "list", "--json")
    assert {r["id"]: r["poison"] for r in json.loads(out)} == {
        str(lost): True, str(killed): True, str(failed): False}


def test_dead_retry_resets_the_job_wakes_its_queue_and_audits(
        cli: Run, pg: psycopg.Connection, db_url: str) -> None:
    job_id = add_job(pg, "dead", attempts=1, failed_attempt=1, last_error="ValueError: boom",
                     last_traceback="Traceback: line 1")
    with psycopg.connect(db_url, autocommit=True) as listener:
        listener.execute('LISTEN "pgbroker.jobs"')
        code, out, _ = cli("dead", "retry", str(job_id))
        assert (code, out.strip()) == (0, f"retried dead job {job_id}")
        notes = [n.payload for n in listener.notifies(timeout=5, stop_after=1)]
    assert notes == ["0 q1"]
    row = pg.execute("SELECT state, attempts, failed_attempt, last_error, last_traceback,"
                     " run_at <= now() FROM pgbroker.jobs WHERE id = %s", (job_id,)).fetchone()
    assert row == ("pending", 0, None, None, None, True)
    [(actor, target, detail)] = audit_rows(pg, "dead.retry")
    assert (actor, target) == (os_user(), str(job_id))
    assert detail["last_error"] == "ValueError: boom"
    assert detail["last_traceback"] == "Traceback: line 1"
    assert (detail["via"], detail["attempts"], detail["queue"]) == ("cli", 1, "q1")


@pytest.mark.parametrize("action,verb", [("retry", "retried"), ("discard", "discarded")])
def test_dead_action_errors_are_exit_2(cli: Run, pg: psycopg.Connection, queue: str,
                                       action: str, verb: str) -> None:
    pending = add_job(pg, "pending")
    cases = {
        "not-a-uuid": "is not a job id",
        str(uuid.uuid4()): "no job with id",
        str(pending): f"is pending: only dead jobs can be {verb}",
    }
    for job_id, message in cases.items():
        code, _, err = cli("dead", action, job_id)
        assert code == 2 and message in err, err
    code, _, err = cli("dead", action)
    assert code == 2 and "either a job id or --all" in err
    code, _, err = cli("dead", action, "--all", "--queue", "nope")
    assert code == 2 and "unknown queue 'nope'" in err and "q1" in err
    assert job_state(pg, id=pending) == "pending"
    assert pg.execute("SELECT count(*) FROM pgbroker.audit").fetchone()[0] == 0


def test_dead_retry_all_in_batches_with_progress(cli: Run, pg: psycopg.Connection,
                                                 queue: str) -> None:
    add_jobs(pg, 5, "dead", last_error="boom")
    other = add_job(pg, "dead", queue="q2")
    code, out, err = cli("dead", "retry", "--all", "--queue", "q1", "--batch-size", "2")
    assert (code, out.strip()) == (0, "retried 5 dead job(s) of queue q1")
    assert err.splitlines()[1:] == ["retried 2 of 5", "retried 4 of 5", "retried 5 of 5"]
    assert pg.execute("SELECT count(*) FROM pgbroker.jobs WHERE queue = 'q1' AND state ="
                      " 'pending' AND attempts = 0").fetchone()[0] == 5
    assert job_state(pg, id=other) == "dead"
    assert len(audit_rows(pg, "dead.retry")) == 5


def test_dead_discard_one_and_all(cli: Run, pg: psycopg.Connection, queue: str) -> None:
    one = add_job(pg, "dead", last_error="ValueError: boom", task_id="tid-1")
    add_jobs(pg, 3, "dead", queue="q2")
    code, out, _ = cli("dead", "discard", str(one))
    assert code == 0 and job_state(pg, id=one) is None
    [(_, target, detail)] = audit_rows(pg, "dead.discard")
    assert (target, detail["last_error"], detail["task_id"]) == (str(one), "ValueError: boom",
                                                                 "tid-1")
    code, out, err = cli("dead", "discard", "--all")
    assert (code, out.strip()) == (0, "discarded 3 dead job(s)")
    assert err.splitlines()[1:] == ["discarded 3 of 3"]
    assert pg.execute("SELECT count(*) FROM pgbroker.jobs").fetchone()[0] == 0


# -- cancel, purge, pause, resume, audit ---------------------------------------------------------

def test_cancel(cli: Run, pg: psycopg.Connection) -> None:
    pending = add_job(pg, "pending")
    scheduled = add_job(pg, "scheduled")
    running = add_job(pg, "running")
    for job_id in (pending, scheduled):
        code, out, _ = cli("cancel", str(job_id))
        assert (code, job_state(pg, id=job_id)) == (0, "cancelled")
    code, _, err = cli("cancel", str(running))
    assert code == 2 and "is running: only pending or scheduled jobs can be cancelled" in err
    assert job_state(pg, id=running) == "running"
    for bad, message in (("xyz", "is not a job id"), (str(uuid.uuid4()), "no job with id")):
        code, _, err = cli("cancel", bad)
        assert code == 2 and message in err
    assert [r[1] for r in audit_rows(pg, "job.cancel")] == [str(pending), str(scheduled)]


def test_purge_in_batches_keeps_running_and_dead(cli: Run, pg: psycopg.Connection,
                                                 queue: str) -> None:
    add_jobs(pg, 4, "pending")
    add_jobs(pg, 3, "scheduled")
    keep = [add_job(pg, "running"), add_job(pg, "dead"), add_job(pg, "pending", queue="q2")]
    code, out, err = cli("purge", "q1", "--batch-size", "2")
    assert (code, out.strip()) == (0, "purged 7 pending or scheduled job(s) of queue q1")
    assert err.splitlines()[-1] == "deleted 7 of 7" and len(err.splitlines()) >= 2
    assert pg.execute("SELECT count(*) FROM pgbroker.jobs").fetchone()[0] == 3
    assert all(job_state(pg, id=k) is not None for k in keep)
    [(_, target, detail)] = audit_rows(pg, "queue.purge")
    assert (target, detail["deleted"], detail["found"]) == ("q1", 7, 7)
    code, _, err = cli("purge", "nope")
    assert code == 2 and "unknown queue 'nope'" in err


def test_pause_and_resume(cli: Run, pg: psycopg.Connection, queue: str) -> None:
    assert cli("pause", "q1")[:2] == (0, "queue q1 paused\n")
    assert cli("pause", "q1")[:2] == (0, "queue q1 was already paused\n")
    assert pg.execute("SELECT paused FROM pgbroker.queues WHERE name = 'q1'").fetchone() == (True,)
    assert cli("resume", "q1")[:2] == (0, "queue q1 resumed\n")
    assert cli("resume", "q1")[:2] == (0, "queue q1 was not paused\n")
    assert pg.execute("SELECT paused FROM pgbroker.queues WHERE name = 'q1'").fetchone() == (False,)
    for command in ("pause", "resume"):
        code, _, err = cli(command, "nope")
        assert code == 2 and "unknown queue 'nope'" in err
    rows = pg.execute("SELECT actor, action, target, detail ->> 'changed' FROM pgbroker.audit"
                      " ORDER BY id").fetchall()
    me = os_user()
    assert rows == [(me, "queue.pause", "q1", "true"), (me, "queue.pause", "q1", "false"),
                    (me, "queue.resume", "q1", "true"), (me, "queue.resume", "q1", "false")]


def test_pausing_a_queue_known_only_from_its_jobs(cli: Run, pg: psycopg.Connection) -> None:
    add_job(pg, "pending", queue="undeclared")
    assert cli("pause", "undeclared")[0] == 0
    assert pg.execute("SELECT paused FROM pgbroker.queues WHERE name = 'undeclared'"
                      ).fetchone() == (True,)


def test_audit_command(cli: Run, pg: psycopg.Connection, queue: str) -> None:
    cli("pause", "q1")
    cli("resume", "q2")
    code, out, _ = cli("audit", "--target", "q1", "--json")
    assert [(r["action"], r["target"]) for r in json.loads(out)] == [("queue.pause", "q1")]
    code, out, _ = cli("audit")
    assert "queue.resume" in out and "queue.pause" in out


# -- sweep and serve -----------------------------------------------------------------------------

def test_sweep_one_pass_redelivers_an_orphan(cli: Run, pg: psycopg.Connection) -> None:
    orphan = add_job(pg, "running", attempts=1)  # its consumer is not registered: gone
    code, out, _ = cli("sweep")
    assert code == 0 and "rescued 1" in out
    assert job_state(pg, id=orphan) == "pending"


def test_sweep_loop_runs_until_sigterm(db_url: str, pg: psycopg.Connection, tmp_path: Path
                                       ) -> None:
    orphan = add_job(pg, "running", attempts=1)
    log = tmp_path / "sweep.log"
    with pgbroker_process("--database-url", db_url, "sweep", "--loop", "--interval", "0.2",
                          log=log):
        wait_for(lambda: "rescued 1" in log.read_text(), 60, message="a sweep that rescued")
        assert job_state(pg, id=orphan) == "pending"


def test_serve_on_loopback_without_credentials_makes_a_one_time_token(
        db_url: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGBROKER_ADMIN_")}
    log = tmp_path / "serve.log"
    with pgbroker_process("--database-url", db_url, "serve", "--port", "0", log=log,
                          env=env) as proc:
        def started() -> re.Match[str] | None:
            assert proc.poll() is None, log.read_text()
            return re.search(r"one-time token: (\S+)\n(?s:.*)serving on (http://\S+)/",
                             log.read_text())

        token, url = wait_for(started, 60, message="pgbroker serve to start").groups()

        def status(headers: dict[str, str]) -> int:
            request = urllib.request.Request(url + "/metrics", headers=headers)
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return response.status
            except urllib.error.HTTPError as exc:
                return exc.code

        assert status({}) == 401
        assert status({"Authorization": "Bearer wrong"}) == 401
        assert status({"Authorization": f"Bearer {token}"}) == 200


def test_serve_refuses_a_public_address_without_credentials(
        cli: Run, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PGBROKER_ADMIN_USER", "PGBROKER_ADMIN_PASSWORD", "PGBROKER_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    code, _, err = cli("serve", "--host", "0.0.0.0", "--port", "0")
    assert code == 2
    assert "refusing to serve the admin page on '0.0.0.0' without credentials" in err
    monkeypatch.setenv("PGBROKER_ADMIN_USER", "admin")
    code, _, err = cli("serve", "--host", "0.0.0.0", "--port", "0")
    assert code == 2 and "set both PGBROKER_ADMIN_USER and PGBROKER_ADMIN_PASSWORD" in err


# -- which database ------------------------------------------------------------------------------

def with_password(url: str, password: str) -> str:
    """``url`` with a password in it (trust authentication ignores it)."""
    return url.replace("postgres@", f"postgres:{password}@", 1)


@pytest.mark.parametrize("command", [["stats", "--json"], ["dead", "list", "--json"],
                                     ["jobs", "list", "--json"], ["audit", "--json"],
                                     ["schedule", "list", "--json"], ["migrate"]], ids=" ".join)
def test_every_command_says_on_stderr_which_database_it_reads(
        command: list[str], db_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = with_password(db_url, "s3cret")
    assert main(["--database-url", url, *command]) == 0
    out, err = capsys.readouterr()
    name = db_url.rsplit("/", 1)[1]
    assert err.splitlines()[0] == (f"pgbroker: database postgresql://postgres:**@127.0.0.1:5432/"
                                   f"{name}, schema pgbroker (from --database-url)")
    assert "s3cret" not in out + err
    if "--json" in command:
        json.loads(out)  # stdout stays parseable


def test_the_database_from_the_environment_and_the_default_are_named(
        db_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PGBROKER_DATABASE_URL", db_url)
    assert main(["stats"]) == 0
    assert capsys.readouterr().err.startswith(
        f"pgbroker: database {db_url}, schema pgbroker (from PGBROKER_DATABASE_URL)\n")
    monkeypatch.delenv("PGBROKER_DATABASE_URL")
    main(["--schema", "nothere", "stats"])  # the server's postgres database: no such schema
    assert capsys.readouterr().err.startswith(
        "pgbroker: database postgresql://postgres@127.0.0.1:5432/postgres, schema nothere (the "
        "default: no --database-url, -A or PGBROKER_DATABASE_URL)\n")


def pgbroker_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pgbroker", *args], capture_output=True,
                          text=True, timeout=60, cwd=REPO_ROOT, env={**os.environ, **env})


def test_dash_a_takes_the_url_and_the_schema_from_the_celery_app(
        broker_url: str, pg: psycopg.Connection) -> None:
    # like celery -A: tests.apps.e2e_app reads its broker URL and transport options from these
    env = {"PGBROKER_TEST_BROKER_URL": with_password(broker_url, "s3cret"),
           "PGBROKER_TEST_TRANSPORT_OPTIONS": json.dumps({"schema": "appschema"}),
           "PGBROKER_DATABASE_URL": "postgresql://nobody@127.0.0.1:1/elsewhere"}  # -A wins
    done = pgbroker_cli("-A", "tests.apps.e2e_app", "migrate", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("schema appschema: applied migration(s) 1,")
    pg.execute("INSERT INTO appschema.queues (name) VALUES ('only-in-appschema')")
    # -A after the command too
    done = pgbroker_cli("stats", "-A", "tests.apps.e2e_app", "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert [q["queue"] for q in json.loads(done.stdout)["queues"]] == ["only-in-appschema"]
    name = broker_url.rsplit("/", 1)[1]
    assert done.stderr.splitlines()[0] == (
        f"pgbroker: database postgresql://postgres:**@127.0.0.1:5432/{name}, schema appschema "
        "(from the Celery app tests.apps.e2e_app)")
    # --schema and --database-url still win over the app
    done = pgbroker_cli("-A", "tests.apps.e2e_app", "--schema", "pgbroker", "stats", env=env)
    assert done.returncode == 0 and "schema pgbroker (from the Celery app" in done.stderr


def test_dash_a_refuses_an_app_that_does_not_use_pgbroker(tmp_path: Path) -> None:
    (tmp_path / "redisapp.py").write_text(
        "from celery import Celery\napp = Celery('r', broker='redis://127.0.0.1:6379/0')\n")
    done = pgbroker_cli("-A", "redisapp", "stats", env={"PYTHONPATH": str(tmp_path)})
    assert done.returncode == 2
    assert done.stderr == ("pgbroker: error: the Celery app 'redisapp' uses the 'redis' broker, "
                           "not pgbroker (broker_url = 'pgbroker://user@host/db')\n")
    done = pgbroker_cli("-A", "no_such_module_here", "stats", env={})
    assert done.returncode == 2 and "no_such_module_here" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_serve_on_a_busy_port_says_so_in_one_line(db_url: str) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = pgbroker_cli("--database-url", db_url, "serve", "--port", str(port),
                            env={"PGBROKER_ADMIN_TOKEN": "t0ken-0123456789"})
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    error = done.stderr.splitlines()[-1]
    assert error.startswith(f"pgbroker: error: cannot listen on 127.0.0.1:{port}: ")
    assert "--port" in error


def test_dead_letters_of_a_queue_whose_row_is_gone(cli: Run, pg: psycopg.Connection) -> None:
    add_jobs(pg, 2, "dead", queue="expired-reply-queue")  # no row in pgbroker.queues
    code, out, _ = cli("dead", "retry", "--all", "--queue", "expired-reply-queue")
    assert (code, out.strip()) == (0, "retried 2 dead job(s) of queue expired-reply-queue")


def test_a_statement_that_fails_is_a_clear_error_not_a_traceback(
        db_url: str, pg: psycopg.Connection, capsys: pytest.CaptureFixture[str]) -> None:
    """A statement timeout set on the database (or a full disk): the connection lives, the
    statement failed; the command says so and exits 1."""
    pg.execute("BEGIN")
    pg.execute("LOCK TABLE pgbroker.jobs IN ACCESS EXCLUSIVE MODE")
    try:
        code = main(["--database-url", db_url + "?options=-c%20statement_timeout%3D200",
                     "stats"])
    finally:
        pg.execute("ROLLBACK")
    err = capsys.readouterr().err
    assert code == 1 and "pgbroker: error:" in err and "statement timeout" in err, err
