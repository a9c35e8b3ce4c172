"""The admin page's per-minute statistics (migration 0006): the sweeper's rollup, every number
exact, the depth samples, and the charts drawn from them. Rows are fabricated with SQL as the
transport leaves them (finished rows keep their claim's time in locked_at).
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from flask.testing import FlaskClient

from pgbroker._pg.store import Store
from pgbroker.settings import Settings
from pgbroker.sweeper import Sweeper
from tests.support.db import add_job


def minute_ago(pg: psycopg.Connection, minutes: int, second: float = 20.0) -> datetime:
    """``second`` seconds into the minute that began ``minutes`` minutes ago (database clock)."""
    return pg.execute("SELECT date_trunc('minute', now()) - make_interval(mins => %s)"
                      " + make_interval(secs => %s)", (minutes, second)).fetchone()[0]


def finished(pg: psycopg.Connection, state: str, at: datetime, run_ms: float = 250,
             wait_ms: float = 40, **cols: Any) -> uuid.UUID:
    """A job that was due at ``at - run - wait``, claimed ``wait`` later, finished at ``at``."""
    claimed = at - timedelta(milliseconds=run_ms)
    return add_job(pg, state, updated_at=at, locked_at=claimed,
                   run_at=claimed - timedelta(milliseconds=wait_ms), attempts=1, **cols)


@pytest.fixture
def store(db_url: str) -> Any:
    store = Store(db_url, Settings())
    yield store
    store.close()


def stats_rows(pg: psycopg.Connection) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    return {(m, q, t): tuple(rest) for m, q, t, *rest in pg.execute(
        "SELECT minute, queue, task, succeeded, retried, failed, cancelled, expired, run_ms,"
        " wait_ms FROM pgbroker.stats_finished")}


def test_the_rollup_counts_each_closed_minute_once(pg: psycopg.Connection, store: Store) -> None:
    five, two = minute_ago(pg, 5), minute_ago(pg, 2)
    for _ in range(3):
        finished(pg, "completed", five)
    finished(pg, "dead", five, run_ms=3000, last_error="ValueError: boom")
    finished(pg, "cancelled", five, task="t.b")
    # a Celery retry: the first try completed, the next (same task id, retries + 1) is pending
    finished(pg, "completed", two, task_id="celery-1", retries=0)
    add_job(pg, "pending", task_id="celery-1", retries=1)
    finished(pg, "completed", minute_ago(pg, 0, 0.0))  # the open minute: not rolled up yet

    assert store.rollup() > 0
    rows = stats_rows(pg)
    five_m, two_m = (t.replace(second=0, microsecond=0) for t in (five, two))
    assert rows[(five_m, "q1", "t.a")][:5] == (3, 0, 1, 0, 0)
    assert rows[(five_m, "q1", "t.b")][:5] == (0, 0, 0, 1, 0)
    assert rows[(two_m, "q1", "t.a")][:5] == (0, 1, 0, 0, 0)
    # run time 250 ms: bucket 1 + floor(2 log2 250) = 16; 3 s: 24; waits of 40 ms: bucket 11
    assert rows[(five_m, "q1", "t.a")][5:] == ({"16": 3, "24": 1}, {"11": 4})
    assert rows[(five_m, "q1", "t.b")][5:] == ({}, {})  # a cancelled job never ran
    assert len(rows) == 3

    upto = pg.execute("SELECT finished_upto FROM pgbroker.stats_rollup").fetchone()[0]
    assert store.rollup() == 0  # nothing due: nothing written
    assert pg.execute("SELECT finished_upto FROM pgbroker.stats_rollup").fetchone()[0] == upto
    assert stats_rows(pg) == rows


def test_one_sweeper_rolls_up_and_the_others_pass(pg: psycopg.Connection, store: Store,
                                                  db_url: str) -> None:
    finished(pg, "completed", minute_ago(pg, 3))
    with psycopg.connect(db_url) as other:  # another sweeper, in the middle of its rollup
        other.execute("SELECT * FROM pgbroker.stats_rollup FOR UPDATE")
        assert store.rollup() == 0  # did not wait for it, did not do it twice
        other.rollback()
    assert store.rollup() > 0
    assert pg.execute("SELECT sum(succeeded) FROM pgbroker.stats_finished").fetchone() == (1,)


def test_the_backlog_is_sampled_once_a_minute(pg: psycopg.Connection, store: Store) -> None:
    for _ in range(4):
        add_job(pg, "pending", run_at=minute_ago(pg, 1))
    add_job(pg, "scheduled", run_at=minute_ago(pg, -10))
    add_job(pg, "running", task="t.b")
    store.rollup()
    add_job(pg, "pending")  # after the sample: in the next minute's
    store.rollup()
    rows = pg.execute("SELECT task, pending, scheduled, running, oldest_pending > 30"
                      " FROM pgbroker.stats_depth ORDER BY task").fetchall()
    assert rows == [("t.a", 4, 1, 0, True), ("t.b", 0, 0, 1, None)]


def test_the_sweeper_rolls_up(pg: psycopg.Connection, store: Store) -> None:
    finished(pg, "completed", minute_ago(pg, 2))
    assert Sweeper(store).run_once().statistics >= 1
    assert Sweeper(store).run_once().statistics == 0


def test_statistics_older_than_a_week_are_dropped(pg: psycopg.Connection, store: Store) -> None:
    pg.execute("INSERT INTO pgbroker.stats_finished (minute, queue, succeeded) VALUES"
               " (date_trunc('minute', now() - interval '8 days'), 'q1', 1),"
               " (date_trunc('minute', now() - interval '6 days'), 'q1', 1)")
    store.rollup()
    assert pg.execute("SELECT count(*) FROM pgbroker.stats_finished").fetchone() == (1,)


def test_the_charts_show_rolled_up_and_live_minutes(client: FlaskClient,
                                                    pg: psycopg.Connection) -> None:
    for minutes in (30, 20, 3):
        for _ in range(2):
            finished(pg, "completed", minute_ago(pg, minutes))
    finished(pg, "dead", minute_ago(pg, 20), run_ms=3000)
    # no sweeper has run: the page rolls up itself, then reads the open minute live
    html = client.get("/").text
    assert "<strong>7</strong> finished, <strong class=\"fail-text\">1</strong> failed" in html
    assert pg.execute("SELECT sum(succeeded) FROM pgbroker.stats_finished").fetchone() == (6,)
    finished(pg, "completed", minute_ago(pg, 0, 0.5))  # this minute: live from jobs
    live = client.get("/charts").text
    assert "<strong>8</strong> finished" in live
    assert live.count('<svg class="chart"') == 4
    assert 'aria-label="Jobs finished per minute: 8 in all' in live
    # the last 15 minutes only
    assert "<strong>3</strong> finished" in client.get("/charts", query_string={
        "range": "15m"}).text
    # a custom range, in the past: not live, and the by-task table says what it holds
    since, until = (minute_ago(pg, m, 0).strftime("%Y-%m-%dT%H:%M") for m in (25, 10))
    past = client.get("/", query_string={"from": since, "to": until}).text
    assert "<strong>3</strong> finished, <strong class=\"fail-text\">1</strong> failed" in past
    assert 'hx-get="/charts' not in past
    assert 'data-task="t.a"' in past


def test_charts_of_one_queue_and_task(client: FlaskClient,
                                      pg: psycopg.Connection) -> None:
    pg.execute("INSERT INTO pgbroker.queues (name) VALUES ('q2')")
    finished(pg, "completed", minute_ago(pg, 4))
    finished(pg, "completed", minute_ago(pg, 4), queue="q2", task="t.z")
    finished(pg, "completed", minute_ago(pg, 4), queue="q2", task="t.y")
    assert "<strong>2</strong> finished" in client.get("/queues/q2").text
    page = client.get("/queues/q2", query_string={"task": "t.z"}).text
    assert "<strong>1</strong> finished" in page and "task <code>t.z</code>" in page
    assert client.get("/queues/nope").status_code == 404
