"""Issue 26's compressed soak: millions of tasks through one queue, with the default retention.

Finished jobs stay for ``retention`` (24 h by default); since 0020_finished_partition.sql they
stay in ``jobs_done``, out of the table every claim and ack works in (``jobs_live``). This run
pushes ``--tasks`` jobs (2,000,000 by default) through one queue at ``--rate`` jobs/s by the
wall clock (without a rate, as fast as the machine allows), on a PostgreSQL server of its own
(``initdb``, ``pg_stat_statements``), with autovacuum on or off for the whole run
(``--autovacuum``), and samples every ``--every`` tasks:

* the claim: its mean time, shared buffers (hit + read) and rows per call over the sample, from
  ``pg_stat_statements`` (job_claim, the statement the transport sends: acks folded in);
* the hot table: ``jobs_live``'s heap and index sizes, its dead row versions, the backlog;
* the finished rows: ``jobs_done``'s heap and index sizes (they grow: a day of history).

The load is pgbroker's own hot path without Celery's per-task overhead, so that millions fit in
minutes: a producer process writes batches with ``Store.insert_many`` (the statement of
``enqueue_many``), what is due by the rate (a backlog that grows is the consumers falling
behind, and shows), or without a rate keeping at most ``--backlog`` jobs waiting;
``--consumers`` processes each claim up to 100 jobs a statement with the previous batch's acks
folded in (``Store.claim``, as the transport's event loop does), starting after their cursor and
from the head every sixth claim (pgbroker._consume.claim_policy.ClaimPolicy's rule). With
autovacuum off the monitor runs the sweeper's VACUUM fallback (pgbroker._pg.vacuum.VacuumFallback)
every 15 s, as every worker's sweeper does.

Printed: a line per sample, then a table; ``soak-<autovacuum>.json`` in ``--out`` holds every
figure, and ``--plot`` draws the claim and the sizes against tasks done (matplotlib, the ``bench``
extra). Nothing is asserted about speed.

Run::

    python -m tests.bench.soak --rate 1000 --autovacuum on  --out /tmp/soak
    python -m tests.bench.soak --rate 1000 --autovacuum off --out /tmp/soak --plot docs/soak.png

The hot table's size is the rate times the time between two VACUUMs (a minute: autovacuum's
naptime, the fallback's interval), so a paced run measures the table at one churn; an unpaced
one measures the machine's speed as well.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import uuid6

from pgbroker._pg import vacuum as _vacuum
from pgbroker._model.claimed import HEAD
from pgbroker._model.job import NewJob
from pgbroker._pg.store import Store
from pgbroker.migrate import migrate
from pgbroker.settings import Settings
from tests.bench.capacity import stats_server

QUEUE = "soak"
TASK = "soak.noop"
BATCH = 1000          # jobs a producer statement writes
PACED_BATCH = 50      # jobs a paced producer waits to be due before it writes them
CLAIM = 100           # jobs a claim takes
RESCAN = 30.0         # seconds between two claims from the head (the 6th poll of 5 s)
VACUUM_EVERY = 15.0   # seconds between two looks of the VACUUM fallback (autovacuum off)


def _job(n: int) -> NewJob:
    return NewJob(id=uuid6.uuid7(), queue=QUEUE, body=json.dumps([[n], {}, {}]).encode(),
                  content_type="application/json", content_encoding="utf-8",
                  headers={"task": TASK, "id": f"soak-{n}"}, properties={},
                  routing_key=QUEUE, task=TASK, task_id=f"soak-{n}")


def produce(url: str, total: int, backlog: int, published: Any, done: Any,
            rate: float = 0.0) -> None:
    """Publish ``total`` jobs: at ``rate`` jobs/s by the wall clock (what is due since the start,
    in batches of up to BATCH; a backlog that grows is the consumers falling behind, and shows),
    or, without a rate, as fast as the consumers keep at most ``backlog`` waiting."""
    store = Store(url, Settings())
    n, started = 0, time.monotonic()
    try:
        while n < total:
            if rate:
                due = int(rate * (time.monotonic() - started))
                wait = due - n < min(PACED_BATCH, total - n)
            else:
                due, wait = total, published.value - done.value >= backlog
            if wait:
                time.sleep(0.01)
                continue
            size = min(BATCH, total - n, due - n)
            store.insert_many([_job(n + i) for i in range(size)])
            n += size
            with published.get_lock():
                published.value += size
    finally:
        store.close()


def consume(url: str, total: int, done: Any, failed: Any, idle: float = 0.002) -> None:
    store = Store(url, Settings())
    me = uuid.uuid4()
    after, acks, rescan_at = HEAD, [], time.monotonic() + RESCAN
    try:
        while done.value < total or acks:
            if time.monotonic() >= rescan_at:
                after, rescan_at = HEAD, time.monotonic() + RESCAN
            try:
                rows = store.claim(QUEUE, CLAIM, me, acks=acks, after=after)
            except psycopg.Error as exc:  # the transport waits, claims again (FAILED_CLAIM_WAIT)
                print(f"a claim failed: {exc.sqlstate} {str(exc).splitlines()[0]}", flush=True)
                with failed.get_lock():
                    failed.value += 1
                time.sleep(0.5)
                continue
            if acks:
                with done.get_lock():
                    done.value += len(acks)
            acks = [(r.id, r.attempt) for r in rows]
            if rows:
                last = rows[-1]
                after = (-last.priority, last.run_at, last.id)
            elif done.value < total:
                time.sleep(idle)
    finally:
        store.close()


CLAIM_PREFIX = "WITH candidates AS MATERIALIZED"


def sample(pg: psycopg.Connection, tasks: int, started: float) -> dict[str, Any]:
    claim = pg.execute(
        "SELECT sum(calls), sum(total_exec_time), sum(shared_blks_hit + shared_blks_read),"
        " sum(rows)"
        " FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database"
        " WHERE datname = current_database()) AND query LIKE %s",
        (CLAIM_PREFIX + "%",)).fetchone()
    sizes = pg.execute(
        "SELECT pg_relation_size('pgbroker.jobs_live'), pg_indexes_size('pgbroker.jobs_live'),"
        " pg_relation_size('pgbroker.jobs_done'), pg_indexes_size('pgbroker.jobs_done'),"
        " (SELECT n_dead_tup FROM pg_stat_user_tables"
        " WHERE relid = 'pgbroker.jobs_live'::regclass),"
        " (SELECT count(*) FROM pgbroker.jobs_live WHERE state = 'pending'),"
        " (SELECT autovacuum_count + vacuum_count FROM pg_stat_user_tables"
        "  WHERE relid = 'pgbroker.jobs_live'::regclass)").fetchone()
    return {"tasks": tasks, "seconds": time.monotonic() - started,
            "claim_calls": float(claim[0] or 0), "claim_ms_total": float(claim[1] or 0),
            "claim_blocks_total": float(claim[2] or 0), "claim_rows_total": float(claim[3] or 0),
            "live_heap": sizes[0], "live_indexes": sizes[1], "done_heap": sizes[2],
            "done_indexes": sizes[3], "live_dead": sizes[4], "backlog": sizes[5],
            "live_vacuums": sizes[6]}


def per_sample(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each sample with its claim figures over the interval since the one before."""
    out, before = [], None
    for s in samples:
        calls = s["claim_calls"] - (before["claim_calls"] if before else 0)
        row = {k: s[k] for k in ("tasks", "seconds", "live_heap", "live_indexes", "done_heap",
                                 "done_indexes", "live_dead", "backlog", "live_vacuums",
                                 "failed_claims")}
        row["claim_ms"] = (s["claim_ms_total"] - (before["claim_ms_total"] if before else 0)
                           ) / calls if calls else 0.0
        row["claim_blocks"] = (s["claim_blocks_total"]
                               - (before["claim_blocks_total"] if before else 0)) / calls \
            if calls else 0.0
        row["claim_rows"] = (s["claim_rows_total"] - (before["claim_rows_total"] if before else 0)
                             ) / calls if calls else 0.0
        row["rate"] = (s["tasks"] - (before["tasks"] if before else 0)) / max(
            s["seconds"] - (before["seconds"] if before else 0), 1e-9)
        out.append(row)
        before = s
    return out


def run(tasks: int, every: int, autovacuum: bool, consumers: int, backlog: int,
        rate: float = 0.0, log: Any = print) -> dict[str, Any]:
    settings = {"autovacuum": "on" if autovacuum else "off", "log_autovacuum_min_duration": "0"}
    with stats_server(settings) as server:
        url = server.create_database()
        migrate(url)
        ctx = mp.get_context("spawn")
        published, done, failed = ctx.Value("q", 0), ctx.Value("q", 0), ctx.Value("q", 0)
        procs = [ctx.Process(target=produce, args=(url, tasks, backlog, published, done, rate))]
        # paced, an idle consumer claims again after 10 ms (the transport waits for a NOTIFY)
        procs += [ctx.Process(target=consume, args=(url, tasks, done, failed,
                                                    0.01 if rate else 0.002))
                  for _ in range(consumers)]
        samples: list[dict[str, Any]] = []
        fallback = _vacuum.VacuumFallback(url, Settings(), background=False)
        with psycopg.connect(url, autocommit=True) as pg:
            pg.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            pg.execute("SELECT pg_stat_statements_reset()")
            started = time.monotonic()
            for p in procs:
                p.start()
            mark, next_vacuum = every, time.monotonic() + VACUUM_EVERY
            while True:
                alive = any(p.is_alive() for p in procs)
                sampled = samples[-1]["tasks"] if samples else 0
                if done.value >= mark or (not alive and done.value > sampled):
                    time.sleep(0.6)  # the sessions' statistics reach the server (PGSTAT)
                    s = sample(pg, done.value, started)
                    s["failed_claims"] = failed.value
                    samples.append(s)
                    r = per_sample(samples)[-1]
                    log(f"{r['tasks']:>9,} tasks {r['seconds']:7.0f} s {r['rate']:6.0f}/s"
                        f"  claim {r['claim_ms']:.3f} ms {r['claim_blocks']:6.1f} blocks"
                        f" {r['claim_rows']:5.1f} rows"
                        f"  jobs_live {(r['live_heap'] + r['live_indexes']) / 2**20:7.1f} MiB"
                        f" ({r['live_dead']} dead, {r['backlog']} waiting,"
                        f" {r['live_vacuums']} vacuums)"
                        f"  jobs_done {(r['done_heap'] + r['done_indexes']) / 2**20:7.1f} MiB"
                        f"  failed claims {s['failed_claims']}")
                    mark = (done.value // every + 1) * every
                if not alive:
                    break
                if not autovacuum and time.monotonic() >= next_vacuum:
                    fallback._next_check = 0.0
                    fallback.run_once(pg)
                    next_vacuum = time.monotonic() + VACUUM_EVERY
                time.sleep(0.2)
            for p in procs:
                p.join()
                if p.exitcode:
                    raise RuntimeError(f"a soak process failed ({p.exitcode})")
    return {"tasks": tasks, "autovacuum": autovacuum, "consumers": consumers,
            "backlog": backlog, "rate": rate, "samples": per_sample(samples)}


def plot(runs: list[dict[str, Any]], path: str) -> None:
    """The claim's time and buffers per call, and jobs_live's and jobs_done's sizes, against
    tasks done: one column per run (autovacuum on, off)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(runs), figsize=(6 * len(runs), 7), squeeze=False)
    mib = 2 ** 20
    for col, results in enumerate(runs):
        rows = [r for r in results["samples"] if r["claim_ms"]]  # not the closing sample
        x = [r["tasks"] for r in rows]
        top, bottom = axes[0][col], axes[1][col]
        top.plot(x, [r["claim_ms"] for r in rows], "o-", color="#c0392b", label="ms per claim")
        top.set_ylim(bottom=0)
        top.set_ylabel("job_claim, ms per call (up to 100 jobs, acks in)")
        blocks = top.twinx()
        blocks.plot(x, [r["claim_blocks"] for r in rows], "s--", color="#2980b9",
                    label="buffers per claim")
        blocks.set_ylim(bottom=0)
        blocks.set_ylabel("shared buffers per call")
        paced = f" at {results['rate']:,.0f}/s" if results.get("rate") else ""
        top.set_title(f"{results['tasks']:,} tasks{paced}, autovacuum "
                      f"{'on' if results['autovacuum'] else 'off'}")
        top.legend(loc="upper left")
        blocks.legend(loc="upper right")
        bottom.plot(x, [(r["live_heap"] + r["live_indexes"]) / mib for r in rows], "o-",
                    color="#c0392b", label="jobs_live: heap + indexes (the hot table)")
        bottom.plot(x, [(r["done_heap"] + r["done_indexes"]) / mib for r in rows], "s--",
                    color="#7f8c8d", label="jobs_done: heap + indexes (the retention's history)")
        bottom.set_ylim(bottom=0)
        bottom.set_ylabel("MiB")
        bottom.set_xlabel("tasks done")
        bottom.legend(loc="upper left")
        for ax in (top, bottom):
            ax.xaxis.set_major_formatter(
                matplotlib.ticker.FuncFormatter(lambda v, _: f"{v / 1e6:.2g}M"))
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2_000_000)
    parser.add_argument("--every", type=int, default=100_000)
    parser.add_argument("--autovacuum", choices=("on", "off"), default="on")
    parser.add_argument("--consumers", type=int, default=3)
    parser.add_argument("--backlog", type=int, default=20_000,
                        help="unpaced: the most jobs kept waiting")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="jobs/s offered by the wall clock (0: as fast as they drain)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--plot", default=None,
                        help="a PNG of this run and of the other one's JSON in --out, if any")
    args = parser.parse_args(argv)
    results = run(args.tasks, args.every, args.autovacuum == "on", args.consumers, args.backlog,
                  args.rate)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        Path(args.out, f"soak-{args.autovacuum}.json").write_text(json.dumps(results, indent=1))
    if args.plot:
        runs = [results]
        other = Path(args.out or ".", f"soak-{'off' if args.autovacuum == 'on' else 'on'}.json")
        if other.exists():
            runs.append(json.loads(other.read_text()))
        plot(sorted(runs, key=lambda r: not r["autovacuum"]), args.plot)


if __name__ == "__main__":
    main()
