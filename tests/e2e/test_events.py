"""Worker events and monitors over pgbroker: ``celery events --dump``, an in-process
``EventReceiver`` and Flower, against real ``celery worker`` processes.

Events are transient messages to the ``celeryev`` topic exchange: pgbroker hands them to the
monitors consuming at that moment as broadcasts (one ``broadcasts`` row each, pruned after a
minute) and never writes them to ``jobs``; with no monitor bound nothing is written at all.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from celery import Celery

from pgbroker._pg.store import Store
from pgbroker.settings import Settings
from pgbroker.sweeper import Sweeper
from tests.apps import e2e_app as e2e
from tests.support.control import node, start_celery, start_workers
from tests.support.workers import key_runs
from tests.support.processes import wait_for
from tests.support.db import free_port

TASK_EVENTS = ("task-received", "task-started", "task-succeeded")


def celeryev_rows(pg: psycopg.Connection) -> dict[str, int]:
    """Event messages in ``jobs`` (must stay 0) and in ``broadcasts``."""
    jobs, broadcasts = pg.execute(
        "SELECT (SELECT count(*) FROM pgbroker.jobs WHERE exchange = 'celeryev'),"
        " (SELECT count(*) FROM pgbroker.broadcasts WHERE exchange = 'celeryev')").fetchone()
    return {"jobs": jobs, "broadcasts": broadcasts}


@contextmanager
def event_receiver(app: Celery) -> Iterator[list[dict[str, Any]]]:
    """An ``EventReceiver`` capturing in a thread; yields the list of events it receives."""
    seen: list[dict[str, Any]] = []
    with app.connection_for_read() as conn:
        receiver = app.events.Receiver(conn, handlers={"*": seen.append})
        thread = threading.Thread(target=receiver.capture, kwargs={"wakeup": True}, daemon=True)
        thread.start()
        try:
            yield seen
        finally:
            receiver.should_stop = True
            thread.join(10)


def task_events(events: list[dict[str, Any]], task_id: str) -> list[str]:
    return [e["type"] for e in events if e.get("uuid") == task_id]


def test_task_events_reach_every_monitor_and_never_enter_jobs(
        producer: Celery, runs: psycopg.Connection, broker_url: str, db_url: str,
        tmp_path: Path) -> None:
    [worker] = start_workers(broker_url, ("-E",))
    dump = start_celery(broker_url, "evdump", "events", "--dump", log_dir=tmp_path)
    # the dump is bound once it prints the worker's heartbeats (every 2 s)
    dump.wait_for_log(f"{node(worker)} [", timeout=60)

    with event_receiver(producer) as seen:
        wait_for(lambda: any(e["type"] == "worker-heartbeat" for e in seen), 60,
                 message="a worker heartbeat at the EventReceiver")
        results = [e2e.touch.delay(f"ev{n}") for n in range(20)]
        for result in results:
            wait_for(lambda r=result: task_events(seen, r.id) == list(TASK_EVENTS), 60,
                     message=lambda r=result: f"received/started/succeeded of {r.id} "
                     f"(got {task_events(seen, r.id)})")
    last = results[-1].id
    for kind in ("received", "started", "succeeded"):
        dump.wait_for_log(f"task {kind}: tests.apps.e2e_app.touch({last})", timeout=30)

    # 20 tasks are 20 jobs; their 60 events (the worker sends task events in batches) and the
    # heartbeats went to the monitors as broadcasts, none of them as jobs
    assert runs.execute("SELECT count(*) FROM pgbroker.jobs").fetchone()[0] == 20
    rows = celeryev_rows(runs)
    assert rows["jobs"] == 0 and rows["broadcasts"] > 0
    print(f"\n[figure] event rows after 20 tasks with 2 monitors: {rows}")

    # Once no monitor is left (their queues expire, x-expires 60 s: aged here) and the
    # broadcasts are pruned, the worker writes no event anywhere.
    dump.stop()
    runs.execute("UPDATE pgbroker.queues SET last_used_at = now() - interval '1 hour'"
                  " WHERE name LIKE 'celeryev.%'")
    store = Store(db_url, Settings())
    try:
        def nothing_written() -> bool:
            runs.execute("UPDATE pgbroker.broadcasts SET created_at = now() - interval '61 s'")
            Sweeper(store).run_once()
            e2e.touch.apply_async(("quiet",))
            wait_for(lambda: key_runs(runs, "quiet"), 60, message="the quiet task to run")
            runs.execute("DELETE FROM public.runs WHERE key = 'quiet'")
            return celeryev_rows(runs) == {"jobs": 0, "broadcasts": 0}

        # the worker may route by bindings it read up to a second ago: try again until then
        wait_for(nothing_written, 60, interval=0.5, message="event rows to stop appearing")
    finally:
        store.close()
    assert runs.execute("SELECT count(*) FROM pgbroker.bindings WHERE exchange = 'celeryev'"
                        ).fetchone()[0] == 0


# -- Flower ----------------------------------------------------------------------------------------

def http_get(port: int, path: str) -> tuple[int, str]:
    """Status and body of ``GET http://127.0.0.1:<port><path>``; (0, why) when it cannot connect."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def test_flower_lists_the_worker_and_its_tasks(producer: Celery, runs: psycopg.Connection,
                                               broker_url: str, tmp_path: Path) -> None:
    [worker] = start_workers(broker_url, ())  # no -E: Flower turns events on by remote control
    name = node(worker)
    port = free_port()
    flower = start_celery(broker_url, "flower", "flower", f"--port={port}",
                          "--address=127.0.0.1", log_dir=tmp_path,
                          env={"FLOWER_UNAUTHENTICATED_API": "1"})
    wait_for(lambda: http_get(port, "/healthcheck")[0] == 200, 60,
             message=lambda: f"Flower to serve HTTP:\n{flower.log()[-2000:]}")

    # /api/workers?refresh=1 asks the workers (inspect stats, registered, active_queues, conf)
    def listed() -> dict[str, Any] | None:
        status, body = http_get(port, "/api/workers?refresh=1")
        workers = json.loads(body) if status == 200 else {}
        return workers if "stats" in workers.get(name, {}) else None

    workers = wait_for(listed, 60, interval=0.5, message=f"{name} in Flower's /api/workers")
    assert workers[name]["stats"]["broker"]["transport"] == "pgbroker"
    assert "tests.apps.e2e_app.touch" in workers[name]["registered"]

    # the task list comes from events: Flower sends enable_events to the workers every 5 s
    worker.wait_for_log("Events of group {task} enabled by remote.", timeout=60)
    result = e2e.touch.apply_async(("flower",))

    def state_in_flower() -> str | None:
        status, body = http_get(port, "/api/tasks")
        return json.loads(body).get(result.id, {}).get("state") if status == 200 else None

    wait_for(lambda: state_in_flower() == "SUCCESS", 60, interval=0.5,
             message=lambda: f"task {result.id} SUCCESS in Flower (is {state_in_flower()})")
    # The broker tab and queue lengths use RabbitMQ's management API or Redis commands only:
    # Flower answers "not supported" for pgbroker (see docs/remote-control.md).
    status, body = http_get(port, "/api/queues/length")
    assert status == 404 and "broker is not supported" in body
    assert worker.is_alive() and flower.is_alive()

