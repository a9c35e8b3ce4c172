"""The cost of a change to ``job_claim``, in adjacent pairs: the claim of a git revision (default
``main``) and this tree's, alternating statement by statement on one table (each claims 10 and
acks its own previous 10, as a worker folds its acks), so that a load drift on a shared machine
hits both alike. Prints the medians and the median of the pairs' ratios (this tree / the other).

    python -m tests.bench.claim_pairs [--against REV] [--pairs N] [--server URL] [--own-schema]

Both statements are sent without their comment lines, as pgbroker._pg.catalogue sends its own.
``--own-schema``: each on a database migrated by its own revision (a change to an index).

A statement-level ratio, not a drain rate: the worker's drain spends most of its time elsewhere
(docs/benchmarks.md, "Where a pgbroker worker's time goes").
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import time
import uuid

import psycopg

from pgbroker._model.claimed import after_params
from pgbroker._pg.catalogue import queries, without_comment_lines
from pgbroker.migrate import Migration, apply
from tests.bench.harness import DEFAULT_SERVER_URL, bench_database, empty_database, fill
from tests.support.processes import REPO_ROOT

SAMPLE = {"task": "bench.noop", "routing_key": "celery", "body": b"[[], {}, {}]",
          "content_type": "application/json", "content_encoding": "utf-8",
          "headers": {"task": "bench.noop"}, "properties": {}}
WARMUP = 50  # pairs left out: the first executions prepare and plan


def claim_of(rev: str, name: str = "job_claim") -> str:
    """``job_claim`` (or statement ``name``) as the revision ``rev`` of sql/queries.sql has it,
    sent as this tree sends its own (without the comment lines: pgbroker._pg.catalogue)."""
    text = subprocess.run(["git", "-C", str(REPO_ROOT), "show", f"{rev}:pgbroker/sql/queries.sql"],
                          capture_output=True, text=True, check=True).stdout
    parts = re.split(r"^-- name: (\w+)\s*$", text, flags=re.M)
    body = dict(zip(parts[1::2], parts[2::2]))[name].replace("{schema}", '"pgbroker"')
    return without_comment_lines(body).strip()


def migrations_of(rev: str) -> tuple[Migration, ...]:
    """The schema migrations of revision ``rev``."""
    folder = "pgbroker/sql/migrations"
    names = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-tree", "--name-only",
                            f"{rev}:{folder}"], capture_output=True, text=True,
                           check=True).stdout.split()
    return tuple(Migration(int(n[:4]), n[5:-4], subprocess.run(
        ["git", "-C", str(REPO_ROOT), "show", f"{rev}:{folder}/{n}"], capture_output=True,
        text=True, check=True).stdout) for n in sorted(names) if n.endswith(".sql"))


def measure(url: str | dict[str, str], statements: dict[str, str],
            pairs: int) -> dict[str, list[float]]:
    """``url``: one table for all, or each statement's own database (``{name: url}``)."""
    urls = url if isinstance(url, dict) else dict.fromkeys(statements, url)
    consumer = uuid.uuid4()
    conns = {}
    for name in statements:
        conn = psycopg.connect(urls[name], autocommit=True)
        conn.execute("SET plan_cache_mode = force_generic_plan")   # as pgbroker's Store
        conn.execute("SET synchronous_commit = off")               # durable_acks off
        conns[name] = conn
    for name in {urls[n]: n for n in statements}.values():  # once per database
        fill(urls[name], SAMPLE, "celery", "pending", pairs * 20 + 100)
        conns[name].execute("ANALYZE pgbroker.jobs")
        conns[name].execute("INSERT INTO pgbroker.consumers (id, host, pid) "
                            "VALUES (%s, 'bench', 1)", (consumer,))
    acks: dict[str, list[tuple[uuid.UUID, int]]] = {name: [] for name in statements}
    times: dict[str, list[float]] = {name: [] for name in statements}
    names = list(statements)
    for i in range(pairs):
        for name in (names if i % 2 == 0 else names[::-1]):
            params = {"queue": "celery", "limit": 10, "consumer": consumer,
                      "ids": [a[0] for a in acks[name]], "attempts": [a[1] for a in acks[name]],
                      **after_params()}
            began = time.perf_counter()
            rows = conns[name].execute(statements[name], params, prepare=True).fetchall()
            times[name].append(time.perf_counter() - began)
            acks[name] = [(r[0], r[2]) for r in rows]
    for conn in conns.values():
        conn.close()
    return {name: t[WARMUP:] for name, t in times.items()}


def arguments(doc: str) -> argparse.ArgumentParser:
    """The options of a pairs bench: --against, --pairs, --server."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--against", default="main", metavar="REV")
    parser.add_argument("--pairs", type=int, default=1500)
    parser.add_argument("--server", default=DEFAULT_SERVER_URL, metavar="URL")
    return parser


def report(times: dict[str, list[float]], against: str, what: str) -> None:
    """Print the medians and the median of the pairs' ratios (this tree / ``against``)."""
    ratios = [b / a for a, b in zip(times["other"], times["this"])]
    q = statistics.quantiles(ratios, n=4)
    print(f"{len(ratios)} pairs: median {what} {against} "
          f"{statistics.median(times['other']) * 1000:.3f} ms, this tree "
          f"{statistics.median(times['this']) * 1000:.3f} ms; median ratio this/{against} "
          f"{statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--own-schema", action="store_true",
                        help="each claim on a database of its own revision's schema (for a "
                             "change to the indexes: the other claim may not fit this tree's)")
    args = parser.parse_args()
    statements = {"other": claim_of(args.against), "this": queries("pgbroker")["job_claim"]}
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(bench_database(args.server, "claim_pairs"))  # this tree's
        if args.own_schema:
            other = stack.enter_context(empty_database(
                args.server, f"pgbroker_bench_claim_pairs_other_{os.getpid()}"))
            apply(other, "pgbroker", migrations_of(args.against))
            url = {"other": other, "this": url}
        times = measure(url, statements, args.pairs)
    report(times, args.against, "claim+ack")


if __name__ == "__main__":
    main()
