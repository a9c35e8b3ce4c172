"""Durable revoke and ``inspect scheduled`` against a real database, without a worker: what
``app.control.revoke`` writes from the producer's process, which ends of a flagged delivery
end it ``cancelled`` (those where its task did not run to its end), the ``pgbroker revoke``
command, and the scheduled listing's bounds.

The same behaviours with real ``celery worker`` processes: tests/e2e/test_revoke.py.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

import kombu
import psycopg
import pytest
from celery.utils.collections import AttributeDict
from celery.utils.timer2 import Timer
from psycopg.rows import dict_row

from pgbroker._produce import revoke as _revoke
from pgbroker._celery import inspect_scheduled as _scheduled
from pgbroker.cli import main
from pgbroker.ops import os_user
from pgbroker.sweeper import Sweeper
from tests.support.control import client_app
from tests.support.transport import connect, new_job, store_for
from tests.support.db import jobs as rows

TASK = "tests.apps.e2e_app.touch"


def revoke_audit(pg: psycopg.Connection) -> list[dict[str, Any]]:
    return pg.cursor(row_factory=dict_row).execute(
        "SELECT actor, target, detail FROM pgbroker.audit WHERE action = 'job.revoke'"
        " ORDER BY id").fetchall()


def test_a_revoke_sent_while_no_worker_runs_cancels_the_jobs_and_says_what_it_did(
        broker_url: str, pg: psycopg.Connection, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pgbroker._produce.revoke")
    with client_app(broker_url) as app:
        app.send_task(TASK, args=("now",), task_id="t-pending")
        app.send_task(TASK, args=("later",), task_id="t-scheduled", countdown=600)
        app.send_task(TASK, args=("kept",), task_id="t-kept", countdown=600)
        app.control.revoke(["t-pending", "t-scheduled", "t-unknown"])

        cancelled = rows(pg, "task_id = ANY(%s)", (["t-pending", "t-scheduled"],))
        assert [r["state"] for r in cancelled] == ["cancelled", "cancelled"]
        assert all(r["revoked_at"] is not None for r in cancelled)
        assert {r["last_error"] for r in cancelled} == {f"revoked by {os_user()} (celery revoke)"}
        assert rows(pg, "task_id = 't-kept'")[0]["state"] == "scheduled"
        # nobody's mailbox is bound: the broadcast is not written (nobody would read it)
        assert pg.execute("SELECT count(*) FROM pgbroker.broadcasts").fetchone()[0] == 0

        audit = revoke_audit(pg)
        assert [(a["target"], a["detail"]["task_id"], a["detail"]["was"], a["detail"]["via"])
                for a in audit] == [(str(cancelled[0]["id"]), "t-pending", "pending",
                                     "celery revoke"),
                                    (str(cancelled[1]["id"]), "t-scheduled", "scheduled",
                                     "celery revoke")]
        assert audit[0]["actor"] == os_user() and audit[0]["detail"]["terminate"] is False
        said = {(r.levelname, r.getMessage()) for r in caplog.records}
        assert ("INFO", "pgbroker: revoke cancelled 2 job(s) of task id(s) t-pending, "
                        "t-scheduled") in said
        assert ("WARNING", "pgbroker: revoke of task id(s) t-unknown: no job has this task "
                           "id, nothing changed") in said

        # a second revoke of a cancelled job changes nothing, and says so
        caplog.clear()
        app.control.revoke("t-pending")
        assert len(revoke_audit(pg)) == 2
        assert [r.levelname for r in caplog.records] == ["WARNING"]
        assert caplog.records[0].getMessage() == "pgbroker: revoke of task id(s) t-pending " \
            "(cancelled): already finished, nothing changed"


def test_a_flagged_delivery_ends_cancelled_only_when_it_did_not_run_to_its_end(
        db_url: str, pg: psycopg.Connection) -> None:
    """A job claimed when it is revoked (running, or prefetched by a worker) is flagged and never
    runs again: a reject without requeue, a requeue and a rescue by the sweeper end it
    'cancelled'. An ack ends it 'cancelled' only when its worker carried the revoke out
    (Celery's task_revoked: discarded or terminated, pgbroker._celery.endings), whether that report
    is written before the ack or after it -- alone, with a claim, or with retention 0's
    ack-and-delete. Without that report its task ran to its end (a thread pool cannot terminate
    it): 'completed', or 'dead' if it raised, the revoke's note kept. A job claimed and not
    revoked is unaffected."""
    store = store_for(db_url)
    bare = store_for(db_url, retention=0)
    ends = ["ack", "claim_ack", "failed_ack", "reject", "requeue", "rescue", "ack_delete",
            "stopped_ack", "ack_stopped", "stopped_claim_ack", "ack_delete_stopped", "untouched"]
    terminated = "its worker terminated it (signal 15) before it finished"
    try:
        consumer = uuid.uuid4()
        store.register_consumer(consumer, ["q"], None)
        delivery: dict[str, list[tuple[uuid.UUID, int]]] = {}
        for end in ends:
            store.insert(new_job("q", [end], task=TASK, task_id=f"t-{end}"))
            # the rescued one's consumer never registered: the sweeper finds it gone
            (row,) = store.claim("q", 1, uuid.uuid4() if end == "rescue" else consumer)
            delivery[end] = [(row.id, row.attempt)]

        outcomes = _revoke.apply(store, _revoke.RevokeRequest(
            tuple(f"t-{e}" for e in ends if e != "untouched")), via="test")
        assert [o.kind for o in outcomes] == ["flagged"] * (len(ends) - 1)
        assert {r["state"] for r in rows(pg, "true")} == {"running"}

        # the worker says it stopped these before their acks are written ...
        for end in ("stopped_ack", "stopped_claim_ack"):
            assert store.record_ending("stopped", *delivery[end][0], terminated)
        store.ack(delivery["ack"] + delivery["stopped_ack"] + delivery["ack_stopped"])
        store.insert(new_job("q", ["next"], task=TASK, task_id="t-next"))
        assert len(store.claim("q", 1, consumer,
                               delivery["claim_ack"] + delivery["stopped_claim_ack"])) == 1
        store.fail(*delivery["failed_ack"][0], "ValueError: boom", "Traceback ...")
        store.ack(delivery["failed_ack"])
        store.bury(*delivery["reject"][0], "rejected by the consumer without requeue")
        store.requeue(delivery["requeue"], "restored unacked")
        bare.ack(delivery["ack_delete"] + delivery["ack_delete_stopped"], delete=True)
        # ... and these after (Celery acks just before it sends task_revoked)
        for end in ("ack_stopped", "ack_delete_stopped"):
            assert store.record_ending("stopped", *delivery[end][0], terminated)
        store.ack(delivery["untouched"])
        Sweeper(store).run_once()

        states = {j["task_id"]: j["state"] for j in rows(pg, "true")}
        assert states.pop("t-next") == "running"
        assert states == {"t-untouched": "completed", "t-ack": "completed",
                          "t-claim_ack": "completed", "t-ack_delete": "completed",
                          "t-failed_ack": "dead"} | {
            f"t-{e}": "cancelled" for e in ("reject", "requeue", "rescue", "stopped_ack",
                                            "ack_stopped", "stopped_claim_ack",
                                            "ack_delete_stopped")}
        # what the task did stays visible; else the revoke's words, and how it was stopped
        assert rows(pg, "task_id = 't-failed_ack'")[0]["last_error"] == "ValueError: boom"
        revoked = f"revoked by {os_user()} (test) while running"
        assert rows(pg, "task_id = 't-ack'")[0]["last_error"] == revoked
        assert rows(pg, "task_id = 't-ack_stopped'")[0]["last_error"] == \
            f"{revoked}; {terminated}"
        # a late report of an older delivery changes nothing
        assert not store.record_ending("stopped", delivery["ack"][0][0], 9, terminated)
        assert rows(pg, "task_id = 't-ack'")[0]["state"] == "completed"

        again = _revoke.apply(store, _revoke.RevokeRequest(("t-ack", "t-next")), via="test")
        assert sorted((o.task_id, o.kind) for o in again) == [("t-ack", "already finished"),
                                                             ("t-next", "flagged")]
        again = _revoke.apply(store, _revoke.RevokeRequest(("t-next",)), via="test")
        assert [o.kind for o in again] == ["already revoked"]
    finally:
        store.close()
        bare.close()


def test_pgbroker_revoke_prints_what_happened_to_each_id(
        db_url: str, pg: psycopg.Connection, capsys: pytest.CaptureFixture[str]) -> None:
    store = store_for(db_url)
    try:
        store.insert(new_job("q", ["a"], task=TASK, task_id="t-a"))
        store.insert(new_job("q", ["b"], task=TASK, task_id="t-b"))
        store.claim("q", 1, uuid.uuid4())  # t-a: claimed
        # a worker's mailbox bound to the pidbox exchange: the broadcast is written for it
        store.declare_exchange("app.pidbox", "fanout", False, True, None)
        store.bind("app.pidbox", "", "w1.app.pidbox")
    finally:
        store.close()
    code = main(["--database-url", db_url, "revoke", "t-a", "t-b", "t-b", "t-none",
                 "--terminate", "--control-exchange", "app"])
    out, _ = capsys.readouterr()
    ids = {r["task_id"]: r["id"] for r in rows(pg, "true")}
    assert code == 0
    assert out.splitlines() == [
        f"t-a: job {ids['t-a']} flagged while running: it never runs again "
        "(cancelled if its worker stops it, else as its task ends)",
        f"t-b: job {ids['t-b']} cancelled (was pending)",
        "t-none: not found: no job has this task id, nothing changed"]
    assert [a["detail"]["via"] for a in revoke_audit(pg)] == ["cli", "cli"]
    body, exchange = pg.execute("SELECT convert_from(body, 'utf8')::jsonb, exchange"
                                " FROM pgbroker.broadcasts").fetchone()
    assert exchange == "app.pidbox"
    assert body["method"] == "terminate"  # what Celery's `control terminate` sends
    assert body["arguments"] == {"task_id": ["t-a", "t-b", "t-none"], "signal": "SIGTERM"}


# -- inspect scheduled ---------------------------------------------------------------------------

@pytest.fixture
def inspect_state(broker_url: str) -> Callable[..., AttributeDict]:
    """A Celery control state (what a worker's Panel commands get) over a real kombu
    connection, consuming the given queues: only the worker around it is left out."""
    opened: list[kombu.Connection] = []
    _scheduled.install()

    def make(*queues: str, url: str = broker_url) -> AttributeDict:
        conn = connect(url) if url.startswith("pgbroker") else kombu.Connection(url)
        opened.append(conn)
        consumer = AttributeDict(connection=conn, timer=Timer(), task_consumer=AttributeDict(
            queues=[kombu.Queue(q) for q in queues]))
        return AttributeDict(hostname="w1@host", consumer=consumer)

    yield make
    for conn in opened:
        conn.release()


def test_inspect_scheduled_lists_the_earliest_jobs_of_the_consumed_queues_within_bounds(
        broker_url: str, inspect_state: Callable[..., AttributeDict]) -> None:
    from celery.worker.control import Panel

    with client_app(broker_url) as app:
        for n in range(5):
            app.send_task(TASK, args=(n,), kwargs={"k": n}, task_id=f"a{n}", queue="qa",
                          countdown=600 - n, priority=n)
        app.send_task(TASK, args=("b",), task_id="b0", queue="qb", countdown=300)
        app.send_task(TASK, args=("x" * 5000,), task_id="big", queue="qb", countdown=900)
        app.send_task(TASK, args=("c",), task_id="c0", queue="qc", countdown=1)  # not consumed
        app.send_task(TASK, args=("now",), task_id="due", queue="qa")  # pending, not scheduled
    scheduled = Panel.data["scheduled"]
    assert Panel.data["dump_schedule"] is scheduled

    listed = scheduled(inspect_state("qa", "qb"))
    assert [e["request"]["id"] for e in listed] == ["b0", "a4", "a3", "a2", "a1", "a0", "big"]
    first = listed[1]
    assert first["priority"] == _scheduled.TIMER_PRIORITY == 6 and first["eta"].endswith("+00:00")
    assert first["request"] == {
        "id": "a4", "name": TASK, "args": [4], "kwargs": {"k": 4}, "type": TASK,
        "hostname": "w1@host", "time_start": None, "acknowledged": False,
        "delivery_info": {"exchange": "", "routing_key": "qa", "priority": 4,
                          "redelivered": False},
        "worker_pid": None}
    # a body too long to read in a reply: Celery's argsrepr header stands in for its arguments
    assert listed[-1]["request"]["args"].startswith("('xxxx") and \
        listed[-1]["request"]["kwargs"] == "{}"

    assert [e["request"]["id"] for e in scheduled(inspect_state("qa", "qb"), limit=2)] == [
        "b0", "a4"]
    assert len(scheduled(inspect_state("qa"), limit=10**9)) == 5  # capped, not an error
    # another broker: Celery's own command, which reads the worker's timer
    assert scheduled(inspect_state("qa", url="memory://")) == []


def test_the_admin_job_page_shows_a_cancelled_by_revoke_job_with_its_audit_entry(
        db_url: str, pg: psycopg.Connection) -> None:
    pytest.importorskip("flask")
    from pgbroker.admin import create_app
    from tests.support.admin import CREDS, csrf_of

    store = store_for(db_url)
    try:
        store.insert(new_job("q", ["x"], task=TASK, task_id="t-admin"))
        _revoke.apply(store, _revoke.RevokeRequest(("t-admin",)), via="celery revoke",
                      actor="bob")
    finally:
        store.close()
    (job,) = rows(pg, "true")
    app = create_app(db_url, credentials=CREDS, refresh=1)
    try:
        client = app.test_client()
        client.post("/login", data={"user": CREDS.user, "password": CREDS.password,
                                    "csrf_token": csrf_of(client.get("/login").text)})
        html = client.get(f"/jobs/{job['id']}").text
    finally:
        app.extensions["pgbroker"].close()
    assert "<th>revoked_at</th>" in html and "revoked by bob (celery revoke)" in html
    assert "job.revoke" in html and '"was": "pending"' in html
