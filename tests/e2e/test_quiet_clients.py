"""``celery inspect`` and ``celery status`` are quiet: a client that comes and goes is not an
incident, in its own output or in the worker's log.

Two warnings used to follow every call: the autovacuum warning on the client's stderr (it is for
the worker, once per start) and, in the worker's log, the sweeper's "0 job(s) of lost consumers
redelivered, 0 dead, 1 consumer(s) removed" when it forgot the finished client's consumer row.
The sweeper still warns when it rescues or buries jobs (tests/chaos).
"""

from __future__ import annotations

import psycopg

from tests.support.control import REPLY_TIMEOUT, celery_cli
from tests.support.workers import start_worker
from tests.support.processes import wait_for

AUTOVACUUM = "autovacuum is off"


def test_inspect_and_status_leave_no_warning_on_stderr_or_in_the_worker_log(
        broker_url: str, pg: psycopg.Connection) -> None:
    # the warning's condition, whatever the server's configuration
    pg.execute("ALTER TABLE pgbroker.jobs_live SET (autovacuum_enabled = false)")
    worker = start_worker(broker_url, "-c", "1", options={"sweep_interval": 0.5})
    assert worker.log().count(AUTOVACUUM) == 1  # the worker says it, once, at its start

    for command in (["inspect", "ping"], ["status"], ["inspect", "active"]):
        done = celery_cli(broker_url, *command, "-t", str(REPLY_TIMEOUT))
        assert "OK" in done.stdout or "->" in done.stdout, done.stdout
        assert AUTOVACUUM not in done.stderr and "WARNING" not in done.stderr, done.stderr

    # the clients' consumer rows are gone (unregistered, or forgotten by the worker's sweeper)
    def only_the_worker_left() -> bool:
        pids = {r[0] for r in pg.execute("SELECT pid FROM pgbroker.consumers")}
        return pids == {worker.pid}

    wait_for(only_the_worker_left, 30, message="the clients' consumer rows to go")
    worker.stop()
    warnings = [line for line in worker.log().splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and AUTOVACUUM in warnings[0], warnings
