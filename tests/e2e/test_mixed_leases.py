"""Workers configured with different leases share a database (issue 27, item 4): each consumer
is judged by the lease it registered with, never by the setting of the worker that sweeps.

A worker with ``lease_timeout = 24`` heartbeats every 10 s; a worker with 6 s sweeps every
second. Before 0016 the sweeper judged every consumer by its own lease: the long-lease worker's
heartbeat turned older than 6 s in the middle of its long task, and its job was redelivered
while it ran. (The leases are short so that the test is: 20 s and 60 s, the defaults' scale,
took 45 s.)
"""

from __future__ import annotations

import psycopg
from celery import Celery

from tests.apps.e2e_app import nap
from tests.support.workers import key_runs, start_worker, wait_state
from tests.support.processes import wait_for

SHORT = {"lease_timeout": 6, "heartbeat_interval": 2, "sweep_interval": 1}
LONG = {"lease_timeout": 24, "heartbeat_interval": 10, "sweep_interval": 60}
NAP = 16  # seconds: more than one heartbeat interval of the long lease, so a silence > 6 s


def test_a_short_lease_sweeper_never_rescues_a_long_lease_workers_running_job(
        broker_url: str, producer: Celery, pg: psycopg.Connection) -> None:
    start_worker(broker_url, "-c", "1", "-Q", "short", options=SHORT)
    start_worker(broker_url, "-c", "1", "-Q", "long", options=LONG)
    assert sorted(r[0] for r in pg.execute(
        "SELECT DISTINCT lease_timeout FROM pgbroker.consumers")) == [
            SHORT["lease_timeout"], LONG["lease_timeout"]]

    result = nap.apply_async(("long-nap", NAP), queue="long")
    silence = 0.0  # the long-lease consumer's longest silence seen while its task ran

    def finished() -> bool:
        nonlocal silence
        if key_runs(pg, "long-nap"):
            row = pg.execute("SELECT max(extract(epoch FROM now() - heartbeat_at))::float8 "
                             "FROM pgbroker.consumers WHERE lease_timeout = %s",
                             (LONG["lease_timeout"],)).fetchone()
            silence = max(silence, row[0] or 0.0)
        return bool(key_runs(pg, "long-nap:done"))

    wait_for(finished, timeout=120, interval=0.2, message="the long nap to finish")
    # the short-lease worker swept every second while the long one was silent for longer
    # than 6 s: by its own setting it would have declared it lost
    assert silence > SHORT["lease_timeout"]
    row = wait_state(pg, result.id, "completed", timeout=30)  # its ack follows its end
    assert (row["state"], row["attempts"], row["last_error"]) == ("completed", 1, None)
    assert [r["redelivered"] for r in key_runs(pg, "long-nap")] == [False]
