"""Issue 20's measurements: durable publish against its equal-durability peer, and capacity.

``durable``: pgbroker against RabbitMQ with publisher confirms (``confirm_publish``: ``.delay()``
returns once the broker has the message, as pgbroker's returns once the INSERT is committed and
flushed) and plain RabbitMQ, acks late, prefetch x1, in paired rounds (A B C, A B C); each
round's ratios are taken within the round, as in the ceiling section (the machine's speed
drifts between rounds more than the brokers differ).

``capacity``: what one task costs PostgreSQL, on a server of its own (``initdb``, with
``shared_preload_libraries = pg_stat_statements``; the shared server cannot be restarted):
``N`` ``.delay()`` from one thread, then a drain by ``celery worker -c 2`` (acks late,
prefetch x1), then the same drain with ``retention: 0``. Around each phase: the CPU seconds of
every process of that server (backends, WAL writer, checkpointer, autovacuum; from /proc),
``pg_stat_wal`` (WAL bytes and records), ``pg_stat_statements`` (statements and their time)
and ``pg_stat_database.xact_commit``, each divided by ``N``.

Run: ``python -m tests.bench --sections durable,capacity --rounds 6``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg

from tests.bench import harness
from tests.bench.benchapp import TASK_NAME, make_app
from tests.support.throwaway import ThrowawayServer, find_bindir

__all__ = ["capacity_report", "durable_report", "run_capacity", "run_durable"]

SECTIONS = ("durable", "capacity")

CONFIRM = harness.Broker("rabbitmq_confirm", "RabbitMQ, publisher confirms", harness.RABBITMQ_URL,
                         transport_options={"confirm_publish": True})
#: The transport options of each capacity run.
VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("default", {}), ("retention0", {"retention": 0}))

LABELS = {"pgbroker": "pgbroker", "rabbitmq_confirm": CONFIRM.label, "rabbitmq": "RabbitMQ"}


# -- durable publish and drain against RabbitMQ -------------------------------------------------

def run_durable(db_url: str, opts: harness.Options, log_dir: str) -> dict[str, Any]:
    known = harness.brokers(db_url)
    chosen = [known["pgbroker"]]
    skipped = {}
    for broker in (CONFIRM, known["rabbitmq"]):
        reason = broker.unavailable(db_url)
        if reason:
            skipped[broker.key] = reason
        else:
            chosen.append(broker)
    queue = f"durable_{os.getpid()}"
    config = harness.CONFIGS[0]  # acks late, prefetch x1
    runs: dict[str, list[dict[str, Any]]] = {b.key: [] for b in chosen}
    try:
        for round_ in range(opts.rounds):
            for broker in chosen:
                result = harness.measure(broker, config, db_url, queue, opts, log_dir)
                runs[broker.key].append(result)
                opts.log(f"durable round {round_ + 1} {broker.key}: {harness._brief(result)}")
    finally:
        for broker in chosen:
            broker.cleanup(queue)
    return {"runs": runs, "skipped": skipped}


def _round_ratios(runs: dict[str, list[dict[str, Any]]], a: str, b: str,
                  metric: str) -> list[float]:
    return [x[metric] / y[metric] for x, y in zip(runs.get(a, []), runs.get(b, []))
            if x.get(metric) and y.get(metric)]


def durable_report(durable: dict[str, Any]) -> str:
    runs = durable["runs"]
    columns = [k for k in ("pgbroker", "rabbitmq_confirm", "rabbitmq") if k in runs]
    lines = ["| metric [acks_late, prefetch x1] | " + " | ".join(LABELS[k] for k in columns)
             + " | pgbroker / confirms | pgbroker / RabbitMQ |", "|" + "---|" * (len(columns) + 3)]
    for key, label, higher in (("publish", "publish, tasks/s", True),
                               ("drain", "drain, tasks/s", True),
                               ("p50_ms", "latency p50, ms", False),
                               ("p99_ms", "latency p99, ms", False)):
        cells = []
        for k in columns:
            values = [r[key] for r in runs[k] if r.get(key) is not None]
            best = (max if higher else min)(values) if values else None
            cells.append("—" if best is None else
                         f"{best:,.1f} / {statistics.median(values):,.1f}")
        ratios = []
        for peer in ("rabbitmq_confirm", "rabbitmq"):
            found = _round_ratios(runs, "pgbroker", peer, key)
            ratios.append(f"{statistics.median(found):.2f} ({min(found):.2f}-{max(found):.2f})"
                          if found else "—")
        lines.append(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    rounds = len(runs["pgbroker"])
    return (f"Durable publish and drain ({rounds} paired round(s); cells best / median; ratios: "
            "median of each round's own ratio, with its range):\n\n" + "\n".join(lines))


# -- capacity on a server of its own -------------------------------------------------------------

@contextlib.contextmanager
def stats_server(settings: dict[str, str] | None = None, statements: bool = True
                 ) -> Iterator[ThrowawayServer]:
    """A started server of its own with pg_stat_statements loaded (unless ``statements`` is
    false), ``settings`` on top; removed on exit."""
    bindir = find_bindir()
    if bindir is None:
        raise RuntimeError("no PostgreSQL binaries (initdb, pg_ctl, postgres)")
    preload = {"shared_preload_libraries": "pg_stat_statements",
               "pg_stat_statements.track": "all"} if statements else {}
    server = ThrowawayServer(bindir, settings={
        **preload, "shared_buffers": "256MB", "max_wal_size": "2GB", **(settings or {})})
    try:
        server.init().start()
        yield server
    finally:
        server.destroy()


def _server_cpu(server: ThrowawayServer) -> float:
    """CPU seconds (user + system) of the postmaster and every one of its processes."""
    pid = int((server.datadir / "postmaster.pid").read_text().split()[0])
    total = 0.0
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


@dataclasses.dataclass
class Snapshot:
    cpu: float
    wal_bytes: float
    wal_records: float
    commits: float
    at: float

    @classmethod
    def take(cls, server: ThrowawayServer, pg: psycopg.Connection) -> Snapshot:
        # the LSN moves at once; pg_stat_wal and xact_commit wait for each session's report
        wal = pg.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn, wal_records"
                         " FROM pg_stat_wal").fetchone()
        commits = pg.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = "
                             "current_database()").fetchone()[0]
        return cls(_server_cpu(server), float(wal[0]), float(wal[1]), float(commits),
                   time.monotonic())


#: Seconds an idle session may keep its statistics before reporting them (PostgreSQL 15's
#: PGSTAT_IDLE_INTERVAL is 10 s): waited before a phase's first snapshot and after its end.
REPORT_DELAY = 11.0


def _reset(pg: psycopg.Connection) -> None:
    time.sleep(REPORT_DELAY)  # what came before is reported before the reset, not after it
    pg.execute("SELECT pg_stat_statements_reset()")
    pg.execute("SELECT pg_stat_reset_shared('wal')")
    pg.execute("SELECT pg_stat_reset()")


def _statements(pg: psycopg.Connection, n: int) -> list[dict[str, Any]]:
    rows = pg.execute(
        "SELECT regexp_replace(left(query, 90), '\\s+', ' ', 'g'), calls, total_exec_time,"
        " wal_bytes FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE"
        " datname = current_database()) AND query NOT LIKE '%%pg_stat%%'"
        " ORDER BY calls DESC").fetchall()
    return [{"query": q, "calls_per_task": c / n, "mean_ms": t / c if c else 0.0,
             "wal_bytes_per_task": float(w) / n} for q, c, t, w in rows if c]


def _phase(server: ThrowawayServer, db_url: str, n: int, run: Any) -> dict[str, Any]:
    with psycopg.connect(db_url, autocommit=True) as pg:
        _reset(pg)
        before = Snapshot.take(server, pg)
        run()
        cpu, lsn = _server_cpu(server), pg.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn"
                                                   ).fetchone()[0]
        ended = time.monotonic()
        time.sleep(REPORT_DELAY)  # let the sessions report their counters
        after = dataclasses.replace(Snapshot.take(server, pg), cpu=cpu, wal_bytes=float(lsn),
                                    at=ended)
        statements = _statements(pg, n)
    return {"tasks": n, "wall_s": after.at - before.at,
            "cpu_ms_per_task": (after.cpu - before.cpu) * 1000 / n,
            "wal_bytes_per_task": (after.wal_bytes - before.wal_bytes) / n,
            "wal_records_per_task": (after.wal_records - before.wal_records) / n,
            "commits_per_task": (after.commits - before.commits) / n,
            "statements_per_task": sum(s["calls_per_task"] for s in statements),
            "statements": statements[:8]}


def run_capacity(opts: harness.Options, log_dir: str) -> dict[str, Any]:
    n = opts.n
    results: dict[str, Any] = {}
    with stats_server() as server:
        for label, options in VARIANTS:
            db_url = server.create_database()
            with psycopg.connect(db_url, autocommit=True) as pg:
                pg.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            broker = dataclasses.replace(harness.brokers(db_url)["pgbroker"],
                                         transport_options=options)
            app = make_app(broker.url, "bench", transport_options=options)
            task = app.tasks[TASK_NAME]
            for _ in range(harness.WARMUP):
                task.delay()

            def publish() -> None:
                for _ in range(n):
                    task.delay()

            results[f"publish[{label}]"] = _phase(server, db_url, n, publish)
            app.close()
            with tempfile.TemporaryDirectory(prefix="pgbroker-bench-") as records:
                workers = []

                def drain() -> None:  # the worker's start is in the phase: N amortizes it
                    workers.append(harness.start_worker(broker, "bench", harness.CONFIGS[0],
                                                        records, log_dir))
                    harness.wait_count(workers[0], records, n + harness.WARMUP, 120 + n / 50)

                try:
                    results[f"drain[{label}]"] = _phase(server, db_url, n + harness.WARMUP,
                                                        drain)
                finally:
                    for worker in workers:
                        worker.stop()
            opts.log(f"capacity {label}: " + ", ".join(
                f"{k}: {v['cpu_ms_per_task']:.3f} ms CPU, {v['wal_bytes_per_task']:.0f} B WAL"
                for k, v in results.items() if label in k))
    return results


def capacity_report(capacity: dict[str, Any]) -> str:
    lines = ["| phase | tasks | PostgreSQL CPU ms/task | WAL bytes/task | WAL records/task | "
             "statements/task | commits/task | tasks/s |", "|---|---|---|---|---|---|---|---|"]
    for phase, m in capacity.items():
        lines.append(f"| {phase} | {m['tasks']} | {m['cpu_ms_per_task']:.3f} | "
                     f"{m['wal_bytes_per_task']:,.0f} | {m['wal_records_per_task']:.1f} | "
                     f"{m['statements_per_task']:.2f} | {m['commits_per_task']:.2f} | "
                     f"{m['tasks'] / m['wall_s']:,.0f} |")
    detail = []
    for phase, m in capacity.items():
        detail.append(f"\n{phase}, statements by calls:")
        detail += [f"  {s['calls_per_task']:.3f}/task, {s['mean_ms']:.3f} ms, "
                   f"{s['wal_bytes_per_task']:,.0f} B WAL/task: {s['query']}"
                   for s in m["statements"]]
    return "Capacity (a server of its own, pg_stat_statements):\n\n" + "\n".join(lines + detail)


def run(opts: harness.Options, out_dir: str) -> dict[str, Any]:
    """The sections of this module that ``opts.sections`` names, figures written beside the
    harness's (``capacity.json``)."""
    log_dir = os.path.join(out_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    results: dict[str, Any] = {}
    if "durable" in opts.sections:
        with harness.bench_database(opts.server_url, "durable") as db_url:
            results["durable"] = run_durable(db_url, opts, log_dir)
    if "capacity" in opts.sections:
        results["capacity"] = run_capacity(opts, log_dir)
    Path(out_dir, "capacity.json").write_text(json.dumps(results, indent=1, default=str))
    return results
