"""Security: what a notification reveals, where the DSN password may show up, least privilege,
and applications sharing one database in separate schemas.

* NOTIFY channels are not access-controlled (any role that can connect can LISTEN): a test
  listens while a real worker runs tasks, scheduled tasks, failures, remote control and task
  events whose arguments are a secret, and checks every payload is a wake-up or a pointer.
* The broker URL's password never reaches the worker's DEBUG log, its banner, ``celery
  inspect stats``/``conf``/``report`` or a connection error.
* ``pgbroker/sql/roles.sql.example`` is run as documented (docs/security.md): a worker and a
  producer as the application role work, and that role can do no DDL.
* Two applications in two schemas of one database never see each other's jobs.

The admin page's security is tested in tests/integration/test_admin.py.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import kombu
import psycopg
import pytest
from celery import Celery
from psycopg import sql

import pgbroker
from pgbroker.migrate import MIGRATIONS, migrate
from tests.support.databases import create_database, drop_database
from tests.apps import e2e_app as e2e
from tests.apps import keys_app
from tests.support.workers import job, start_worker, wait_state
from tests.support.producers import drop_pools, point_producer
from tests.support.processes import REPO_ROOT, run_worker, wait_for

SECRET = "Sup3r-s3cret-" + uuid.uuid4().hex[:8]
ROLES_SQL = REPO_ROOT / "pgbroker" / "sql" / "roles.sql.example"
_names = itertools.count(1)
#: The variables of roles.sql.example.
NAMES = ("database", "schema", "migration_role", "app_role", "producer_role", "worker_role")

#: A wake-up: "<seconds until due>[,<priority>,<run_at in µs>] <queue>" (jobs_wake_payload,
#: 0014: without the place, from a resume or an admin retry); a broadcast: "b <id> <exchange>".
WAKE_UP = re.compile(r"^\d+(\.\d+)?(,\d+,-?\d+)? \S.*$")
POINTER = re.compile(r"^b [0-9a-f-]{36} \S+$")


def with_password(url: str, password: str = SECRET) -> str:
    """``url`` with ``password`` for its user (the test server trusts local users, so any
    password connects: what matters is where it shows up)."""
    parts = urlsplit(url)
    user, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(
        netloc=f"{user or 'postgres'}:{quote(password, safe='')}@{host}"))


def celery_cli(broker_url: str, *args: str) -> str:
    """Run ``celery -A tests.apps.e2e_app <args>`` against ``broker_url``; stdout + stderr."""
    env = {**os.environ, "PGBROKER_TEST_BROKER_URL": broker_url,
           "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run([sys.executable, "-m", "celery", "-A", "tests.apps.e2e_app", *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, env=env,
                          check=False)
    return done.stdout + done.stderr


def inspect(broker_url: str, command: str, node: str) -> str:
    """``celery inspect <command> -d <node>``'s output. Asked up to three times: a reply was
    seen lost now and then (reported to the remote-control owner); this test is about what a
    reply contains, not whether one gets lost."""
    for _ in range(3):
        output = celery_cli(broker_url, "inspect", command, "-d", node, "--timeout", "10")
        if "No nodes replied" not in output:
            break
    return output


# -- NOTIFY payloads -------------------------------------------------------------------------------

def test_notifications_carry_no_message_body_or_argument(
        producer: Celery, runs: psycopg.Connection, broker_url: str, db_url: str) -> None:
    listener = psycopg.connect(db_url, autocommit=True)
    listener.execute('LISTEN "pgbroker.jobs"')
    payloads: list[str] = []

    def drain(until: float = 0.2) -> None:
        payloads.extend(n.payload for n in listener.notifies(timeout=until))

    try:
        worker = start_worker(broker_url, "-E")  # -E: task events, which carry args
        with kombu.Connection(broker_url) as monitor:  # a monitor bound to the events
            events = kombu.Queue(f"monitor-{uuid.uuid4()}", kombu.Exchange("celeryev", "topic"),
                                 routing_key="#", auto_delete=True)
            seen: list[Any] = []
            consumer = kombu.Consumer(monitor, [events], callbacks=[
                lambda body, message: (seen.append(body), message.ack())], accept=["json"])
            consumer.consume()
            results = [
                e2e.touch.delay(SECRET),
                e2e.touch.apply_async((SECRET + "-later",), countdown=1),  # promoted when due
                e2e.touch.apply_async(("headers",), headers={"note": SECRET}),
                e2e.boom.delay(SECRET + "-fails"),  # a failure: ends dead
            ]
            replies = producer.control.broadcast("ping", arguments={"secret": SECRET},
                                                 reply=True, timeout=5)
            assert replies, "the worker did not answer the broadcast"
            for result in results:
                wait_for(lambda r=result: job(runs, r.id)["state"] in ("completed", "dead"),
                         60, message=f"task {result.id} to finish")
                drain()
            wait_for(lambda: monitor.drain_events(timeout=1) or any(
                SECRET in json.dumps(b) for b in seen), 30, message="a task event with the secret")
        drain(1.0)
        assert worker.is_alive()
    finally:
        listener.close()

    assert any(SECRET in json.dumps(body) for body in seen)  # the secret was on the move ...
    assert any(WAKE_UP.match(p) for p in payloads) and any(POINTER.match(p) for p in payloads)
    for payload in payloads:  # ... but no notification carried it
        assert SECRET not in payload
        assert WAKE_UP.match(payload) or POINTER.match(payload), payload
    print(f"\n[figure] {len(payloads)} notifications, all wake-ups or pointers: "
          f"{sorted(set(payloads))[:6]} ...")


# -- the DSN password ------------------------------------------------------------------------------

def test_password_never_in_worker_log_banner_or_inspect_output(
        runs: psycopg.Connection, db_url: str) -> None:
    secret_url = "pgbroker+" + with_password(db_url)
    worker = run_worker("tests.apps.e2e_app", secret_url, "--loglevel=DEBUG", "-E").wait_ready(60)
    point_producer(e2e.app, secret_url)
    try:
        result = e2e.touch.delay("with-a-password")
        wait_state(runs, result.id, "completed")
        node = f"{worker.name}@{socket.gethostname()}"  # one destination: no waiting for others
        outputs = {command: inspect(secret_url, command, node)
                   for command in ("stats", "conf", "report", "active_queues")}
    finally:
        drop_pools(e2e.app)
        worker.stop()
    log = worker.log_path.read_text(errors="replace")
    assert "transport:   pgbroker+postgresql://postgres:**@" in log  # the banner, masked
    assert "DEBUG" in log
    assert SECRET not in log
    for command, output in outputs.items():
        assert "OK" in output or "->" in output, (command, output)  # the worker answered
        assert SECRET not in output, command


def test_password_never_in_a_workers_connection_errors(db_url: str) -> None:
    wrong_db = urlunsplit(urlsplit(with_password(db_url))._replace(path="/pgbroker_nowhere"))
    worker = run_worker("tests.apps.e2e_app", "pgbroker+" + wrong_db, "--loglevel=DEBUG")
    worker.wait_for_log('database "pgbroker_nowhere" does not exist', timeout=60)
    worker.stop()
    assert SECRET not in worker.log_path.read_text(errors="replace")


# -- least privilege -------------------------------------------------------------------------------

def _psql() -> str | None:
    from tests.support.throwaway import find_bindir

    bindir = find_bindir()
    found = shutil.which("psql") or (str(bindir / "psql") if bindir else None)
    return found if found and os.path.exists(found) else None


@pytest.fixture
def roles(database_url: str) -> Iterator[dict[str, str]]:
    """An empty database set up by step 1 of roles.sql.example: the :data:`NAMES`, ``url`` (as
    the superuser) and ``psql``; the roles are dropped afterwards."""
    psql = _psql()
    if psql is None:
        pytest.skip("psql is needed to run pgbroker/sql/roles.sql.example")
    n = f"{os.getpid()}_{next(_names)}"
    names = {"database": f"pgbroker_test_roles_{n}", "schema": "pgbroker",
             "migration_role": f"pgbroker_test_owner_{n}", "app_role": f"pgbroker_test_app_{n}",
             "producer_role": f"pgbroker_test_producer_{n}",
             "worker_role": f"pgbroker_test_worker_{n}"}
    create_database(database_url, names["database"])
    url = urlunsplit(urlsplit(database_url)._replace(path="/" + names["database"]))
    try:
        run_roles_sql(psql, url, names)
        yield {**names, "url": url, "psql": psql}
    finally:
        drop_database(database_url, names["database"])
        with psycopg.connect(database_url, autocommit=True) as conn:
            for role in (names["producer_role"], names["worker_role"], names["app_role"],
                         names["migration_role"]):
                exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s",
                                      (role,)).fetchone()
                if exists:
                    conn.execute(sql.SQL("DROP OWNED BY {} CASCADE").format(
                        sql.Identifier(role)))
                    conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def run_roles_sql(psql: str, url: str, names: dict[str, str], after: bool = False) -> None:
    argv = [psql, "-X", "-q", url, "-f", str(ROLES_SQL)]
    for key, value in names.items():
        argv += ["-v", f"{key}={value}"]
    if after:
        argv += ["-v", "after_migrate=1"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr


def as_role(url: str, role: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{role}@{parts.netloc.rpartition('@')[2]}"))


def test_least_privilege_roles_run_a_worker_and_a_producer_without_ddl(
        roles: dict[str, str]) -> None:
    owner_url = as_role(roles["url"], roles["migration_role"])
    app_url = as_role(roles["url"], roles["app_role"])
    assert migrate(owner_url) == [m.version for m in MIGRATIONS]  # step 2, as the owner
    run_roles_sql(roles["psql"], roles["url"], {k: roles[k] for k in NAMES}, after=True)
    with psycopg.connect(roles["url"], autocommit=True) as admin:
        admin.execute(e2e.RUNS_DDL)  # the test application's own table, granted like any
        admin.execute(sql.SQL("GRANT SELECT, INSERT ON public.runs TO {0};"
                              " GRANT USAGE ON SEQUENCE public.runs_n_seq TO {0}").format(
            sql.Identifier(roles["app_role"])))
        owner = admin.execute("SELECT nspowner::regrole::text FROM pg_namespace"
                              " WHERE nspname = 'pgbroker'").fetchone()[0]
        assert owner == roles["migration_role"]

    options = {"auto_migrate": False}
    broker = "pgbroker+" + app_url
    worker = run_worker("tests.apps.e2e_app", broker, env={
        "PGBROKER_TEST_TRANSPORT_OPTIONS": json.dumps(options)}).wait_ready(60)
    point_producer(e2e.app, broker, options)
    try:
        results = [e2e.touch.delay("as-app"), e2e.boom.delay("as-app-fails"),
                   e2e.touch.apply_async(("as-app-later",), countdown=1)]
        # remote control as the application role: a durable revoke (jobs, audit, broadcast)
        # and `inspect scheduled` (a worker reading the jobs table)
        revoked = e2e.touch.apply_async(("as-app-revoked",), countdown=600)
        listed = e2e.touch.apply_async(("as-app-listed",), countdown=600)
        e2e.app.control.revoke(revoked.id)
        (entries,) = (e2e.app.control.inspect(timeout=2).scheduled() or {"none": []}).values()
        ids = [e["request"]["id"] for e in entries]
        assert listed.id in ids and revoked.id not in ids
        results.append(revoked)
        with psycopg.connect(roles["url"], autocommit=True) as admin:
            for result, state in zip(results, ("completed", "dead", "completed", "cancelled")):
                wait_state(admin, result.id, state)
            users = {r[0] for r in admin.execute(
                "SELECT usename FROM pg_stat_activity WHERE application_name LIKE 'pgbroker%%'"
                " AND datname = current_database()")}
        assert users == {roles["app_role"]}  # every pgbroker connection is the app role's
    finally:
        drop_pools(e2e.app)
        worker.stop()

    with psycopg.connect(app_url, autocommit=True) as app:
        for statement in (
                "CREATE TABLE pgbroker.intruder (id int)",
                "ALTER TABLE pgbroker.jobs ADD COLUMN intruder int",
                "DROP TABLE pgbroker.jobs",
                "TRUNCATE pgbroker.jobs",
                "CREATE INDEX ON pgbroker.jobs (body)",
                "CREATE SCHEMA intruder",
                "INSERT INTO pgbroker.migrations (version, name) VALUES (999, 'fake')",
                "DELETE FROM pgbroker.migrations",
                "DELETE FROM pgbroker.audit",
                "CREATE TABLE public.intruder (id int)"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                app.execute(statement)
        assert app.execute("SELECT count(*) FROM pgbroker.migrations").fetchone()[0] >= 4
    # up to date: nothing to apply, and no DDL is even tried, so the application role may run it
    assert migrate(app_url) == []


def split_roles(roles: dict[str, str], runs_ddl: str, runs: str, privileges: str
                ) -> tuple[str, str]:
    """Steps 2 and 3 of roles.sql.example with the producer and worker roles, and the test
    application's table ``public.<runs>`` (made by ``runs_ddl``) granted to the worker role as
    an application grants its own; returns the producer's and the worker's URLs."""
    migrate(as_role(roles["url"], roles["migration_role"]))
    run_roles_sql(roles["psql"], roles["url"], {k: roles[k] for k in NAMES}, after=True)
    with psycopg.connect(roles["url"], autocommit=True) as admin:
        admin.execute(runs_ddl)
        admin.execute(sql.SQL("GRANT {privileges} ON {table} TO {role};"
                              " GRANT USAGE ON SEQUENCE {sequence} TO {role}").format(
            privileges=sql.SQL(privileges), table=sql.Identifier("public", runs),
            sequence=sql.Identifier("public", runs + "_n_seq"),
            role=sql.Identifier(roles["worker_role"])))
    return (as_role(roles["url"], roles["producer_role"]),
            as_role(roles["url"], roles["worker_role"]))


def test_a_producer_role_enqueues_but_reads_no_body_and_changes_no_job(
        roles: dict[str, str]) -> None:
    """The split roles of roles.sql.example: a producer (web processes) that publishes with
    .delay() and pgbroker.enqueue (an idempotency key's duplicate included), and a worker role
    that runs the jobs; neither may act as an operator."""
    producer_url, worker_url = split_roles(roles, e2e.RUNS_DDL, "runs", "SELECT, INSERT")
    options = {"auto_migrate": False}
    worker = run_worker("tests.apps.e2e_app", "pgbroker+" + worker_url, env={
        "PGBROKER_TEST_TRANSPORT_OPTIONS": json.dumps(options)}).wait_ready(60)
    point_producer(e2e.app, "pgbroker+" + producer_url, options)
    try:
        sent = [(e2e.touch.delay("by-producer").id, "completed"),
                (e2e.boom.delay("by-producer-fails").id, "dead")]
        with psycopg.connect(producer_url) as conn:  # in the producer's own transaction
            first = pgbroker.enqueue(conn, e2e.touch, ("enqueued",), idempotency_key="once")
            again = pgbroker.enqueue(conn, e2e.touch, ("enqueued",), idempotency_key="once")
            conn.commit()
        assert first == again
        with psycopg.connect(roles["url"], autocommit=True) as admin:
            [enqueued] = admin.execute("SELECT task_id FROM pgbroker.jobs WHERE id = %s",
                                       (first,)).fetchone()
            for task_id, state in [*sent, (enqueued, "completed")]:
                wait_state(admin, task_id, state)
            users = {r[0] for r in admin.execute(
                "SELECT usename FROM pg_stat_activity WHERE application_name LIKE 'pgbroker%%'"
                " AND application_name <> 'pgbroker migrate' AND datname = current_database()")}
        assert users <= {roles["worker_role"], roles["producer_role"]}, users
    finally:
        drop_pools(e2e.app)
        worker.stop()

    audit = "INSERT INTO pgbroker.audit (actor, action) VALUES ('me', 'dead.retry')"
    refused = {
        producer_url: ("SELECT body FROM pgbroker.jobs", "SELECT headers FROM pgbroker.jobs",
                       "SELECT last_error FROM pgbroker.jobs",
                       "UPDATE pgbroker.jobs SET state = 'completed'",
                       "DELETE FROM pgbroker.jobs", "UPDATE pgbroker.queues SET paused = true",
                       "SELECT body FROM pgbroker.broadcasts", "SELECT * FROM pgbroker.consumers",
                       audit),
        worker_url: (audit, "SELECT * FROM pgbroker.audit", "DELETE FROM pgbroker.migrations",
                     "SELECT * FROM pgbroker.admin_sessions",
                     "CREATE TABLE pgbroker.intruder (id int)"),
    }
    for url, statements in refused.items():
        with psycopg.connect(url, autocommit=True) as conn:
            for statement in statements:
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    conn.execute(statement)


def test_a_producer_gates_a_queue_only_by_publishing_a_keyed_job(roles: dict[str, str]) -> None:
    """A keyed insert marks its queue gated through a trigger of the schema's owner
    (0013_gate_definer.sql): the producer role may not write gated_queues itself, where it
    could move every queue's claims to the costlier gated statement ('' gates them all)."""
    producer_url, _ = split_roles(roles, keys_app.RUNS_DDL, "key_runs", "SELECT, INSERT, UPDATE")
    with psycopg.connect(producer_url, autocommit=True) as conn:
        for statement in ("INSERT INTO pgbroker.gated_queues (name) VALUES ('')",
                          "INSERT INTO pgbroker.gated_queues (name) VALUES ('celery')",
                          "DELETE FROM pgbroker.gated_queues",
                          "SELECT * FROM pgbroker.gated_queues"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)
    point_producer(keys_app.app, "pgbroker+" + producer_url, {"auto_migrate": False})
    try:
        with psycopg.connect(producer_url) as conn:
            pgbroker.enqueue(conn, keys_app.sync, ("keyed", 0.0), concurrency_key="source:1")
            conn.commit()
    finally:
        drop_pools(keys_app.app)
    with psycopg.connect(roles["url"], autocommit=True) as admin:
        gated = {r[0] for r in admin.execute("SELECT name FROM pgbroker.gated_queues")}
        queue = admin.execute("SELECT queue FROM pgbroker.jobs WHERE concurrency_key = 'source:1'"
                              ).fetchone()
    assert queue is not None and gated == {queue[0]}, (queue, gated)


def test_no_producer_can_change_a_dedupe_key_and_dedupe_still_works_for_both_roles(
        roles: dict[str, str]) -> None:
    """A dedupe key is handed to a Celery retry by the insert itself (the trigger of
    0012_dedupe_handover.sql, as the schema's owner), so the producer role needs, and has, no
    UPDATE on jobs: it cannot clear any job's dedupe key (which would let a second copy of a
    deduplicated task run). As the producer and as the worker role: .delay() and enqueue with
    dedupe keys (a duplicate returns the queued copy), and a retry (the same task id,
    retries + 1) takes its running copy's slot over; a real Celery retry, published by a worker
    of the worker role, does too."""
    producer_url, worker_url = split_roles(roles, keys_app.RUNS_DDL, "key_runs",
                                           "SELECT, INSERT, UPDATE")
    urls = {"producer": producer_url, "worker": worker_url}
    with psycopg.connect(producer_url, autocommit=True) as conn:
        for statement in ("UPDATE pgbroker.jobs SET dedupe_key = NULL",
                          "UPDATE pgbroker.jobs SET dedupe_key = 'x' WHERE false"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)
    options = {"auto_migrate": False}
    worker = run_worker("tests.apps.keys_app", "pgbroker+" + urls["worker"], env={
        "PGBROKER_TEST_TRANSPORT_OPTIONS": json.dumps(options)}).wait_ready(60)
    admin = psycopg.connect(roles["url"], autocommit=True)

    def holders(key: str) -> list[tuple[str, int, str]]:
        return admin.execute("SELECT task_id, retries, state FROM pgbroker.jobs"
                             " WHERE dedupe_key = %s ORDER BY id", (key,)).fetchall()

    try:
        for role, url in urls.items():
            point_producer(keys_app.app, "pgbroker+" + url, options)
            assert keys_app.plain.delay(f"{role}-plain").id  # no key at all
            with psycopg.connect(url) as conn:  # enqueue, in the role's own transaction
                first = pgbroker.enqueue(conn, keys_app.sync, (f"{role}-a", 0.0),
                                         dedupe_key=f"{role}:k")
                again = pgbroker.enqueue(conn, keys_app.sync, (f"{role}-b", 0.0),
                                         dedupe_key=f"{role}:k")
                conn.commit()
            assert first == again
            # a copy that runs 3 s holding its slot (dedupe_active) ...
            headers = {"dedupe_key": f"{role}:active", "dedupe_active": True}
            running = keys_app.sync.apply_async((f"{role}-long", 3.0), headers=headers)
            wait_for(lambda r=running: holders(f"{role}:active") == [(r.id, 0, "running")], 30,
                     message=lambda: f"the long copy to run ({holders(f'{role}:active')})")
            # ... a new request is a duplicate of it ...
            keys_app.sync.apply_async((f"{role}-dropped", 0.0), headers=headers)
            # ... and its retry (the same task id, retries + 1) takes the slot over
            keys_app.sync.apply_async((f"{role}-retry", 0.0), headers=headers,
                                      task_id=running.id, retries=1, countdown=30)
            assert holders(f"{role}:active") == [(running.id, 1, "scheduled")]
            admin.execute("UPDATE pgbroker.jobs SET state = 'cancelled'"
                          " WHERE task_id = %s AND retries = 1", (running.id,))
        drop_pools(keys_app.app)
        # a real Celery retry, published by the worker role's worker: it takes the slot over
        point_producer(keys_app.app, "pgbroker+" + urls["producer"], options)
        headers = {"dedupe_key": "pay:9", "dedupe_active": True}
        flaky = keys_app.flaky.apply_async(("r", 1, 0.5), headers=headers)
        wait_for(lambda: holders("pay:9") == [(flaky.id, 1, "scheduled")], 30,
                 message=lambda: f"the retry to hold the slot ({holders('pay:9')})")
        keys_app.flaky.apply_async(("dup", 0, 0.0), headers=headers)  # its duplicate
        wait_for(lambda: admin.execute(
            "SELECT count(*) FROM pgbroker.jobs WHERE task = 'keys.flaky'"
            " AND state = 'completed'").fetchone()[0] == 2, 30, message="the retry to run")
        runs = admin.execute("SELECT arg, retries FROM public.key_runs WHERE task = 'flaky'"
                             " ORDER BY n").fetchall()
        assert runs == [("r", 0), ("r", 1)]
        ran = {r[0] for r in admin.execute("SELECT arg FROM public.key_runs")}
        assert not {a for a in ran if a.endswith(("-b", "-dropped"))}, ran
    finally:
        drop_pools(keys_app.app)
        worker.stop()
        admin.close()


def test_the_app_role_connects_with_auto_migrate_on_to_an_up_to_date_schema(
        roles: dict[str, str]) -> None:
    migrate(as_role(roles["url"], roles["migration_role"]))
    with kombu.Connection("pgbroker+" + as_role(roles["url"], roles["app_role"])) as conn:
        conn.connect()


# -- applications sharing one database -------------------------------------------------------------

def test_two_applications_in_two_schemas_never_see_each_others_jobs(
        producer: Celery, runs: psycopg.Connection, broker_url: str, db_url: str) -> None:
    migrate(db_url, "other_app")
    other_options = {"schema": "other_app"}
    mine = start_worker(broker_url, "-c", "2")
    theirs = start_worker(broker_url, "-c", "2", options=other_options)
    other = Celery("other", broker=broker_url, set_as_current=False)
    other.conf.broker_transport_options = other_options
    try:
        my_keys = [e2e.touch.delay(f"mine-{i}").id for i in range(20)]
        their_keys = [other.send_task("tests.apps.e2e_app.touch", args=(f"theirs-{i}",)).id
                      for i in range(20)]
        for schema, ids in (("pgbroker", my_keys), ("other_app", their_keys)):
            wait_for(lambda s=schema, i=ids: runs.execute(
                f"SELECT count(*) FROM {s}.jobs WHERE state = 'completed' AND task_id = ANY(%s)",
                (i,)).fetchone()[0] == 20, 60, message=f"20 completed in {schema}")
    finally:
        other.close()
    mine_pids, their_pids = set(mine.child_pids()), set(theirs.child_pids())
    ran = runs.execute("SELECT key, pid FROM public.runs").fetchall()
    assert len(ran) == 40
    assert all(pid in mine_pids for key, pid in ran if key.startswith("mine-"))
    assert all(pid in their_pids for key, pid in ran if key.startswith("theirs-"))
    for schema, prefix in (("pgbroker", "mine-"), ("other_app", "theirs-")):
        bodies = [bytes(r[0]).decode() for r in runs.execute(f"SELECT body FROM {schema}.jobs")]
        assert len(bodies) == 20 and all(prefix in b for b in bodies), schema
        pids = {r[0] for r in runs.execute(f"SELECT pid FROM {schema}.consumers")}
        assert pids == {(mine if schema == "pgbroker" else theirs).pid}, (schema, pids)
