"""The Celery app of the benchmark: one no-op task, the same for every broker.

The harness (``tests/bench/harness.py``) builds an app per broker with :func:`make_app` to
publish, and starts ``celery -A tests.bench.benchapp worker`` with the broker and options in the
environment (``PGBROKER_BENCH_*``, read once at import).

Counting completions the same way for every broker: each pool process keeps, in memory, how many
tasks it ran, when its first one started and when its last one ended, and rewrites those three
numbers in place (one 24-byte ``pwrite``, no fsync) in a file of its own after every task. The
harness sums the files until the count reaches N; the drain time is the earliest first start to
the latest last end. This asks nothing of the broker (no queue-length API, which RabbitMQ, Redis
and the SQL transports answer differently and at different costs, and no ``celery inspect``
round trip), costs each task a few microseconds whatever the broker, and cannot miss a completion.
A latency sample (``sent`` in the arguments) is appended as a line to a second file per process:
the latency and the task's start (epoch seconds), so that a reader tailing the file
(tests/bench/pressure.py) can tell in which second each task started.
"""

from __future__ import annotations

import json
import os
import struct
import time
from typing import Any

from celery import Celery, signals

#: count, first start, last end (epoch seconds) of one pool process.
RECORD = struct.Struct("<qdd")

TASK_NAME = "bench.noop"

_ENV_PREFIX = "PGBROKER_BENCH_"


def make_app(broker_url: str, queue: str, *, acks_late: bool = True, prefetch: int = 1,
             transport_options: dict[str, Any] | None = None) -> Celery:
    """A Celery app for ``broker_url`` whose default queue is ``queue``, with the no-op task."""
    if broker_url.startswith("pgbroker"):
        import pgbroker  # noqa: F401 - registers the pgbroker:// transport
    app = Celery("benchapp", broker=broker_url, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        task_acks_late=acks_late,
        worker_prefetch_multiplier=prefetch,
        task_ignore_result=True,
        broker_transport_options=transport_options or {},
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
    )
    app.task(name=TASK_NAME)(noop)
    return app


def noop(sent: float | None = None) -> None:
    """The benchmark task: does nothing but record that it ran (and its latency, if asked)."""
    start = time.time()
    _recorder().record(start, sent)


class _Recorder:
    """This pool process's completion record (see the module docstring)."""

    def __init__(self, directory: str):
        pid = os.getpid()
        self.fd = os.open(os.path.join(directory, f"{pid}.rec"), os.O_RDWR | os.O_CREAT, 0o644)
        self.latency_path = os.path.join(directory, f"{pid}.lat")
        self.count = 0
        self.first = 0.0

    def record(self, start: float, sent: float | None) -> None:
        if sent is not None:
            with open(self.latency_path, "a") as f:
                f.write(f"{start - sent:.6f} {start:.6f}\n")
        if not self.count:
            self.first = start
        self.count += 1
        os.pwrite(self.fd, RECORD.pack(self.count, self.first, time.time()), 0)


_recorders: dict[int, _Recorder] = {}


def _recorder() -> _Recorder:
    pid = os.getpid()
    recorder = _recorders.get(pid)
    if recorder is None:
        recorder = _recorders[pid] = _Recorder(os.environ[_ENV_PREFIX + "RECORD_DIR"])
    return recorder


def read_records(directory: str) -> tuple[int, float | None, float | None]:
    """(completed tasks, first start, last end) summed over the pool processes' files."""
    count, first, last = 0, None, None
    for name in os.listdir(directory):
        if not name.endswith(".rec"):
            continue
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read(RECORD.size)
        if len(data) < RECORD.size:
            continue  # created, not written yet
        n, start, end = RECORD.unpack(data)
        if n:
            count += n
            first = start if first is None else min(first, start)
            last = end if last is None else max(last, end)
    return count, first, last


def read_latencies(directory: str) -> list[float]:
    """Every latency sample (seconds) written so far."""
    found: list[float] = []
    for name in os.listdir(directory):
        if name.endswith(".lat"):
            with open(os.path.join(directory, name)) as f:
                found += [float(line.split()[0]) for line in f if line.strip()]
    return found


@signals.worker_ready.connect
def _ready(sender: Any = None, **kwargs: Any) -> None:
    """Tell the harness the worker consumes (its log level hides the ``ready.`` line)."""
    directory = os.environ.get(_ENV_PREFIX + "RECORD_DIR")
    if directory:
        with open(os.path.join(directory, "ready"), "w") as f:
            f.write(str(os.getpid()))


if os.environ.get(_ENV_PREFIX + "BROKER"):  # in a benchmark worker
    app = make_app(
        os.environ[_ENV_PREFIX + "BROKER"],
        os.environ[_ENV_PREFIX + "QUEUE"],
        acks_late=os.environ.get(_ENV_PREFIX + "ACKS_LATE", "1") == "1",
        prefetch=int(os.environ.get(_ENV_PREFIX + "PREFETCH", "1")),
        transport_options=json.loads(os.environ.get(_ENV_PREFIX + "TRANSPORT_OPTIONS", "{}")),
    )
