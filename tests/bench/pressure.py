"""Issue 26's pressure benchmark: pgbroker at a fixed offered rate while VACUUM cannot keep up.

The scenarios of hardbyte's postgresql-job-queue-benchmarking, on pgbroker. Each is a sequence
of phases on a PostgreSQL server of its own (``initdb``; autovacuum on, its default settings,
``track_counts`` on, ``pg_stat_statements`` loaded when the server has it):

* ``xid``: clean -> hold (another connection runs ``BEGIN; SELECT txid_current();`` and keeps
  the transaction open) -> recovery (after its ROLLBACK);
* ``readers``: clean -> four REPEATABLE READ connections, each one transaction for the whole
  phase, scanning pgbroker's hot tables in a loop with a short pause -> recovery;
* ``overload``: clean -> 1.5x the offered rate -> recovery.

The load: a real ``celery worker`` (prefork ``-c 8``, ``task_acks_late``, prefetch x1) on
``tests.bench.benchapp``'s no-op task, fed by a producer thread that calls
``pgbroker.enqueue_many`` every 20 ms with the jobs due by then at the offered rate (the count is
taken from the wall clock since the start, so a late tick sends more and nothing drifts). Each
job carries its send time; the task appends ``start - sent`` (the pickup latency) and its start
to a file of its pool process, and this process tails those files, folding every line into
log-bucketed histograms (2 % wide: percentiles within 1 %) per phase and per 10-second window of
the phase; no sample is kept.

Printed: a line every 10 s (phase, elapsed, completed/s, p50, p99, depth, dead tuples) and a
table per scenario; ``pressure-<scenario>.json`` in ``--out`` holds every figure, and the
server's log (autovacuum logs each run) is copied there. docs/benchmarks.md, section
"Pressure", says what each figure means. Nothing is asserted about speed.

Run::

    python -m tests.bench.pressure xid --hold 600
    python -m tests.bench.pressure readers --out /tmp/pressure
    python -m tests.bench.pressure all --rate 250 --clean 120 --recovery 180
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg

from tests.bench import harness
from tests.bench.benchapp import TASK_NAME, make_app
from tests.bench.capacity import stats_server
from tests.support.throwaway import ThrowawayServer, find_bindir
from tests.support.processes import REPO_ROOT

__all__ = ["SCENARIOS", "LatencyHistogram", "Options", "report", "run", "run_scenario"]

QUEUE = "pressure"
WINDOW = 10.0          # seconds per window of the progress lines and of the recovery figure
TICK = 0.020           # the producer's batch interval
RECOVERED = 1.2        # a recovery window's p99 within this factor of the clean p99
GRACE = 1.5            # seconds after a window's end before it is read: its lines are written
#: The hot tables the readers scan (``{schema}`` is pgbroker's).
READER_SCANS = ("SELECT count(*), max(created_at) FROM pgbroker.jobs",
                "SELECT count(*), max(heartbeat_at) FROM pgbroker.consumers",
                "SELECT count(*), max(last_used_at) FROM pgbroker.queues")
#: pgbroker's claim statements (pgbroker/sql/queries.sql), matched in pg_stat_statements by
#: their text up to the first parameter.
CLAIM_STATEMENTS = ("job_claim", "job_claim_gated")


@dataclasses.dataclass(frozen=True)
class Scenario:
    key: str
    stress: str           # the middle phase's name
    seconds: float        # its default length
    what: str


SCENARIOS = {s.key: s for s in (
    Scenario("xid", "hold", 600, "a held XID (BEGIN; SELECT txid_current(); on another "
                                 "connection)"),
    Scenario("readers", "readers", 300, "REPEATABLE READ readers scanning the hot tables"),
    Scenario("overload", "overload", 300, "the offered rate times the overload factor"),
)}


@dataclasses.dataclass(frozen=True)
class Options:
    rate: float = 250.0              # offered jobs/s in the clean and recovery phases
    clean: float = 120.0
    stress: float | None = None      # None: the scenario's default
    recovery: float = 180.0
    warmup: float = 10.0             # at the clean rate before the clean phase, not counted
    concurrency: int = 8
    factor: float = 1.5              # overload: offered rate multiplier
    readers: int = 4
    reader_pause: float = 0.5        # seconds between one reader's scans
    out: str | None = None
    log: Callable[[str], None] = lambda text: print(text, flush=True)


@dataclasses.dataclass(frozen=True)
class Phase:
    name: str
    start: float          # epoch seconds
    seconds: float
    rate: float
    counted: bool = True  # False: the warm-up

    @property
    def end(self) -> float:
        return self.start + self.seconds


# -- latency histograms --------------------------------------------------------------------------

class LatencyHistogram:
    """Latencies (seconds) counted in buckets 2 % wide from 1 microsecond up: bucket ``k >= 1``
    holds ``[FLOOR * G**(k-1), FLOOR * G**k)``, bucket 0 everything below. A percentile is the
    geometric middle of the bucket its rank falls in: within 1 % of the true value."""

    GROWTH = 1.02
    FLOOR = 1e-6
    _LOG = math.log(GROWTH)

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}
        self.total = 0

    def add(self, seconds: float) -> None:
        k = 0 if seconds < self.FLOOR else int(math.log(seconds / self.FLOOR) / self._LOG) + 1
        self.counts[k] = self.counts.get(k, 0) + 1
        self.total += 1

    def percentile(self, q: float) -> float | None:
        """The nearest-rank ``q``-th percentile (0-100), seconds; None when empty."""
        if not self.total:
            return None
        rank = max(1, math.ceil(q / 100 * self.total))
        seen = 0
        for k in sorted(self.counts):
            seen += self.counts[k]
            if seen >= rank:
                return 0.0 if k == 0 else self.FLOOR * self.GROWTH ** (k - 0.5)
        raise AssertionError("unreachable")  # pragma: no cover

    def summary(self) -> dict[str, float | None]:
        """p50/p95/p99 in milliseconds."""
        return {f"p{q}_ms": _ms(self.percentile(q)) for q in (50, 95, 99)}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


class Tally:
    """Every task start read so far, folded into its phase's histogram and its window's."""

    def __init__(self, phases: Sequence[Phase]):
        self.phases = [p for p in phases if p.counted]
        self.whole = [LatencyHistogram() for _ in self.phases]
        self.windows = [[LatencyHistogram() for _ in range(math.ceil(p.seconds / WINDOW))]
                        for p in self.phases]

    def add(self, latency: float, start: float) -> None:
        for i, phase in enumerate(self.phases):
            if phase.start <= start < phase.end:
                self.whole[i].add(latency)
                self.windows[i][int((start - phase.start) // WINDOW)].add(latency)
                return


class Tail:
    """The lines the pool processes appended to their ``*.lat`` files since the last call."""

    def __init__(self, directory: str):
        self.directory = directory
        self.offsets: dict[str, int] = {}
        self.partial: dict[str, bytes] = {}

    def read(self) -> Iterator[tuple[float, float]]:
        """(latency, start) of each new line."""
        for entry in os.scandir(self.directory):
            if not entry.name.endswith(".lat"):
                continue
            with open(entry.path, "rb") as f:
                f.seek(self.offsets.get(entry.name, 0))
                while chunk := f.read(1 << 16):
                    self.offsets[entry.name] = f.tell()
                    *lines, rest = (self.partial.pop(entry.name, b"") + chunk).split(b"\n")
                    self.partial[entry.name] = rest
                    for line in lines:
                        latency, start = line.split()
                        yield float(latency), float(start)


# -- load ----------------------------------------------------------------------------------------

def offered(phases: Sequence[Phase], at: float) -> float:
    """Jobs due by ``at`` (epoch seconds) since the first phase began."""
    return sum(p.rate * min(max(at - p.start, 0.0), p.seconds) for p in phases)


class Producer(threading.Thread):
    """``enqueue_many`` every TICK seconds of the jobs due by then; each job's argument is its
    send time. Stops at the last phase's end, or at :meth:`stop`."""

    def __init__(self, db_url: str, phases: Sequence[Phase]):
        super().__init__(name="pressure-producer", daemon=True)
        self.db_url = db_url
        self.phases = list(phases)
        self.sent = 0
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        import pgbroker

        app = make_app("pgbroker+" + self.db_url, QUEUE)
        try:
            with psycopg.connect(self.db_url) as conn:
                first, end = self.phases[0].start, self.phases[-1].end
                tick = 0
                while not self._halt.is_set() and (now := time.time()) < end:
                    due = int(offered(self.phases, now)) - self.sent
                    if due > 0:
                        sent_at = time.time()
                        pgbroker.enqueue_many(conn, [(TASK_NAME, (sent_at,))] * due, app=app)
                        conn.commit()
                        self.sent += due
                    tick = max(tick + 1, math.ceil((time.time() - first) / TICK))
                    self._halt.wait(max(0.0, first + tick * TICK - time.time()))
        except BaseException as exc:  # noqa: BLE001 - reported by the main loop
            self.error = exc
        finally:
            app.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(30)


# -- stress --------------------------------------------------------------------------------------

class HeldXid:
    """``BEGIN; SELECT txid_current();`` on a connection of its own, held until :meth:`release`."""

    def __init__(self, db_url: str, log: Callable[[str], None]):
        self.conn = psycopg.connect(db_url, application_name="pressure-held-xid")
        xid, pid = self.conn.execute("SELECT txid_current(), pg_backend_pid()").fetchone()
        self.began = time.monotonic()
        log(f"   held: BEGIN; SELECT txid_current() -> xid {xid} (backend pid {pid})")

    def release(self) -> None:
        self.held = time.monotonic() - self.began
        with contextlib.suppress(psycopg.Error):
            self.conn.rollback()
        self.conn.close()

    def done(self) -> str:
        return f"ROLLBACK after {self.held:.0f} s"


class Readers:
    """``n`` threads, each one REPEATABLE READ transaction scanning the hot tables in a loop
    (one scan of each, then a pause) until :meth:`release`."""

    def __init__(self, db_url: str, n: int, pause: float, log: Callable[[str], None]):
        self.pause = pause
        self.scans = 0
        self.errors: list[str] = []
        self._halt = threading.Event()
        self.conns = [psycopg.connect(db_url, application_name=f"pressure-reader-{i}")
                      for i in range(n)]
        for conn in self.conns:
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        self.threads = [threading.Thread(target=self._scan, args=(conn,), daemon=True,
                                         name=f"pressure-reader-{i}")
                        for i, conn in enumerate(self.conns)]
        for thread in self.threads:
            thread.start()
        log(f"   {n} REPEATABLE READ readers started")

    def _scan(self, conn: psycopg.Connection) -> None:
        try:
            while not self._halt.is_set():
                for statement in READER_SCANS:
                    conn.execute(statement).fetchall()
                self.scans += 1
                self._halt.wait(self.pause)
        except psycopg.Error as exc:
            if not self._halt.is_set():
                self.errors.append(f"{type(exc).__name__}: {exc}")

    def release(self) -> None:
        self._halt.set()
        for conn, thread in zip(self.conns, self.threads):
            thread.join(5)
            if thread.is_alive():  # in the middle of a scan: cancel it
                with contextlib.suppress(Exception):
                    conn.cancel()
                thread.join(25)
            with contextlib.suppress(psycopg.Error):
                conn.rollback()
            conn.close()

    def done(self) -> str:
        return f"{self.scans} scan rounds" + (f"; errors: {self.errors[:2]}" if self.errors
                                              else "")


# -- what the server says ------------------------------------------------------------------------

def claim_prefixes() -> list[str]:
    """The text of pgbroker's claim statements up to their first parameter or constant (which
    pg_stat_statements shows as ``$n``); each prefix is that statement's alone."""
    from pgbroker._pg.catalogue import queries

    texts = queries("pgbroker")
    return [re.split(r"%\(|'|\b\d", texts[name])[0] for name in CLAIM_STATEMENTS
            if name in texts]


class Monitor:
    """One autocommit connection reading the figures (each its own short statement)."""

    def __init__(self, db_url: str, statements: bool):
        self.conn = psycopg.connect(db_url, autocommit=True, application_name="pressure-monitor")
        self.conn.execute("SET statement_timeout = '20s'")
        self.statements = statements
        self.prefixes = claim_prefixes()

    def close(self) -> None:
        self.conn.close()

    def _one(self, statement: str, params: Any = None) -> tuple[Any, ...] | None:
        try:
            return self.conn.execute(statement, params).fetchone()
        except psycopg.errors.QueryCanceled:
            return None

    def depth(self) -> dict[str, int | None]:
        row = self._one("SELECT count(*) FILTER (WHERE state = 'pending'), "
                        "count(*) FILTER (WHERE state = 'running') FROM pgbroker.jobs "
                        "WHERE queue = %s AND state IN ('pending', 'running')", (QUEUE,))
        if row is None:
            return {"pending": None, "running": None, "depth": None}
        return {"pending": row[0], "running": row[1], "depth": row[0] + row[1]}

    def table(self) -> dict[str, Any]:
        row = self._one("SELECT n_dead_tup, n_live_tup, last_autovacuum, autovacuum_count, "
                        "last_autoanalyze FROM pg_stat_user_tables "
                        "WHERE relid = 'pgbroker.jobs_live'::regclass")
        keys = ("dead_tuples", "live_tuples", "last_autovacuum", "autovacuum_count",
                "last_autoanalyze")
        return dict(zip(keys, row or (None,) * len(keys)))

    def claims(self) -> tuple[float, float, float, float] | None:
        """(calls, total ms, shared blocks hit, read) of the claim statements so far."""
        if not self.statements or not self.prefixes:
            return None
        tests = " OR ".join(["left(query, %s) = %s"] * len(self.prefixes))
        params = [v for p in self.prefixes for v in (len(p), p)]
        row = self._one(
            "SELECT coalesce(sum(calls), 0), coalesce(sum(total_exec_time), 0), "
            "coalesce(sum(shared_blks_hit), 0), coalesce(sum(shared_blks_read), 0) "
            "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database "
            f"WHERE datname = current_database()) AND ({tests})", params)
        return None if row is None else tuple(float(v) for v in row)  # type: ignore[return-value]

    def statements_now(self) -> dict[int, tuple[Any, ...]] | None:
        """Every statement's (text, calls, ms, rows, blocks) so far, by queryid."""
        if not self.statements:
            return None
        try:
            found = self.conn.execute(
                "SELECT queryid, left(regexp_replace(query, '\\s+', ' ', 'g'), 90), calls, "
                "total_exec_time, rows, shared_blks_hit + shared_blks_read "
                "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database "
                "WHERE datname = current_database())").fetchall()
        except psycopg.errors.QueryCanceled:
            return None
        return {row[0]: row[1:] for row in found}

    def server(self) -> dict[str, Any]:
        names = ("autovacuum", "track_counts", "autovacuum_naptime",
                 "autovacuum_vacuum_scale_factor", "autovacuum_vacuum_threshold",
                 "autovacuum_vacuum_cost_limit", "autovacuum_vacuum_cost_delay",
                 "shared_buffers", "max_wal_size", "synchronous_commit",
                 "shared_preload_libraries")
        found = {name: self.conn.execute(f"SELECT current_setting('{name}')").fetchone()[0]
                 for name in names}
        found["version"] = self.conn.execute("SELECT version()").fetchone()[0].split(" on ")[0]
        return found


def claim_delta(before: tuple[float, ...] | None, after: tuple[float, ...] | None
                ) -> dict[str, float] | None:
    if before is None or after is None:
        return None
    calls, total, hit, read = (a - b for a, b in zip(after, before))
    if calls <= 0:
        return {"calls": 0}
    return {"calls": calls, "mean_ms": total / calls, "blocks_per_call": (hit + read) / calls,
            "hit_per_call": hit / calls, "read_per_call": read / calls}


def statements_delta(before: dict[int, tuple[Any, ...]] | None,
                     after: dict[int, tuple[Any, ...]] | None, top: int = 8
                     ) -> list[dict[str, Any]] | None:
    """The statements that took the most of the database's time between two readings."""
    if before is None or after is None:
        return None
    rows = []
    for key, (text, calls, ms, nrows, blocks) in after.items():
        _, calls0, ms0, rows0, blocks0 = before.get(key, (text, 0, 0.0, 0, 0))
        if calls > calls0:
            calls_d = calls - calls0
            rows.append({"query": text, "calls": calls_d, "total_ms": ms - ms0,
                         "ms_per_call": (ms - ms0) / calls_d, "rows_per_call": (nrows - rows0)
                         / calls_d, "blocks_per_call": (blocks - blocks0) / calls_d})
    rows.sort(key=lambda r: -r["total_ms"])
    return rows[:top]


# -- one scenario --------------------------------------------------------------------------------

def plan(scenario: Scenario, opts: Options, start: float) -> list[Phase]:
    stress = opts.stress if opts.stress is not None else scenario.seconds
    rate = opts.rate * (opts.factor if scenario.key == "overload" else 1.0)
    phases, at = [], start
    for name, seconds, phase_rate, counted in (
            ("warmup", opts.warmup, opts.rate, False), ("clean", opts.clean, opts.rate, True),
            (scenario.stress, stress, rate, True), ("recovery", opts.recovery, opts.rate, True)):
        if seconds > 0 or counted:
            phases.append(Phase(name, at, seconds, phase_rate, counted))
            at += seconds
    return phases


def _pressure_server() -> contextlib.AbstractContextManager[ThrowawayServer]:
    bindir = find_bindir()
    statements = bindir is not None and (bindir.parent / "lib" / "pg_stat_statements.so").exists()
    return stats_server({"autovacuum": "on", "track_counts": "on",
                         "log_autovacuum_min_duration": "0"}, statements=statements)


def run_scenario(key: str, opts: Options, out_dir: str) -> dict[str, Any]:
    """One scenario on a server of its own; returns (and writes) its figures."""
    scenario = SCENARIOS[key]
    log_dir = os.path.join(out_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    result: dict[str, Any] = {
        "scenario": key, "what": scenario.what, "commit": _commit(), "started":
        datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "load_before": os.getloadavg()},
        "options": {k: v for k, v in dataclasses.asdict(opts).items() if k != "log"}}
    try:
        with _pressure_server() as server, \
                tempfile.TemporaryDirectory(prefix="pgbroker-pressure-") as records:
            _on_server(server, key, opts, out_dir, records, log_dir, result)
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"  # what was measured is still written
        raise
    finally:
        result["machine"]["load_after"] = os.getloadavg()
        summarize(result)
        Path(out_dir, f"pressure-{key}.json").write_text(json.dumps(result, indent=1,
                                                                     default=str))
    return result


def _on_server(server: ThrowawayServer, key: str, opts: Options, out_dir: str, records: str,
               log_dir: str, result: dict[str, Any]) -> None:
    try:
        db_url = server.create_database()
        statements = "pg_stat_statements" in server.settings.get("shared_preload_libraries", "")
        if statements:
            harness.execute(db_url, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        monitor = Monitor(db_url, statements)
        result["server"] = monitor.server()
        try:
            _drive(SCENARIOS[key], opts, db_url, records, log_dir, monitor, result)
        finally:
            monitor.close()
    finally:
        with contextlib.suppress(OSError):
            shutil.copy(server.log, os.path.join(out_dir, f"pressure-{key}-server.log"))


def _drive(scenario: Scenario, opts: Options, db_url: str, records: str, log_dir: str,
           monitor: Monitor, result: dict[str, Any]) -> None:
    """The phases, one after the other, on one clock: at each boundary the ending phase's
    stress is released, the next one's begun, then the figures read (the end of one phase and
    the start of the next); a window or a phase is summed up GRACE seconds after its end."""
    log = opts.log
    broker = harness.brokers(db_url)["pgbroker"]
    worker = harness.start_worker(broker, QUEUE, harness.CONFIGS[0], records, log_dir,
                                  concurrency=opts.concurrency)
    producer: Producer | None = None
    stress: HeldXid | Readers | None = None
    try:
        harness.wait_ready(worker, records)
        phases = plan(scenario, opts, time.time() + 0.5)
        tally, tail = Tally(phases), Tail(records)
        due_windows = [(p, k, min(p.start + (k + 1) * WINDOW, p.end) + GRACE)
                       for i, p in enumerate(tally.phases) for k in range(len(tally.windows[i]))]
        producer = Producer(db_url, phases)
        producer.start()
        log(f"== {scenario.key}: {scenario.what}; offered {opts.rate:g} jobs/s; phases "
            + ", ".join(f"{p.name} {p.seconds:g} s" for p in phases))
        rows: list[dict[str, Any]] = result.setdefault("phases", [])
        windows: list[dict[str, Any]] = result.setdefault("windows", [])
        result["window_s"] = WINDOW
        ended: list[tuple[Phase, dict[str, Any]]] = []  # read at the end, summed up later
        before: dict[str, Any] = {}
        current = 0  # the next boundary: the start of phases[current]
        while True:
            now = time.time()
            _check(worker, producer)
            if current <= len(phases) and now >= (phases[current].start if current < len(phases)
                                                  else phases[-1].end):
                late = now - phases[current - 1].end if current else 0.0
                if late > 0.5:  # the figures read in the last turn took that long
                    log(f"   (this boundary is {late:.1f} s late)")
                if stress is not None:
                    stress.release()
                    log(f"   {phases[current - 1].name} released: {stress.done()}")
                    stress = None
                name = phases[current].name if current < len(phases) else None
                if name == "hold":
                    stress = HeldXid(db_url, log)
                elif name == "readers":
                    stress = Readers(db_url, opts.readers, opts.reader_pause, log)
                at = {"claims": monitor.claims(), "statements": monitor.statements_now(),
                      "sent": producer.sent, **monitor.depth(), **monitor.table()}
                if current > 0 and phases[current - 1].counted:
                    ended.append((phases[current - 1], {
                        **{k: v for k, v in at.items()
                           if k not in ("claims", "statements", "sent")},
                        "sent": at["sent"] - before["sent"],
                        "claim": claim_delta(before["claims"], at["claims"]),
                        "statements": statements_delta(before["statements"],
                                                       at["statements"])}))
                before = at
                current += 1
            for latency, start in tail.read():
                tally.add(latency, start)
            while due_windows and now >= due_windows[0][2]:
                phase, k, _ = due_windows.pop(0)
                windows.append(_window(phase, k, tally.windows[tally.phases.index(phase)],
                                       monitor, log))
            while ended and now >= ended[0][0].end + GRACE:
                phase, figures = ended.pop(0)
                rows.append(_phase_row(phase, tally.whole[tally.phases.index(phase)], figures))
                log(_phase_line(rows[-1]))
            if current > len(phases) and not due_windows and not ended:
                break
            time.sleep(0.25)
    finally:
        if producer is not None:
            producer.stop()
        if stress is not None:
            stress.release()
        worker.stop()


def _check(worker: Any, producer: Producer) -> None:
    if not worker.is_alive():
        raise RuntimeError(f"{worker.name} exited:\n{worker.log()[-3000:]}")
    if producer.error is not None:
        raise RuntimeError(f"the producer failed: {producer.error!r}") from producer.error


def _window(phase: Phase, k: int, hists: list[LatencyHistogram], monitor: Monitor,
            log: Callable[[str], None]) -> dict[str, Any]:
    seconds = min(WINDOW, phase.seconds - k * WINDOW)
    hist = hists[k]
    row = {"phase": phase.name, "offset_s": k * WINDOW, "seconds": seconds,
           "completed": hist.total, "completed_per_s": hist.total / seconds,
           **hist.summary(), **monitor.depth(), "dead_tuples": monitor.table()["dead_tuples"]}
    log(f"{phase.name:>9} +{k * WINDOW + seconds:4.0f} s: {row['completed_per_s']:6.0f}/s  "
        f"p50 {_fmt_ms(row['p50_ms'])}  p99 {_fmt_ms(row['p99_ms'])}  "
        f"depth {_fmt_int(row['depth'])}  dead {_fmt_int(row['dead_tuples'])}")
    return row


def _phase_row(phase: Phase, hist: LatencyHistogram, at_end: dict[str, Any]) -> dict[str, Any]:
    """A phase's figures: its tasks' (by start time) and those read at its end."""
    completion = hist.total / phase.seconds
    return {"phase": phase.name, "seconds": phase.seconds, "offered_per_s": phase.rate,
            "sent_per_s": at_end["sent"] / phase.seconds, "completed": hist.total,
            "completed_per_s": completion, "completion_ratio": completion / phase.rate,
            **hist.summary(), **at_end}


def _phase_line(row: dict[str, Any]) -> str:
    return (f"== {row['phase']} done: {row['completed_per_s']:.0f}/s of {row['offered_per_s']:g} "
            f"offered ({row['completion_ratio']:.2f}), p50 {_fmt_ms(row['p50_ms'])}, p99 "
            f"{_fmt_ms(row['p99_ms'])}, depth {_fmt_int(row['depth'])}, dead "
            f"{_fmt_int(row['dead_tuples'])}")


# -- the figures ---------------------------------------------------------------------------------

def summarize(result: dict[str, Any]) -> None:
    """The ratios of each phase to the clean one, and the recovery time (in ``result``)."""
    phases = result.get("phases") or []
    clean = next((p for p in phases if p["phase"] == "clean"), None)
    if clean is None:
        return
    for row in phases:
        row["vs_clean"] = {
            "completion": _ratio(row["completed_per_s"], clean["completed_per_s"]),
            "p50": _ratio(row["p50_ms"], clean["p50_ms"]),
            "p99": _ratio(row["p99_ms"], clean["p99_ms"])}
    windows = [w for w in result.get("windows", []) if w["phase"] == "recovery"]
    if clean["p99_ms"] is None or not windows:
        return
    threshold = RECOVERED * clean["p99_ms"]
    back = [w for w in windows if w["completed"] and w["p99_ms"] <= threshold]
    first = back[0] if back else None
    result["recovery"] = {
        "threshold_ms": threshold,
        "recovered_after_s": None if first is None else first["offset_s"] + first["seconds"],
        # windows above the threshold again after the first one below it
        "relapses": 0 if first is None else sum(
            1 for w in windows if w["offset_s"] > first["offset_s"] and w not in back)}


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _fmt_ms(ms: float | None) -> str:
    if ms is None:
        return "—"
    return f"{ms / 1000:.1f} s" if ms >= 10_000 else f"{ms:.1f} ms" if ms < 100 else f"{ms:,.0f} ms"


def _fmt_int(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def _fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}" if value >= 100 else f"{value:.2f}"


def report(result: dict[str, Any]) -> str:
    """The scenario's table (markdown) and its recovery line."""
    header = ("phase", "s", "offered/s", "sent/s", "completed/s", "of offered", "p50", "p95",
              "p99", "depth at end", "dead / live tuples", "autovacuums (last)",
              "claim ms/call", "claim blocks/call", "vs clean: completion / p50 / p99")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in result.get("phases", []):
        claim = row.get("claim") or {}
        last = row.get("last_autovacuum")
        vs = row.get("vs_clean") or {}
        lines.append("| " + " | ".join((
            row["phase"], f"{row['seconds']:g}", f"{row['offered_per_s']:g}",
            f"{row['sent_per_s']:.0f}", f"{row['completed_per_s']:.0f}",
            f"{row['completion_ratio']:.2f}", _fmt_ms(row["p50_ms"]), _fmt_ms(row["p95_ms"]),
            _fmt_ms(row["p99_ms"]), _fmt_int(row["depth"]),
            f"{_fmt_int(row['dead_tuples'])} / {_fmt_int(row['live_tuples'])}",
            f"{row.get('autovacuum_count', '—')} ({_clock(last)})",
            "—" if "mean_ms" not in claim else f"{claim['mean_ms']:.2f}",
            "—" if "blocks_per_call" not in claim else _fmt_int(claim["blocks_per_call"]),
            "—" if row["phase"] == "clean" else " / ".join(
                _fmt_ratio(vs.get(k)) for k in ("completion", "p50", "p99")))) + " |")
    recovery = result.get("recovery")
    if recovery is None:
        after = "recovery: —"
    elif recovery["recovered_after_s"] is None:
        after = (f"recovery: not recovered (no {WINDOW:g}-s window's p99 at or below "
                 f"{_fmt_ms(recovery['threshold_ms'])}, {RECOVERED:g}x the clean p99)")
    else:
        after = (f"recovery: recovered after {recovery['recovered_after_s']:g} s (the first "
                 f"{WINDOW:g}-s window after the release with p99 <= "
                 f"{_fmt_ms(recovery['threshold_ms'])}, {RECOVERED:g}x the clean p99; "
                 f"{recovery['relapses']} later window(s) above it again)")
    ends = []
    for row in result.get("phases", []):
        last = [w for w in result.get("windows", []) if w["phase"] == row["phase"]][-1:]
        ends += [f"- {row['phase']}, its last {w['seconds']:g} s: {w['completed_per_s']:.0f}/s, "
                 f"p50 {_fmt_ms(w['p50_ms'])}, p99 {_fmt_ms(w['p99_ms'])}, depth "
                 f"{_fmt_int(w['depth'])}" for w in last]
    for row in result.get("phases", []):
        if row.get("statements"):
            ends += [f"- where the database's time went in {row['phase']} (ms/call, rows/call, "
                     "blocks/call, calls):"]
            ends += [f"  - {s['total_ms'] / 1000:7.1f} s  {s['ms_per_call']:7.2f}  "
                     f"{s['rows_per_call']:6.1f}  {s['blocks_per_call']:7.0f}  "
                     f"{s['calls']:>8,}  {s['query'][:70]}" for s in row["statements"]]
    server = result.get("server") or {}
    head = (f"Pressure, {result['scenario']}: {result['what']}; commit {result['commit']}, "
            f"{result['started']}; {server.get('version', '?')}, autovacuum="
            f"{server.get('autovacuum', '?')}; load average "
            f"{'/'.join(f'{v:.2f}' for v in result['machine']['load_before'])} -> "
            f"{'/'.join(f'{v:.2f}' for v in result['machine'].get('load_after', ()))}")
    return "\n".join([head, ""] + lines + ["", after, ""] + ends)


def _clock(value: Any) -> str:
    """A timestamp's time of day (a datetime, or its str() as read back from the JSON)."""
    if isinstance(value, str):
        value = datetime.datetime.fromisoformat(value)
    return value.strftime("%H:%M:%S") if isinstance(value, datetime.datetime) else "never"


def _commit() -> str:
    done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT,
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() or "?"


def run(keys: Sequence[str], opts: Options) -> list[dict[str, Any]]:
    out_dir = opts.out or tempfile.mkdtemp(prefix="pgbroker-pressure-out-")
    os.makedirs(out_dir, exist_ok=True)
    results = []
    for key in keys:
        result = run_scenario(key, opts, out_dir)
        opts.log("\n" + report(result) + "\n")
        results.append(result)
    opts.log(f"figures in {out_dir}")
    return results


def main(argv: list[str] | None = None) -> int:
    defaults = Options()
    parser = argparse.ArgumentParser(prog="python -m tests.bench.pressure",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenario", choices=[*SCENARIOS, "all"])
    parser.add_argument("--rate", type=float, default=defaults.rate,
                        help="offered jobs/s (default %(default)s)")
    parser.add_argument("--clean", type=float, default=defaults.clean,
                        help="seconds of the clean phase (default %(default)s)")
    parser.add_argument("--stress", "--hold", type=float, default=None, dest="stress",
                        help="seconds of the stress phase (default: xid 600, readers 300, "
                             "overload 300)")
    parser.add_argument("--recovery", type=float, default=defaults.recovery,
                        help="seconds of the recovery phase (default %(default)s)")
    parser.add_argument("--warmup", type=float, default=defaults.warmup,
                        help="seconds at the offered rate before the clean phase, not counted "
                             "(default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--factor", type=float, default=defaults.factor,
                        help="overload: the stress phase's rate multiplier (default %(default)s)")
    parser.add_argument("--readers", type=int, default=defaults.readers)
    parser.add_argument("--reader-pause", type=float, default=defaults.reader_pause)
    parser.add_argument("--out", default=None, help="directory for the JSON figures and logs")
    args = parser.parse_args(argv)
    opts = Options(rate=args.rate, clean=args.clean, stress=args.stress, recovery=args.recovery,
                   warmup=args.warmup, concurrency=args.concurrency, factor=args.factor,
                   readers=args.readers, reader_pause=args.reader_pause, out=args.out)

    def terminate(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")  # the finally blocks stop and remove all

    signal.signal(signal.SIGTERM, terminate)
    keys = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    opts = dataclasses.replace(opts, out=opts.out or tempfile.mkdtemp(
        prefix="pgbroker-pressure-out-"))
    try:
        run(keys, opts)
    except KeyboardInterrupt:
        print(f"interrupted: what was measured is in {opts.out}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
