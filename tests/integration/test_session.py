"""The result backend and beat run on a Session, and so under the policy of pgbroker's own
statements (issue 28): generic plans, the session's settings, a connection that is not the
parent's after a fork."""

from __future__ import annotations

import os

import psycopg
import pytest
from celery import Celery

from pgbroker.backend import DatabaseBackend
from pgbroker.beat import Scheduler
from tests.support.transport import NO_POLL, LoopConsumer, connect, publish

SETTINGS = ("SELECT current_setting('plan_cache_mode'), "
            "current_setting('idle_in_transaction_session_timeout'), "
            "current_setting('application_name')")


@pytest.fixture
def app(broker_url: str) -> Celery:
    app = Celery("session-tests", broker=broker_url, backend=broker_url, set_as_current=False)
    app.conf.result_expires = None
    return app


def test_beats_connection_is_a_session_with_its_own_setting(app: Celery) -> None:
    scheduler = Scheduler(app)
    try:
        conn = scheduler.connection()
        assert conn.execute(SETTINGS).fetchone() == ("force_generic_plan", "30s",
                                                      "pgbroker beat")
        # a child process opens its own, never the parent's session
        conn._pgbroker_pid = os.getpid() + 1  # type: ignore[attr-defined]
        assert scheduler.connection() is not conn
    finally:
        scheduler.close()


def test_a_result_write_that_meets_a_deadlock_is_sent_again(app: Celery,
                                                            pg: psycopg.Connection) -> None:
    """As every statement of the broker's: a deadlock rolls the statement back whole, and the
    session sends it again (the backend's own retry is for lost connections only). The fault
    is made deterministic by a trigger that raises it once."""
    pg.execute("CREATE SEQUENCE public.once")
    pg.execute("""CREATE FUNCTION public.deadlock_once() RETURNS trigger LANGUAGE plpgsql AS $$
                  BEGIN
                      IF nextval('public.once') = 1 THEN
                          RAISE EXCEPTION 'deadlock detected' USING ERRCODE = '40P01';
                      END IF;
                      RETURN NEW;
                  END $$""")
    pg.execute("CREATE TRIGGER deadlock_once BEFORE INSERT ON pgbroker.results"
               " FOR EACH ROW EXECUTE FUNCTION public.deadlock_once()")
    backend = DatabaseBackend(app, url=app.conf.result_backend)
    try:
        backend.set("celery-task-meta-probe", b'{"status": "SUCCESS"}')
        assert backend.get("celery-task-meta-probe") == b'{"status": "SUCCESS"}'
        assert pg.execute("SELECT nextval('public.once')").fetchone() == (3,)  # failed once
        assert backend._session.conn.execute(SETTINGS).fetchone()[0::2] == (
            "force_generic_plan", "pgbroker results")
    finally:
        backend.close()


LOOP_SETTINGS = ("SELECT current_setting('plan_cache_mode'), "
                 "current_setting('synchronous_commit'), current_setting('lock_timeout')")


@pytest.mark.parametrize("durable_acks", [False, True])
def test_the_event_loops_claims_run_under_the_sessions_policy(
        broker_url: str, durable_acks: bool) -> None:
    """The LISTEN connection's claims and acks (LoopStatements) take the session's rules: generic
    plans, consumer bookkeeping's commit (flushed only with durable_acks), the claim's lock
    timeout."""
    with connect(broker_url, durable_acks=durable_acks, **NO_POLL) as conn, \
            connect(broker_url) as producer:
        consumer = LoopConsumer(conn, "loop-policy", prefetch=1)
        publish(producer, "one", "loop-policy")
        consumer.run_until(lambda: len(consumer.received) == 1)
        consumer.run_until(lambda: not conn.transport.consumer.line.busy)
        settings = conn.transport.consumer.listen().execute(LOOP_SETTINGS).fetchone()
        consumer.hub.close()
    assert settings == ("force_generic_plan", "on" if durable_acks else "off", "200ms")
