"""The side-by-side benchmark of issue 9: one harness, every broker, one run, one table.

What is measured (docs/benchmarks.md explains each choice and how to reproduce it):

* ``compare``: for pgbroker, Celery+RabbitMQ, Celery+Redis, kombu's SQLAlchemy transport and
  (where its extension is installed) kombu's PGMQ transport, in two worker configurations
  (``task_acks_late`` + ``worker_prefetch_multiplier=1``; acks on receipt + multiplier 4), each
  round measuring every broker in turn (A B C, A B C):
  publish rate (N ``.delay()`` from one thread, no worker running), drain rate (those N queued
  before ``celery worker -c 2`` starts; first task start to last task end, counted by the
  per-process records of :mod:`tests.bench.benchapp`), and publish->start latency on the then
  idle worker (sequential tasks, each sent once the previous one ran; p50/p99).
* ``pgbench``: the ceiling of the database itself: pgbroker's own ``job_insert`` and ``job_claim``
  statements (batches of 10, acks folded into the next claim, as the worker does) run by pgbench.
* ``transport``: kombu Producer/Consumer on pgbroker without Celery, against that ceiling.
* ``scale``: drain rate with many completed rows in the retention window and scheduled (future
  ``run_at``) rows, each size measured alternately with an empty database.
* ``bulk``: ``pgbroker.enqueue_many`` of 20,000 jobs in one transaction.
* ``memory`` (slow, opt-in) and ``profile`` (opt-in): a worker's RSS over 100k tasks; where a
  pgbroker worker's main process spends its time while draining (py-spy), and the CPU split
  between the worker and its PostgreSQL sessions.

Nothing here asserts a speed: the figures are printed, and the goals are judged in the table.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from tests.bench.benchapp import TASK_NAME, make_app, read_latencies, read_records
from tests.support.processes import REPO_ROOT, WorkerProcess, wait_for

DEFAULT_SERVER_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"
REDIS_URL = "redis://127.0.0.1:6379/0"
WARMUP = 100  # tasks published (and drained) before the timed publishes


@dataclasses.dataclass(frozen=True)
class Options:
    """What to run and how big."""

    n: int = 10_000                     # tasks per publish/drain measurement
    rounds: int = 2                     # interleaved repetitions (best and median reported)
    latency_samples: int = 500
    latency_budget: float = 30.0        # seconds per latency measurement (polling brokers)
    brokers: tuple[str, ...] = ("pgbroker", "pgbroker_fast", "rabbitmq", "redis", "sqla", "pgmq")
    sections: tuple[str, ...] = ("compare", "pgbench", "transport", "scale", "bulk")
    scale_sizes: tuple[int, ...] = (0, 100_000, 300_000, 1_000_000)   # completed rows
    bulk_jobs: int = 20_000
    memory_tasks: int = 100_000
    profile_tasks: int = 30_000
    pgbench_seconds: float = 5.0
    server_url: str = dataclasses.field(
        default_factory=lambda: os.environ.get("PGBROKER_BENCH_DATABASE_URL", DEFAULT_SERVER_URL))
    log: Callable[[str], None] = lambda text: print(text, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
    key: str
    label: str
    acks_late: bool
    prefetch: int


CONFIGS = (
    WorkerConfig("late1", "acks_late, prefetch x1", True, 1),
    WorkerConfig("early4", "acks on receipt, prefetch x4", False, 4),
)


# -- databases -----------------------------------------------------------------------------------

def with_dbname(url: str, name: str) -> str:
    parts = url.rsplit("/", 1)
    query = parts[1].partition("?")[2]
    return f"{parts[0]}/{name}" + (f"?{query}" if query else "")


@contextlib.contextmanager
def bench_database(server_url: str, suffix: str) -> Iterator[str]:
    """A fresh database with pgbroker's schema (migrated), dropped afterwards; yields its URL."""
    import pgbroker

    with empty_database(server_url, f"pgbroker_bench_{suffix}_{os.getpid()}") as url:
        pgbroker.migrate(url)
        yield url


@contextlib.contextmanager
def empty_database(server_url: str, name: str) -> Iterator[str]:
    """A fresh, empty database ``name`` (for a tree that migrates it itself: main's, say),
    dropped afterwards; yields its URL."""
    drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(drop)
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    try:
        yield with_dbname(server_url, name)
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(drop)


def execute(url: str, statement: Any, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else []


# -- brokers -------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Broker:
    key: str
    label: str
    url: str
    #: statements run on the bench database before each measurement (empty tables)
    reset_sql: tuple[str, ...] = ()
    transport_options: dict[str, Any] = dataclasses.field(default_factory=dict)

    def unavailable(self, db_url: str) -> str | None:
        """Why this broker cannot be measured here (None: it can)."""
        if self.key == "pgmq":
            found = execute(db_url, "SELECT 1 FROM pg_available_extensions WHERE name = 'pgmq'")
            if not found:
                return ("the pgmq extension is not installed in this PostgreSQL server "
                        "(no Debian package for PostgreSQL 15 here)")
        try:
            with self.connection() as conn:
                conn.ensure_connection(max_retries=1, timeout=5)
        except Exception as exc:  # noqa: BLE001 - any failure means: not measurable here
            return f"{type(exc).__name__}: {exc}"
        return None

    def connection(self) -> Any:
        from kombu import Connection

        if self.url.startswith("pgbroker"):
            import pgbroker  # noqa: F401 - registers the transport

        return Connection(self.url, transport_options=self.transport_options)

    def reset(self, db_url: str, queue: str) -> None:
        """Empty the queue (and, for the SQL brokers, their tables) before a measurement."""
        from kombu import Exchange, Queue

        with self.connection() as conn:
            channel = conn.default_channel
            Queue(queue, Exchange(queue), queue)(channel).declare()
            channel.queue_purge(queue)
        for statement in self.reset_sql:
            execute(db_url, statement)

    def cleanup(self, queue: str) -> None:
        """Remove the run's queue from the shared RabbitMQ/Redis servers."""
        if self.key not in ("rabbitmq", "redis"):
            return  # the bench database is dropped
        with contextlib.suppress(Exception), self.connection() as conn:
            conn.default_channel.queue_delete(queue)
            conn.default_channel.exchange_delete(queue)
        if self.key == "redis":  # kombu 5.7 leaves the exchange's binding keys behind
            import redis

            with contextlib.suppress(Exception):
                redis.Redis.from_url(self.url).delete(f"_kombu.binding.{queue}",
                                                      f"_kombu.binding_permanent.{queue}")


LABELS = {"pgbroker": "pgbroker", "pgbroker_fast": "pgbroker, durable_publish off",
          "rabbitmq": "RabbitMQ", "redis": "Redis", "sqla": "SQLAlchemy", "pgmq": "PGMQ"}


def brokers(db_url: str) -> dict[str, Broker]:
    host_db = db_url.partition("://")[2]
    return {b.key: b for b in (
        Broker("pgbroker", LABELS["pgbroker"], "pgbroker+" + db_url,
               ("TRUNCATE pgbroker.jobs, pgbroker.broadcasts",)),
        # the opt-in fast mode: publishes commit without waiting for the WAL flush
        Broker("pgbroker_fast", LABELS["pgbroker_fast"], "pgbroker+" + db_url,
               ("TRUNCATE pgbroker.jobs, pgbroker.broadcasts",), {"durable_publish": False}),
        Broker("rabbitmq", LABELS["rabbitmq"], RABBITMQ_URL),
        Broker("redis", LABELS["redis"], REDIS_URL),
        Broker("sqla", LABELS["sqla"], "sqla+postgresql+psycopg://" + host_db,
               ("DO $$ BEGIN IF to_regclass('public.kombu_message') IS NOT NULL THEN "
                "TRUNCATE public.kombu_message; END IF; END $$",)),
        Broker("pgmq", LABELS["pgmq"], "pgmq://" + host_db),
    )}


# -- a worker and its records --------------------------------------------------------------------

def start_worker(broker: Broker, queue: str, config: WorkerConfig, record_dir: str,
                 log_dir: str, concurrency: int = 2) -> WorkerProcess:
    """``celery worker -c 2`` (prefork; issue 9's setting, ``concurrency`` for others) on
    ``queue``."""
    name = f"bench-{broker.key}-{config.key}-{uuid.uuid4().hex[:6]}"
    argv = [sys.executable, "-m", "celery", "-A", "tests.bench.benchapp", "worker",
            "-P", "prefork", "-c", str(concurrency), "-Q", queue, "-n", f"{name}@%h",
            "--without-gossip", "--without-mingle", "--without-heartbeat", "--loglevel=WARNING"]
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT),
                                                       os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1",
           "PGBROKER_BENCH_BROKER": broker.url,
           "PGBROKER_BENCH_QUEUE": queue,
           "PGBROKER_BENCH_ACKS_LATE": "1" if config.acks_late else "0",
           "PGBROKER_BENCH_PREFETCH": str(config.prefetch),
           "PGBROKER_BENCH_TRANSPORT_OPTIONS": json.dumps(broker.transport_options),
           "PGBROKER_BENCH_RECORD_DIR": record_dir}
    return WorkerProcess(argv, env, Path(log_dir) / f"{name}.log", name)


def wait_ready(worker: WorkerProcess, record_dir: str, timeout: float = 60.0) -> None:
    def ready() -> bool:
        if not worker.is_alive():
            raise RuntimeError(f"{worker.name} exited:\n{worker.log()[-3000:]}")
        return os.path.exists(os.path.join(record_dir, "ready"))

    wait_for(ready, timeout, interval=0.05, message=f"{worker.name} to be ready")


def wait_count(worker: WorkerProcess, record_dir: str, expected: int,
               timeout: float, interval: float = 0.02) -> tuple[int, float, float]:
    """Wait until the pool processes recorded ``expected`` completions."""
    def done() -> tuple[int, float, float] | None:
        count, first, last = read_records(record_dir)
        if count >= expected:
            return count, first, last  # type: ignore[return-value]
        if not worker.is_alive():
            raise RuntimeError(f"{worker.name} exited with {count}/{expected} tasks done:\n"
                               f"{worker.log()[-3000:]}")
        return None

    return wait_for(done, timeout, interval=interval,
                    message=lambda: f"{expected} tasks done by {worker.name} "
                                    f"(have {read_records(record_dir)[0]})")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


# -- the side-by-side measurement ----------------------------------------------------------------

def measure(broker: Broker, config: WorkerConfig, db_url: str, queue: str, opts: Options,
            log_dir: str) -> dict[str, Any]:
    """Publish rate, drain rate and latency of one broker in one worker configuration."""
    broker.reset(db_url, queue)
    app = make_app(broker.url, queue, acks_late=config.acks_late, prefetch=config.prefetch,
                   transport_options=broker.transport_options)
    task = app.tasks[TASK_NAME]
    try:
        for _ in range(WARMUP):  # connections, declarations, prepared statements
            task.delay()
        started = time.perf_counter()
        for _ in range(opts.n):
            task.delay()
        publish = opts.n / (time.perf_counter() - started)
        expected = opts.n + WARMUP
        with tempfile.TemporaryDirectory(prefix="pgbroker-bench-") as records:
            worker = start_worker(broker, queue, config, records, log_dir)
            try:
                _, first, last = wait_count(worker, records, expected, 120 + opts.n / 50)
                drain = expected / (last - first)
                latencies = measure_latency(task, worker, records, expected, opts)
                time.sleep(0.5)  # a duplicate delivery would show up as an extra count
                count = read_records(records)[0]
            finally:
                worker.stop()
    finally:
        app.close()
    sent = expected + len(latencies)
    return {"publish": publish, "drain": drain,
            "p50_ms": percentile(latencies, 50) * 1000 if latencies else None,
            "p99_ms": percentile(latencies, 99) * 1000 if latencies else None,
            "latency_samples": len(latencies), "lost_or_duplicated": count - sent}


def measure_latency(task: Any, worker: WorkerProcess, records: str, done: int,
                    opts: Options) -> list[float]:
    """Sequential tasks on the idle worker: each sent once the previous one has run; the task
    records ``time.time()`` at its start minus the send time it was given."""
    deadline = time.monotonic() + opts.latency_budget
    sent = 0
    while sent < opts.latency_samples and time.monotonic() < deadline:
        time.sleep(0.002)  # the worker is idle (its acks written) before the next send
        task.delay(time.time())
        sent += 1
        wait_count(worker, records, done + sent, 60, interval=0.0005)
    return read_latencies(records)


def run_compare(db_url: str, opts: Options, log_dir: str) -> dict[str, Any]:
    """Every broker, both configurations, ``rounds`` times, interleaved (A B C, A B C)."""
    queue = f"bench_{os.getpid()}"
    known = brokers(db_url)
    chosen: list[Broker] = []
    skipped: dict[str, str] = {}
    for key in opts.brokers:
        reason = known[key].unavailable(db_url)
        if reason:
            skipped[key] = reason
            opts.log(f"compare: {known[key].label} skipped: {reason}")
        else:
            chosen.append(known[key])
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        b.key: {c.key: [] for c in CONFIGS} for b in chosen}
    try:
        for round_ in range(opts.rounds):
            for config in CONFIGS:
                for broker in chosen:
                    try:
                        result = measure(broker, config, db_url, queue, opts, log_dir)
                    except Exception as exc:  # noqa: BLE001 - one broker must not stop the rest
                        result = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                    runs[broker.key][config.key].append(result)
                    opts.log(f"compare round {round_ + 1} {config.key} {broker.label}: "
                             f"{_brief(result)}")
    finally:
        for broker in chosen:
            broker.cleanup(queue)
    return {"runs": runs, "skipped": skipped}


def _brief(result: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in result.items())


# -- a real message's row, reused by pgbench and the fills ---------------------------------------

def sample_message(db_url: str) -> dict[str, Any]:
    """The columns pgbroker writes for one ``bench.noop.delay()``."""
    queue = f"sample_{uuid.uuid4().hex[:8]}"
    app = make_app("pgbroker+" + db_url, queue)
    try:
        app.tasks[TASK_NAME].delay()
    finally:
        app.close()
    rows = execute(db_url, "DELETE FROM pgbroker.jobs WHERE queue = %s RETURNING task, "
                   "routing_key, body, content_type, content_encoding, headers, properties",
                   (queue,))
    keys = ("task", "routing_key", "body", "content_type", "content_encoding", "headers",
            "properties")
    return dict(zip(keys, rows[0]))


def fill_sql(schema: str) -> str:
    """INSERT of %(rows)s copies of a sample message in state %(state)s (generate_series).

    Completed rows are spread over the last hour (inside the retention window), scheduled rows
    fall due in 1 to 2 days. Ids are time-ordered like pgbroker's UUIDv7 (a millisecond prefix
    from an hour ago, ten rows a millisecond), so the primary key grows at its right edge as in
    production; task ids are unique per fill (%(batch)s) and in order."""
    return f"""
        INSERT INTO "{schema}".jobs (id, queue, task, task_id, routing_key, body, content_type,
                                     content_encoding, headers, properties, state, attempts,
                                     run_at, created_at, updated_at)
        SELECT (lpad(to_hex((extract(epoch FROM now() - interval '1 hour') * 1000)::bigint
                            + g / 10), 12, '0')
                || '7' || lpad(to_hex(g %% 4096), 3, '0') || '8'
                || substr(md5(%(batch)s || g::text), 1, 15))::uuid,
               %(queue)s, %(task)s, 'fill-' || %(batch)s || '-' || lpad(g::text, 10, '0'),
               %(routing_key)s, %(body)s, %(content_type)s, %(content_encoding)s, %(headers)s,
               %(properties)s, %(state)s, CASE WHEN %(state)s = 'completed' THEN 1 ELSE 0 END,
               CASE WHEN %(state)s = 'scheduled'
                    THEN now() + interval '1 day' + g * interval '1 second'
                    ELSE now() - interval '1 hour' END,
               now() - interval '1 hour',
               now() - interval '1 hour' + g * (interval '1 hour' / %(rows)s)
        FROM generate_series(1, %(rows)s) AS g"""


def fill(db_url: str, sample: dict[str, Any], queue: str, state: str, rows: int,
         schema: str = "pgbroker") -> None:
    """Add ``rows`` copies of ``sample`` (see :func:`fill_sql`) to ``queue``."""
    if rows > 0:
        params = {**sample, "headers": Jsonb(sample["headers"]),
                  "properties": Jsonb(sample["properties"]), "queue": queue, "state": state,
                  "rows": rows, "batch": uuid.uuid4().hex[:12]}
        execute(db_url, fill_sql(schema), params)


# -- the pgbench ceiling -------------------------------------------------------------------------

PGBENCH_SCHEMA = "pgbench_ceiling"


def _render(text: str, values: dict[str, str]) -> str:
    """A named query with its parameters replaced by SQL text (literals, pgbench variables)."""
    return re.sub(r"%\((\w+)\)s", lambda m: values[m.group(1)], text).replace("%%", "%")


def pgbench_scripts(db_url: str, sample: dict[str, Any], batch: int = 10) -> tuple[str, str]:
    """pgbroker's own job_insert and job_claim, as pgbench scripts.

    The insert is job_insert with the sample message as literals (new id and task id each time,
    NOTIFY included). The claim is job_claim with LIMIT ``batch``: its acks are the ids the previous
    claim of the same pgbench client returned (\\gset), exactly as the worker folds its acks into
    its next claim; the claimed rows are aggregated server-side instead of being sent back.
    """
    from pgbroker._pg.catalogue import queries

    q = queries(PGBENCH_SCHEMA)
    with psycopg.connect(db_url) as conn:
        def lit(value: Any) -> str:
            return sql.Literal(value).as_string(conn)

        insert = _render(q["job_insert"], {
            "id": "gen_random_uuid()", "queue": lit("pgbench_insert"), "task": lit(sample["task"]),
            "task_id": "gen_random_uuid()::text", "retries": "0", "exchange": lit(""),
            "routing_key": lit(sample["routing_key"]), "body": lit(sample["body"]),
            "content_type": lit(sample["content_type"]),
            "content_encoding": lit(sample["content_encoding"]),
            "headers": lit(Jsonb(sample["headers"])),
            "properties": lit(Jsonb(sample["properties"])), "priority": "0",
            "max_attempts": "5", "run_at": "NULL", "expires_at": "NULL",
            "idempotency_key": "NULL", "channel": lit(f"{PGBENCH_SCHEMA}.jobs")}) + ";\n"
        head, found, tail = q["job_claim"].rpartition("\nSELECT ")
        if not found or "\nFROM updated\n" not in tail:
            raise RuntimeError("job_claim no longer ends with a SELECT of its 'updated' rows: "
                               "adapt pgbench_scripts")
        claim = (head + "\nSELECT coalesce(array_agg(id)::text, '{}') AS ids,\n"
                 "       coalesce(array_agg(attempts)::text, '{}') AS atts\n"
                 "FROM updated WHERE state = 'running' \\gset\n")
        claim = _render(claim, {"queue": lit("pgbench_claim"), "limit": str(batch),
                                "consumer": lit(uuid.uuid4()), "ids": "(:ids)",
                                "attempts": "(:atts)", "after_priority": "-256",
                                "after_run_at": "'-infinity'",
                                "after_id": lit(uuid.UUID(int=0))})
    return insert, claim


def pgbench(db_url: str, script: str, clients: int, *, seconds: float | None = None,
            transactions: int | None = None, sync_commit: bool = True) -> tuple[float, int]:
    """(transactions per second, transactions retried) of one pgbench run with prepared
    statements. A deadlock is retried (up to 10 tries) and counted: job_claim can deadlock
    against a concurrent job_claim (see docs/benchmarks.md)."""
    with tempfile.NamedTemporaryFile("w", suffix=".sql", delete=False) as f:
        f.write(script)
    argv = ["pgbench", "-n", "-M", "prepared", "-c", str(clients), "-j", str(clients),
            "--max-tries", "10", "--failures-detailed",
            "-D", "ids={}", "-D", "atts={}", "-f", f.name]
    argv += ["-T", str(max(1, round(seconds)))] if seconds else ["-t", str(transactions)]
    env = {**os.environ,
           "PGOPTIONS": f"-c synchronous_commit={'on' if sync_commit else 'off'}"}
    try:
        out = subprocess.run(argv + [db_url], capture_output=True, text=True, env=env,
                             timeout=600)
    finally:
        os.unlink(f.name)
    found = re.search(r"tps = ([\d.]+) \(without initial connection time\)", out.stdout)
    failed = re.search(r"number of failed transactions: (\d+)", out.stdout)
    retried = re.search(r"number of transactions retried: (\d+)", out.stdout)
    if out.returncode or not found or (failed and int(failed.group(1))):
        raise RuntimeError(f"pgbench failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return float(found.group(1)), int(retried.group(1)) if retried else 0


def run_pgbench(db_url: str, opts: Options) -> dict[str, list[float]]:
    """job_insert rows/s and job_claim (+ack) messages/s, 1 and 4 clients, ``rounds`` times.

    Claims and acks run with synchronous_commit off and inserts with it on: pgbroker's defaults
    (durable_acks=False, durable_publish=True)."""
    if shutil.which("pgbench") is None:
        return {"skipped": ["pgbench is not installed"]}  # type: ignore[dict-item]
    import pgbroker

    pgbroker.migrate(db_url, PGBENCH_SCHEMA)
    sample = sample_message(db_url)
    insert, claim = pgbench_scripts(db_url, sample)
    claim100 = pgbench_scripts(db_url, sample, batch=100)[1]
    result: dict[str, list[float]] = {}
    for round_ in range(opts.rounds):
        for clients in (1, 4):
            execute(db_url, f'TRUNCATE "{PGBENCH_SCHEMA}".jobs')
            tps, _ = pgbench(db_url, insert, clients, seconds=opts.pgbench_seconds)
            result.setdefault(f"insert_c{clients}", []).append(tps)
        # (key, script, batch, clients, claims per client): a backlog that never runs dry
        for key, script, batch, clients, claims in (("claim_c1", claim, 10, 1, 3000),
                                                    ("claim_c4", claim, 10, 4, 1000),
                                                    ("claim100_c1", claim100, 100, 1, 400)):
            execute(db_url, f'TRUNCATE "{PGBENCH_SCHEMA}".jobs')
            fill(db_url, sample, "pgbench_claim", "pending", (claims * clients + 1) * batch,
                 PGBENCH_SCHEMA)
            execute(db_url, f'VACUUM ANALYZE "{PGBENCH_SCHEMA}".jobs')
            tps, retried = pgbench(db_url, script, clients, transactions=claims,
                                   sync_commit=False)
            result.setdefault(key, []).append(tps * batch)
            result.setdefault(f"{key}_deadlocks", []).append(retried)
        opts.log(f"pgbench round {round_ + 1}: " + ", ".join(
            f"{key} {values[-1]:.0f}" for key, values in result.items()))
    execute(db_url, f'DROP SCHEMA "{PGBENCH_SCHEMA}" CASCADE')
    return result


# -- the transport alone (kombu, no Celery) ------------------------------------------------------

def transport_alone(db_url: str, n: int, prefetch: int, event_loop: bool) -> tuple[float, float]:
    """(publish msg/s, consume msg/s) of plain kombu on pgbroker. ``event_loop``: consume on a
    kombu Hub as Celery does (acks deferred to the next claim), else ``drain_events``."""
    from kombu import Consumer, Exchange, Queue
    from kombu.asynchronous import Hub

    broker = brokers(db_url)["pgbroker"]
    name = f"transport_{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name), name)
    with broker.connection() as conn:
        producer = conn.Producer(serializer="json")
        producer.publish({"warm": True}, exchange=queue.exchange, routing_key=name,
                         declare=[queue])
        started = time.perf_counter()
        for i in range(n - 1):
            producer.publish({"i": i}, exchange=queue.exchange, routing_key=name)
        publish = (n - 1) / (time.perf_counter() - started)
    state = {"count": 0, "first": 0.0}

    def on_message(body: Any, message: Any) -> None:
        if not state["count"]:
            state["first"] = time.perf_counter()
        message.ack()
        state["count"] += 1

    with broker.connection() as conn:
        conn.ensure_connection()
        if event_loop:
            hub = Hub()
            conn.transport.register_with_event_loop(conn.connection, hub)
            consumer = Consumer(conn.channel(), [queue], callbacks=[on_message],
                                prefetch_count=prefetch)
            consumer.consume()
            loop = hub.create_loop()
            while state["count"] < n:
                next(loop)
            hub.close()
        else:
            with conn.Consumer([queue], callbacks=[on_message], prefetch_count=prefetch):
                while state["count"] < n:
                    conn.drain_events(timeout=30)
        consume = n / (time.perf_counter() - state["first"])
    execute(db_url, "DELETE FROM pgbroker.jobs WHERE queue = %s", (name,))
    return publish, consume


def run_transport(db_url: str, opts: Options) -> dict[str, list[float]]:
    result: dict[str, list[float]] = {}
    for round_ in range(opts.rounds):
        for loop in (False, True):
            for prefetch in (10, 100):
                publish, consume = transport_alone(db_url, opts.n, prefetch, loop)
                mode = "hub" if loop else "sync"
                result.setdefault("publish", []).append(publish)
                result.setdefault(f"consume_{mode}_{prefetch}", []).append(consume)
                opts.log(f"transport round {round_ + 1} {mode} prefetch {prefetch}: publish "
                         f"{publish:.0f}/s, consume {consume:.0f}/s")
    return result


# -- scale: drain rate against table size --------------------------------------------------------

def pgbroker_drain(db_url: str, n: int, log_dir: str, queue: str = "bench") -> float:
    """Drain rate of ``n`` tasks written with enqueue_many (config 1: acks late, prefetch x1)."""
    import pgbroker

    broker = brokers(db_url)["pgbroker"]
    app = make_app(broker.url, queue)
    try:
        with psycopg.connect(db_url) as conn:
            for start in range(0, n, 20_000):
                pgbroker.enqueue_many(conn, [(TASK_NAME,)] * min(20_000, n - start), app=app)
            conn.commit()
    finally:
        app.close()
    with tempfile.TemporaryDirectory(prefix="pgbroker-bench-") as records:
        worker = start_worker(broker, queue, CONFIGS[0], records, log_dir)
        try:
            _, first, last = wait_count(worker, records, n, 120 + n / 50)
        finally:
            worker.stop()
    # keep only the fill, vacuumed: the next measurement (in this database or the other one)
    # starts from the same table and is not slowed down by autovacuum cleaning up after this one
    execute(db_url, "DELETE FROM pgbroker.jobs WHERE task_id NOT LIKE 'fill-%' "
                    "OR task_id IS NULL")
    execute(db_url, "VACUUM ANALYZE pgbroker.jobs")
    return n / (last - first)


def run_scale(opts: Options, log_dir: str) -> dict[str, Any]:
    """At each size (completed rows, plus a tenth as many future scheduled rows), the drain rate
    of the filled database and of an empty one, alternately (and in alternating order),
    ``rounds`` times."""
    points = []
    with bench_database(opts.server_url, "empty") as empty, \
            bench_database(opts.server_url, "scale") as big:
        sample = sample_message(big)
        have = 0
        for size in opts.scale_sizes:
            started = time.monotonic()
            fill(big, sample, "bench", "completed", size - have)
            fill(big, sample, "bench", "scheduled", (size - have) // 10)
            have = size
            execute(big, "VACUUM ANALYZE pgbroker.jobs")  # the fill's own vacuum, not timed
            rows, mb = execute(big, "SELECT count(*), pg_total_relation_size('pgbroker.jobs') "
                                    "/ 1e6 FROM pgbroker.jobs")[0]
            opts.log(f"scale: {rows} rows, {mb:.0f} MB (filled in "
                     f"{time.monotonic() - started:.0f} s)")
            point: dict[str, Any] = {"completed": size, "scheduled": size // 10,
                                     "table_mb": float(mb), "empty": [], "filled": []}
            for round_ in range(opts.rounds):
                order = ("empty", "filled") if round_ % 2 == 0 else ("filled", "empty")
                for key in order:  # alternate who goes first: no order effect survives
                    point[key].append(pgbroker_drain(empty if key == "empty" else big,
                                                     opts.n, log_dir))
                opts.log(f"scale {size}: empty {point['empty'][-1]:.0f}/s, filled "
                         f"{point['filled'][-1]:.0f}/s")
            points.append(point)
    return {"points": points}


# -- the ceiling: the same drain with the database's durable work taken away ---------------------

#: What "bare" takes away from pgbroker's schema: the WAL (UNLOGGED: a crash empties the table),
#: the CHECK constraints, and every index a consumer does not read (claim, ack, promote, lease
#: sweep). Never a configuration to run: it only measures how much of the distance to RabbitMQ
#: is the database's durable bookkeeping and how much is the client-server round trip itself.
BARE_SQL = (*(f"ALTER TABLE pgbroker.{name} SET UNLOGGED" for name in ("jobs_live", "jobs_done")),
            *(f"ALTER TABLE pgbroker.jobs DROP CONSTRAINT {name}" for name in (
                "jobs_state_check", "jobs_attempts_check", "jobs_max_attempts_check",
                "jobs_priority_check", "jobs_running_locked_check")),
            # (the partitions' indexes, migration 0020)
            *(f"DROP INDEX pgbroker.{name}" for name in (
                "jobs_expires_idx", "jobs_idempotency_key_idx", "jobs_message_idx",
                "jobs_done_finished_idx", "jobs_done_idempotency_key_idx",
                "jobs_done_message_idx", "jobs_done_dead_idx")))


BARE_LABEL = "pgbroker, bare table"


def run_ceiling(db_url: str, opts: Options, log_dir: str) -> dict[str, Any]:
    """pgbroker, pgbroker on a bare ``jobs`` table (``BARE_SQL``), RabbitMQ and Redis, acks late,
    prefetch x1, interleaved; each round's ratios are taken within the round (the machine's
    speed drifts between rounds more than the brokers differ)."""
    queue = f"ceiling_{os.getpid()}"
    config = CONFIGS[0]
    known = brokers(db_url)
    with bench_database(opts.server_url, "bare") as bare_url:
        for statement in BARE_SQL:
            execute(bare_url, statement)
        bare = dataclasses.replace(known["pgbroker"], key="pgbroker_bare",
                                   label=BARE_LABEL, url="pgbroker+" + bare_url)
        chosen = [(known["pgbroker"], db_url), (bare, bare_url)]
        chosen += [(known[k], db_url) for k in ("rabbitmq", "redis")
                   if k in opts.brokers and known[k].unavailable(db_url) is None]
        runs: dict[str, list[dict[str, Any]]] = {b.key: [] for b, _ in chosen}
        try:
            for round_ in range(opts.rounds):
                for broker, url in chosen:
                    result = measure(broker, config, url, queue, opts, log_dir)
                    runs[broker.key].append(result)
                    opts.log(f"ceiling round {round_ + 1} {broker.key}: {_brief(result)}")
        finally:
            for broker, _ in chosen:
                broker.cleanup(queue)
    return {"runs": runs}


# -- bulk enqueue --------------------------------------------------------------------------------

def run_bulk(db_url: str, opts: Options) -> dict[str, list[float]]:
    """``enqueue_many`` of ``bulk_jobs`` jobs in one transaction (commit included), jobs/s."""
    import pgbroker

    app = make_app("pgbroker+" + db_url, "bulk")
    rates = []
    try:
        for _ in range(max(3, opts.rounds)):
            execute(db_url, "TRUNCATE pgbroker.jobs")
            items = [(TASK_NAME, (), {})] * opts.bulk_jobs
            with psycopg.connect(db_url) as conn:
                started = time.perf_counter()
                ids = pgbroker.enqueue_many(conn, items, app=app)
                conn.commit()
                rates.append(len(ids) / (time.perf_counter() - started))
            opts.log(f"bulk: {rates[-1]:.0f} jobs/s")
    finally:
        app.close()
    execute(db_url, "TRUNCATE pgbroker.jobs")
    return {"enqueue_many": rates}


# -- memory (slow) -------------------------------------------------------------------------------

def _rss_mb(worker: WorkerProcess) -> tuple[float, list[float]]:
    import psutil

    main = psutil.Process(worker.pid)
    return (main.memory_info().rss / 2**20,
            sorted(c.memory_info().rss / 2**20 for c in main.children(recursive=True)))


def run_memory(opts: Options, log_dir: str) -> dict[str, Any]:
    """RSS of a pgbroker worker (main process and pool children) after a 5,000-task warm-up and
    after ``memory_tasks`` more, written with enqueue_many while it runs."""
    import pgbroker

    result: dict[str, Any] = {}
    with bench_database(opts.server_url, "memory") as db_url, \
            tempfile.TemporaryDirectory(prefix="pgbroker-bench-") as records:
        broker = brokers(db_url)["pgbroker"]
        app = make_app(broker.url, "bench")
        worker = start_worker(broker, "bench", CONFIGS[0], records, log_dir)
        try:
            wait_ready(worker, records)
            done = 0
            for label, total in (("warm", 5_000), ("after", opts.memory_tasks)):
                for start in range(0, total, 10_000):
                    with psycopg.connect(db_url) as conn:
                        pgbroker.enqueue_many(conn, [(TASK_NAME,)] * min(10_000, total - start),
                                              app=app)
                    done += min(10_000, total - start)
                    wait_count(worker, records, done, 600)
                time.sleep(1)
                result[label] = _rss_mb(worker)
                opts.log(f"memory {label} ({done} tasks): main {result[label][0]:.1f} MB, "
                         f"children {result[label][1]}")
            result["tasks"] = done
        finally:
            worker.stop()
            app.close()
    return result


# -- profile -------------------------------------------------------------------------------------

def _backend_pids(db_url: str) -> list[int]:
    return [r[0] for r in execute(
        db_url, "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND application_name LIKE 'pgbroker%%' AND pid <> pg_backend_pid()")]


def _cpu(pids: Sequence[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


def run_profile(opts: Options, log_dir: str, out_dir: str) -> dict[str, Any]:
    """A pgbroker drain of ``profile_tasks`` sampled by py-spy on the worker's main process, and
    the CPU seconds of the main process, its pool children and its PostgreSQL sessions."""
    import pgbroker

    if shutil.which("py-spy") is None and not (Path(sys.executable).parent / "py-spy").exists():
        return {"skipped": "py-spy is not installed (pip install py-spy)"}
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    raw = str(Path(out_dir) / "pgbroker-drain.pyspy.txt")
    n = opts.profile_tasks
    with bench_database(opts.server_url, "profile") as db_url, \
            tempfile.TemporaryDirectory(prefix="pgbroker-bench-") as records:
        broker = brokers(db_url)["pgbroker"]
        app = make_app(broker.url, "bench")
        with psycopg.connect(db_url) as conn:
            for start in range(0, n, 20_000):
                pgbroker.enqueue_many(conn, [(TASK_NAME,)] * min(20_000, n - start), app=app)
        app.close()
        worker = start_worker(broker, "bench", CONFIGS[0], records, log_dir)
        spy_proc = None
        try:
            wait_for(lambda: read_records(records)[0] > 0, 60, message="the first task")
            import psutil

            children = [c.pid for c in psutil.Process(worker.pid).children(recursive=True)]
            backends = _backend_pids(db_url)
            commits = _commits(db_url)
            before = (_cpu([worker.pid]), _cpu(children), _cpu(backends), time.monotonic())
            spy_proc = subprocess.Popen(
                [spy, "record", "--pid", str(worker.pid), "--rate", "200", "--function",
                 "--idle", "--threads", "--nonblocking", "--format", "raw", "--output", raw],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _, first, last = wait_count(worker, records, n, 600)
            after = (_cpu([worker.pid]), _cpu(children), _cpu(backends), time.monotonic())
            time.sleep(1.5)  # PostgreSQL publishes a session's counters within a second
            commits = _commits(db_url) - commits
        finally:
            if spy_proc is not None:
                spy_proc.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
                spy_proc.wait(30)
            worker.stop()
        costs = statement_costs(db_url)
    cpu = {"worker_main": after[0] - before[0], "pool_children": after[1] - before[1],
           "postgres_sessions": after[2] - before[2], "wall": after[3] - before[3],
           "drain_rate": n / (last - first), "commits_per_task": commits / n}
    return {"cpu": cpu, "statements": costs, **summarize_stacks(raw), "raw": raw}


def _commits(db_url: str) -> int:
    return int(execute(db_url, "SELECT xact_commit FROM pg_stat_database "
                               "WHERE datname = current_database()")[0][0])


def statement_costs(db_url: str, seconds: float = 1.0, rounds: int = 3) -> dict[str, float]:
    """Milliseconds per statement (median of ``rounds`` interleaved runs of ``seconds`` each) of
    what a draining worker runs, through pgbroker's own Store, against a bare round trip. Only
    the named statement is timed; the untimed claims and acks around it keep the number of
    running rows as small as in a worker with two pool processes."""
    from pgbroker._pg.store import Store
    from pgbroker.settings import Settings

    execute(db_url, "TRUNCATE pgbroker.jobs")
    fill(db_url, sample_message(db_url), "costs", "pending", 100_000)
    execute(db_url, "VACUUM ANALYZE pgbroker.jobs")
    store = Store(db_url, Settings())
    consumer = uuid.uuid4()
    held: list[tuple[uuid.UUID, int]] = []  # claimed, not acked yet

    def timed(fn: Callable[[], Any]) -> float:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started

    def claim(batch: int, fold: bool) -> Callable[[], float]:
        def call() -> float:
            acks = list(held) if fold else []
            if not fold:
                store.ack(held)
            held.clear()
            return timed(lambda: held.extend(
                (r.id, r.attempt) for r in store.claim("costs", batch, consumer, acks)))
        return call

    def ack() -> float:
        store.ack(held)
        held[:] = [(r.id, r.attempt) for r in store.claim("costs", 2, consumer)]
        spent = timed(lambda: store.ack(held))
        held.clear()
        return spent

    calls: dict[str, Callable[[], float]] = {
        "SELECT 1 (round trip)": lambda: timed(lambda: store.conn.execute("SELECT 1").fetchall()),
        "job_claim of 2, 2 acks folded in": claim(2, True),
        "job_claim of 2, no acks": claim(2, False),
        "job_ack of 2": ack,
        "job_claim of 10, 10 acks folded in": claim(10, True),
    }
    timings: dict[str, list[float]] = {name: [] for name in calls}
    try:
        for _ in range(rounds):
            for name, call in calls.items():
                count, spent, started = 0, 0.0, time.perf_counter()
                while time.perf_counter() - started < seconds:
                    spent += call()
                    count += 1
                timings[name].append(spent / count * 1000)
    finally:
        store.close()
    return {name: statistics.median(values) for name, values in timings.items()}


def summarize_stacks(raw_path: str, thread: str = "MainThread", top: int = 20) -> dict[str, Any]:
    """Wall-clock shares of ``thread`` by function, from py-spy's raw output recorded with
    ``--idle --threads``: "self" is the innermost frame (where the thread was: running Python,
    waiting in a C call, or idle in the event loop's poll), "inclusive" counts every frame."""
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    packages: Counter[str] = Counter()
    total = 0
    with open(raw_path) as f:
        for line in f:
            stack, _, count_text = line.rstrip("\n").rpartition(" ")
            head, _, rest = stack.partition(";")
            if not count_text.isdigit() or not head.endswith(f": {thread}") or not rest:
                continue
            count = int(count_text)
            frames = [_short(frame) for frame in rest.split(";")]
            total += count
            own[frames[-1]] += count
            for frame in set(frames):
                inclusive[frame] += count
            packages[_package(frames[-1])] += count
    share = lambda c: round(100 * c / total, 1) if total else 0.0  # noqa: E731
    return {"samples": total,
            "self": [(name, share(c)) for name, c in own.most_common(top)],
            "inclusive": [(name, share(c)) for name, c in inclusive.most_common(top * 3)],
            "by_package": [(name, share(c)) for name, c in packages.most_common()]}


def _short(frame: str) -> str:
    """``func (/long/path/site-packages/kombu/x.py)`` -> ``func (kombu/x.py)``."""
    match = re.match(r"(.*) \((.*?)(?::\d+)?\)$", frame)
    if not match:
        return frame
    name, path = match.groups()
    for marker in ("site-packages/", "/lib/python3", str(REPO_ROOT) + "/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{name} ({path})"


def _package(frame: str) -> str:
    path = frame.rpartition("(")[2]
    head = path.split("/", 1)[0]
    return head if "/" in path else "stdlib/other"


# -- the whole run and its table -----------------------------------------------------------------

def run(opts: Options, out_dir: str | None = None) -> dict[str, Any]:
    """Run the chosen sections; returns every figure (also written to ``out_dir``)."""
    out_dir = out_dir or tempfile.mkdtemp(prefix="pgbroker-bench-out-")
    log_dir = os.path.join(out_dir, "logs")
    os.makedirs(log_dir, exist_ok=True)
    results: dict[str, Any] = {"options": {k: v for k, v in dataclasses.asdict(opts).items()
                                           if k != "log"},
                               "load_before": os.getloadavg(), "started": time.time()}
    results_path = os.path.join(out_dir, "results.json")
    with bench_database(opts.server_url, "main") as db_url:
        results["server"] = execute(  # autovacuum off makes pgbroker's claims slower as it runs
            db_url, "SELECT version(), current_setting('autovacuum'), "
                    "current_setting('synchronous_commit'), current_setting('fsync')")[0]
        for section in opts.sections:
            started = time.monotonic()
            try:
                results[section] = _run_section(section, db_url, opts, log_dir, out_dir)
            except Exception as exc:  # noqa: BLE001 - the other sections still run
                results.setdefault("failed", {})[section] = f"{type(exc).__name__}: {exc}"
                opts.log(f"{section} FAILED: {type(exc).__name__}: {exc}")
            opts.log(f"{section}: {time.monotonic() - started:.0f} s")
            with open(results_path, "w") as f:  # a later crash loses nothing measured
                json.dump(results, f, indent=1, default=str)
    results["load_after"] = os.getloadavg()
    results["elapsed"] = time.time() - results["started"]
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1, default=str)
    results["out_dir"] = out_dir
    return results


def _run_section(section: str, db_url: str, opts: Options, log_dir: str, out_dir: str) -> Any:
    if section == "compare":
        return run_compare(db_url, opts, log_dir)
    if section == "pgbench":
        return run_pgbench(db_url, opts)
    if section == "transport":
        return run_transport(db_url, opts)
    if section == "scale":
        return run_scale(opts, log_dir)
    if section == "bulk":
        return run_bulk(db_url, opts)
    if section == "memory":
        return run_memory(opts, log_dir)
    if section == "profile":
        return run_profile(opts, log_dir, out_dir)
    if section == "ceiling":
        return run_ceiling(db_url, opts, log_dir)
    raise ValueError(f"unknown section {section!r}")
