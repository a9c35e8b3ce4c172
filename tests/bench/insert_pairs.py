"""The cost of a change to ``job_insert``, in adjacent pairs: the insert of a git revision
(default ``main``) and this tree's, alternating statement by statement on one table (this tree's
schema), so that a load drift on a shared machine hits both alike. Each inserts one Celery-like
message, prepared and with its generic plan, as ``Store.insert`` sends it. Prints the medians and
the median of the pairs' ratios (this tree / the other).

    python -m tests.bench.insert_pairs [--against REV] [--pairs N] [--server URL]

A statement-level ratio on a durable commit each (the WAL flush is most of it), not a publish
rate.
"""

from __future__ import annotations

import time
import uuid

import psycopg

from pgbroker._model.job import NewJob, row_params
from pgbroker._pg.catalogue import queries
from tests.bench.claim_pairs import WARMUP, arguments, claim_of, report
from tests.bench.harness import bench_database


def _job() -> NewJob:
    task_id = str(uuid.uuid4())
    return NewJob(id=uuid.uuid4(), queue="celery", body=b"[[], {}, {}]", task="bench.noop",
                  task_id=task_id, content_type="application/json", content_encoding="utf-8",
                  headers={"task": "bench.noop", "id": task_id}, properties={},
                  routing_key="celery")


def measure(url: str, statements: dict[str, str], pairs: int) -> dict[str, list[float]]:
    conns = {}
    for name in statements:
        conn = psycopg.connect(url, autocommit=True)
        conn.execute("SET plan_cache_mode = force_generic_plan")   # as pgbroker's Store
        conns[name] = conn
    times: dict[str, list[float]] = {name: [] for name in statements}
    names = list(statements)
    for i in range(pairs):
        for name in (names if i % 2 == 0 else names[::-1]):
            params = {**row_params(_job()), "channel": "pgbroker.jobs"}
            began = time.perf_counter()
            conns[name].execute(statements[name], params, prepare=True).fetchall()
            times[name].append(time.perf_counter() - began)
    for conn in conns.values():
        conn.close()
    return {name: t[WARMUP:] for name, t in times.items()}


def main() -> None:
    args = arguments(__doc__).parse_args()
    with bench_database(args.server, "insert_pairs") as url:  # migrated by this tree
        times = measure(url, {"other": claim_of(args.against, "job_insert"),
                              "this": queries("pgbroker")["job_insert"]}, args.pairs)
    report(times, args.against, "insert")


if __name__ == "__main__":
    main()
