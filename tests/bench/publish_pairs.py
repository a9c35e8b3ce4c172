"""The cost of a change to the publish path, in adjacent pairs: a git revision's pgbroker
(default ``main``, exported with ``git archive``) and this tree's, each in a process of its own
on a database it migrated, publishing bursts in turn (A B, B A, ...), so that a load drift on a
shared machine hits both alike. Prints each side's median rate and the median of the pairs'
ratios (this tree / the other).

    python -m tests.bench.publish_pairs [--against REV] [--pairs N] [--burst N]
                                        [--mode delay|bulk|statement] [--fast]
                                        [--server URL]

``delay``: ``.delay()`` of the bench's no-op task from one thread (the harness's publish
measurement: Celery, kombu, ``job_insert``, a commit each); ``bulk``: ``pgbroker.enqueue_many``
of the burst in one transaction (``job_insert_many``); ``statement``: the side's own
``job_insert`` alone, prepared, each its own transaction (no Celery, no kombu: the statement's
cost, which the Python around it dilutes in ``delay``). ``--fast``: ``durable_publish`` off (the
commit does not wait for the WAL flush).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
WARMUP = 200  # publishes before the first burst: connections, declarations, prepared statements


def child(server: str, mode: str, fast: bool) -> None:
    """One side: reads a burst size per line on stdin, publishes it, writes its seconds."""
    import psycopg

    import uuid6

    import pgbroker
    try:
        from pgbroker._model.job import NewJob, row_params
        from pgbroker._pg.catalogue import queries
    except ImportError:  # a tree from before the wings (issue 28)
        from pgbroker._model.job import NewJob, row_params  # type: ignore[no-redef]
        from pgbroker._pg.catalogue import queries  # type: ignore[no-redef]
    from tests.bench.benchapp import TASK_NAME, make_app
    from tests.bench.harness import bench_database

    with bench_database(server, f"publish_pairs_{os.getpid()}") as url:
        broker = "pgbroker+" + url
        app = make_app(broker, "celery",
                       transport_options={"durable_publish": False} if fast else {})
        task = app.tasks[TASK_NAME]
        conn = psycopg.connect(url, autocommit=mode == "statement")
        if fast:
            conn.execute("SET synchronous_commit = off")
        insert = queries("pgbroker")["job_insert"]
        print(pgbroker.__file__, flush=True)

        def burst(n: int) -> None:
            if mode == "delay":
                for _ in range(n):
                    task.delay()
            elif mode == "statement":
                for _ in range(n):
                    job = NewJob(id=uuid6.uuid7(), queue="celery", body=b"[[], {}, {}]",
                                 content_type="application/json", content_encoding="utf-8",
                                 headers={"task": TASK_NAME}, properties={}, task=TASK_NAME,
                                 task_id=str(uuid6.uuid7()))
                    conn.execute(insert, {**row_params(job), "channel": "pgbroker.jobs"},
                                 prepare=True)
            else:
                pgbroker.enqueue_many(conn, [(task, (), {})] * n, app=app)
                conn.commit()

        burst(WARMUP)
        for line in sys.stdin:
            n = int(line)
            began = time.perf_counter()
            burst(n)
            print(time.perf_counter() - began, flush=True)
        conn.close()
        app.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="main", metavar="REV")
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--burst", type=int, default=1000)
    parser.add_argument("--mode", choices=("delay", "bulk", "statement"), default="delay")
    parser.add_argument("--fast", action="store_true", help="durable_publish off")
    parser.add_argument("--server", default=os.environ.get(
        "PGBROKER_BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.server, args.mode, args.fast)
        return
    repo = HERE.parents[2]
    with tempfile.TemporaryDirectory(prefix="publish_pairs_") as other:
        archive = subprocess.run(["git", "-C", str(repo), "archive", args.against],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", other], input=archive, check=True)
        sides = {}
        for name, tree in (("other", other), ("this", str(repo))):
            argv = [sys.executable, str(HERE), "--child", "--mode", args.mode,
                    "--server", args.server] + (["--fast"] if args.fast else [])
            # cwd and PYTHONPATH = the tree: its pgbroker (and its tests.bench) are the ones used
            sides[name] = subprocess.Popen(argv, cwd=tree, text=True, stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE,
                                           env={**os.environ, "PYTHONPATH": tree})
        for name, proc in sides.items():
            print(f"{name}: {proc.stdout.readline().strip()}", file=sys.stderr)
        rates: dict[str, list[float]] = {"other": [], "this": []}
        try:
            for i in range(args.pairs):
                for name in (("other", "this") if i % 2 == 0 else ("this", "other")):
                    proc = sides[name]
                    proc.stdin.write(f"{args.burst}\n")
                    proc.stdin.flush()
                    rates[name].append(args.burst / float(proc.stdout.readline()))
        finally:
            for proc in sides.values():
                proc.stdin.close()
                proc.wait(60)
    ratios = [b / a for a, b in zip(rates["other"], rates["this"])]
    q = statistics.quantiles(ratios, n=4)
    print(f"{args.pairs} pairs of {args.burst:,} ({args.mode}"
          f"{', durable_publish off' if args.fast else ''}): median {args.against} "
          f"{statistics.median(rates['other']):,.0f}/s, this tree "
          f"{statistics.median(rates['this']):,.0f}/s; median ratio this/{args.against} "
          f"{statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")


if __name__ == "__main__":
    main()
