"""The cost of a change to ``job_claim``, in adjacent pairs: the claim of a git revision (default
``main``) and this tree's, alternating statement by statement on one table (each claims 10 and
acks its own previous 10, as a worker folds its acks), so that a load drift on a shared machine
hits both alike. Prints the medians and the median of the pairs' ratios (this tree / the other).

    python -m tests.bench.claim_pairs [--against REV] [--pairs N] [--server URL]

A statement-level ratio, not a drain rate: the worker's drain spends most of its time elsewhere
(docs/benchmarks.md, "Where a pgbroker worker's time goes").
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import time
import uuid

import psycopg

from pgbroker._sql import queries
from tests.bench.harness import DEFAULT_SERVER_URL, bench_database, fill
from tests.support.processes import REPO_ROOT

SAMPLE = {"task": "bench.noop", "routing_key": "celery", "body": b"[[], {}, {}]",
          "content_type": "application/json", "content_encoding": "utf-8",
          "headers": {"task": "bench.noop"}, "properties": {}}
WARMUP = 50  # pairs left out: the first executions prepare and plan


def claim_of(rev: str) -> str:
    """``job_claim`` as the revision ``rev`` of sql/queries.sql has it."""
    text = subprocess.run(["git", "-C", str(REPO_ROOT), "show", f"{rev}:pgbroker/sql/queries.sql"],
                          capture_output=True, text=True, check=True).stdout
    parts = re.split(r"^-- name: (\w+)\s*$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))["job_claim"].replace("{schema}", '"pgbroker"').strip()


def measure(url: str, statements: dict[str, str], pairs: int) -> dict[str, list[float]]:
    fill(url, SAMPLE, "celery", "pending", pairs * 20 + 100)
    conns = {}
    for name in statements:
        conn = psycopg.connect(url, autocommit=True)
        conn.execute("SET plan_cache_mode = force_generic_plan")   # as pgbroker's Store
        conn.execute("SET synchronous_commit = off")               # durable_acks off
        conns[name] = conn
    first = next(iter(conns.values()))
    first.execute("ANALYZE pgbroker.jobs")
    consumer = uuid.uuid4()
    first.execute("INSERT INTO pgbroker.consumers (id, host, pid) VALUES (%s, 'bench', 1)",
                  (consumer,))
    acks: dict[str, list[tuple[uuid.UUID, int]]] = {name: [] for name in statements}
    times: dict[str, list[float]] = {name: [] for name in statements}
    names = list(statements)
    for i in range(pairs):
        for name in (names if i % 2 == 0 else names[::-1]):
            params = {"queue": "celery", "limit": 10, "consumer": consumer,
                      "ids": [a[0] for a in acks[name]], "attempts": [a[1] for a in acks[name]]}
            began = time.perf_counter()
            rows = conns[name].execute(statements[name], params, prepare=True).fetchall()
            times[name].append(time.perf_counter() - began)
            acks[name] = [(r[0], r[2]) for r in rows]
    for conn in conns.values():
        conn.close()
    return {name: t[WARMUP:] for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="main", metavar="REV")
    parser.add_argument("--pairs", type=int, default=1500)
    parser.add_argument("--server", default=DEFAULT_SERVER_URL, metavar="URL")
    args = parser.parse_args()
    with bench_database(args.server, "claim_pairs") as url:  # migrated by this tree
        times = measure(url, {"other": claim_of(args.against),
                              "this": queries("pgbroker")["job_claim"]}, args.pairs)
    ratios = [b / a for a, b in zip(times["other"], times["this"])]
    q = statistics.quantiles(ratios, n=4)
    print(f"{len(ratios)} pairs: median claim+ack {args.against} "
          f"{statistics.median(times['other']) * 1000:.3f} ms, this tree "
          f"{statistics.median(times['this']) * 1000:.3f} ms; median ratio this/{args.against} "
          f"{statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")


if __name__ == "__main__":
    main()
