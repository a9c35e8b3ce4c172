"""Issue 22 (points 4, 5) at the statement level, on a real database: the sweeper's pass signals
each job it made dead once, in the calling process (a worker's lease thread, or ``pgbroker
sweep``), and counts its rescues towards pausing the task; a paused task name is not claimed;
pauses and resumes are audited. (The backoff table and the option, which need no database:
tests/unit/test_backoff.py, tests/unit/test_settings.py.)
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from pgbroker import signals
from pgbroker.errors import OperationError
from pgbroker.ops import Operations
from pgbroker.sweeper import Sweeper
from tests.support.db import add_job
from tests.integration.test_sweeper_log import lost_consumer
from tests.support.transport import store_for


@pytest.fixture
def received() -> Any:
    got: list[tuple[str, dict[str, Any]]] = []

    def on_dead(sender: Any, **kw: Any) -> None:
        got.append(("dead", kw))

    def on_paused(sender: Any, **kw: Any) -> None:
        got.append(("paused", kw))

    signals.job_dead.connect(on_dead, weak=False)
    signals.task_paused.connect(on_paused, weak=False)
    try:
        yield got
    finally:
        signals.job_dead.disconnect(on_dead)
        signals.task_paused.disconnect(on_paused)


def test_sweeper_signals_each_dead_job_once_and_pauses_the_task(
        db_url: str, pg: psycopg.Connection, received: list[Any]) -> None:
    store = store_for(db_url, pause_task_after=2)
    try:
        # (two different workers taken down, neither told to stop: 0019_loss_evidence.sql)
        last = add_job(pg, "running", task="t.poison", attempts=3, max_attempts=3,
                       locked_by=lost_consumer(pg, "host-1"))
        again = add_job(pg, "running", task="t.poison", attempts=1,
                        locked_by=lost_consumer(pg, "host-2"))
        result = Sweeper(store).run_once()
        assert (result.rescued, result.buried) == (1, 1)
        assert Sweeper(store).run_once().buried == 0   # a second pass changes nothing
    finally:
        store.close()
    dead = [kw for kind, kw in received if kind == "dead"]
    assert len(dead) == 1
    assert dead[0]["job_id"] == last and dead[0]["task"] == "t.poison"
    assert dead[0]["attempts"] == 3 and "consumer was lost" in dead[0]["reason"]
    paused = [kw for kind, kw in received if kind == "paused"]
    assert len(paused) == 1 and paused[0]["actor"] == "pgbroker"
    assert sorted(paused[0]["job_ids"]) == sorted([last, again])
    assert pg.execute("SELECT paused_by FROM pgbroker.task_pauses WHERE task = 't.poison'"
                      ).fetchone() == ("pgbroker",)


def test_a_paused_task_name_is_not_claimed(db_url: str, pg: psycopg.Connection) -> None:
    store = store_for(db_url)
    try:
        blocked = add_job(pg, "pending", task="t.paused", priority=9)
        other = add_job(pg, "pending", task="t.other")
        plain = add_job(pg, "pending", task=None)
        with psycopg.connect(db_url, autocommit=True) as conn:
            ops = Operations(conn, actor="bob", via="test")
            assert ops.pause_task("t.paused", "deploy 1.4.1 leaks memory")
            assert not ops.pause_task("t.paused")
            claimed = {r.id for r in store.claim("q1", 10, uuid.uuid4())}
            assert claimed == {other, plain}
            assert ops.paused_tasks()[0]["waiting"] == 1
            assert ops.resume_task("t.paused", "1.4.2 fixed it")
            assert {r.id for r in store.claim("q1", 10, uuid.uuid4())} == {blocked}
            with pytest.raises(OperationError, match="task name"):
                ops.pause_task(" ")
        audit = pg.execute("SELECT actor, action, detail->>'reason', detail->>'changed' "
                           "FROM pgbroker.audit WHERE target = 't.paused' ORDER BY id").fetchall()
        assert audit == [("bob", "task.pause", "deploy 1.4.1 leaks memory", "true"),
                         ("bob", "task.pause", "paused by bob", "false"),
                         ("bob", "task.resume", "1.4.2 fixed it", "true")]
    finally:
        store.close()


def test_cli_task_commands_stats_metrics_and_dead_runs(db_url: str, pg: psycopg.Connection,
                                                       cli: Any) -> None:
    """``pgbroker task pause|resume|list``, the paused task in ``stats`` and in the metric
    ``pgbroker_task_paused``, and ``dead list`` counting a task's runs across Celery's retries."""
    from prometheus_client import generate_latest

    from pgbroker.metrics import MetricsReader, prometheus_registry

    add_job(pg, "pending", task="t.slow")
    code, out, _ = cli("task", "pause", "t.slow", "--reason", "the GPU host is down")
    assert (code, out.strip()) == (0, "task t.slow paused")
    code, out, _ = cli("task", "list")
    assert code == 0 and "t.slow" in out and "the GPU host is down" in out
    code, out, _ = cli("stats")
    assert "task t.slow: PAUSED" in out and "(1 job(s) waiting)" in out
    with psycopg.connect(db_url, autocommit=True) as conn:
        reader = MetricsReader()
        text = generate_latest(prometheus_registry(lambda: reader.snapshot(conn))).decode()
    assert 'pgbroker_task_paused{task="t.slow"} 1.0' in text
    code, out, _ = cli("task", "resume", "t.slow", "--reason", "back")
    assert (code, out.strip()) == (0, "task t.slow resumed")
    assert cli("task", "resume", "t.slow")[1].strip() == "task t.slow was not paused"
    assert pg.execute("SELECT count(*) FROM pgbroker.audit WHERE target = 't.slow'"
                      ).fetchone() == (3,)

    # a task that ran 4 times: 3 Celery retries (rows of one attempt each), the last one dead
    for retries in range(4):
        add_job(pg, "completed" if retries < 3 else "dead", task="t.flaky", task_id="tid-1",
                retries=retries, attempts=1, last_error="boom" if retries == 3 else None)
    code, out, _ = cli("dead", "list")
    line = next(line for line in out.splitlines() if "t.flaky" in line)
    assert "4 (3 retries)" in line and "1/5" in line
