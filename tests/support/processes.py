"""Helpers for tests that run real ``celery worker`` / ``celery beat`` processes.

Every process is started in its own session (``start_new_session=True``) so that the whole process
group — the worker and its prefork children — can be signalled at once. Processes still alive when
a test ends are stopped by the autouse fixture in ``tests/conftest.py``; an ``atexit`` handler here
is the last resort for anything started outside a test.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TypeVar

from pgbroker._pg.local_server import normalize_url

__all__ = [
    "REPO_ROOT",
    "CeleryProcess",
    "Run",
    "WorkerProcess",
    "live_processes",
    "pgbroker_process",
    "run_beat",
    "run_worker",
    "wait_for",
]

REPO_ROOT = Path(__file__).resolve().parents[2]

T = TypeVar("T")

_live: list[CeleryProcess] = []
_names = itertools.count(1)

#: Set by tests/conftest.py to a callable returning the current test's tmp_path.
log_dir_provider: Callable[[], Path] | None = None


def wait_for(
    predicate: Callable[[], T],
    timeout: float,
    interval: float = 0.05,
    message: str | Callable[[], str] | None = None,
) -> T:
    """Call ``predicate`` until it returns a truthy value, and return that value.

    Raises:
        AssertionError: ``timeout`` seconds passed first; the message says what was awaited
            (``message``, or the predicate's name) and the last value seen.
    """
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            what = message() if callable(message) else message
            what = what or getattr(predicate, "__name__", repr(predicate))
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {value!r})")
        time.sleep(interval)


class CeleryProcess:
    """A ``python -m celery`` subprocess whose output goes to ``log_path``."""

    def __init__(self, argv: list[str], env: Mapping[str, str], log_path: Path, name: str):
        self.argv = argv
        self.name = name
        self.log_path = log_path
        self._log_file = open(log_path, "ab")  # noqa: SIM115 - closed in stop()/wait()
        self.popen = subprocess.Popen(
            argv,
            cwd=REPO_ROOT,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        _live.append(self)

    def __repr__(self) -> str:
        state = "running" if self.is_alive() else f"exited {self.popen.returncode}"
        return f"<{type(self).__name__} {self.name} pid={self.pid} {state}>"

    def __enter__(self) -> CeleryProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        """Pid of the main process (also the process group id)."""
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        """Everything the process wrote to stdout and stderr so far."""
        if not self._log_file.closed:
            self._log_file.flush()
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 30.0, count: int = 1) -> None:
        """Wait until ``text`` occurs ``count`` times in the log.

        Raises:
            AssertionError: on timeout, or when the process exits first (with the log's tail).
        """

        def seen() -> bool:
            if self.log().count(text) >= count:
                return True
            if not self.is_alive():
                raise AssertionError(
                    f"{self.name} exited with {self.popen.returncode} before logging {text!r}:\n"
                    f"{self._tail()}"
                )
            return False

        wait_for(seen, timeout, interval=0.1, message=lambda: f"{text!r} in {self.name}'s log:\n"
                 f"{self._tail()}")

    def child_pids(self) -> list[int]:
        """Pids of the live descendants of the main process (the prefork pool's children)."""
        import psutil

        try:
            return [p.pid for p in psutil.Process(self.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the main process only (its children are left to react)."""
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the whole process group (main process and pool children)."""
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float) -> int:
        """Wait for the main process to exit and return its exit code.

        Raises:
            subprocess.TimeoutExpired: it is still running after ``timeout`` seconds.
        """
        return self.popen.wait(timeout)

    def stop(self, timeout: float = 15.0) -> int | None:
        """Warm shutdown: SIGTERM, wait up to ``timeout`` s, then SIGKILL the process group.

        Whatever is left of the group (orphaned pool children) is killed too. Idempotent.
        Returns the main process's exit code.
        """
        if self.is_alive():
            self.kill(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # Children may outlive a parent that exited or ignored SIGTERM.
        self.kill_group(signal.SIGKILL)
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL not delivered?
            pass
        if not self._log_file.closed:
            self._log_file.close()
        if self in _live:
            _live.remove(self)
        return self.popen.returncode

    def _tail(self, lines: int = 60) -> str:
        return "\n".join(self.log().splitlines()[-lines:])


class WorkerProcess(CeleryProcess):
    """A ``celery worker`` subprocess."""

    def wait_ready(self, timeout: float = 30.0) -> WorkerProcess:
        """Wait for the worker's ``ready.`` line; return self.

        Raises:
            AssertionError: on timeout, or when the worker exits first (with the log's tail).
        """
        self.wait_for_log("ready.", timeout)
        return self


class BeatProcess(CeleryProcess):
    """A ``celery beat`` subprocess."""


def live_processes() -> list[CeleryProcess]:
    """The processes started by these helpers and not stopped yet."""
    return list(_live)


def run_worker(
    app_module: str,
    broker_url: str,
    *args: str,
    env: Mapping[str, str] | None = None,
    log_dir: Path | None = None,
) -> WorkerProcess:
    """Start ``python -m celery -A <app_module> worker`` and return it (not yet ready).

    Defaults ``-P prefork -c 2 --loglevel=INFO -n <unique>@%h`` are added unless ``args`` sets the
    same option. The process runs in the repository root and gets ``PGBROKER_TEST_BROKER_URL``
    (= ``broker_url``) and ``PGBROKER_DATABASE_URL`` (the same database as a postgresql:// URL) in
    its environment, then ``env`` on top.
    """
    name = f"w{os.getpid()}-{next(_names)}-{uuid.uuid4().hex[:6]}"
    defaults = [
        (("-P", "--pool"), ["-P", "prefork"]),
        (("-c", "--concurrency"), ["-c", "2"]),
        (("-l", "--loglevel"), ["--loglevel=INFO"]),
        (("-n", "--hostname"), ["-n", f"{name}@%h"]),
    ]
    argv = _celery_argv(app_module, "worker", args, defaults)
    return WorkerProcess(argv, _env(broker_url, env), _log_path(log_dir, name), name)


def run_beat(
    app_module: str,
    broker_url: str,
    *args: str,
    env: Mapping[str, str] | None = None,
    log_dir: Path | None = None,
) -> BeatProcess:
    """Start ``python -m celery -A <app_module> beat --loglevel=INFO`` (same environment as
    :func:`run_worker`); its schedule file, if any, goes to the log directory."""
    name = f"beat{os.getpid()}-{next(_names)}-{uuid.uuid4().hex[:6]}"
    log_path = _log_path(log_dir, name)
    defaults = [
        (("-l", "--loglevel"), ["--loglevel=INFO"]),
        (("-s", "--schedule"), ["-s", str(log_path.with_suffix(".schedule"))]),
    ]
    argv = _celery_argv(app_module, "beat", args, defaults)
    return BeatProcess(argv, _env(broker_url, env), log_path, name)


def _celery_argv(
    app_module: str,
    command: str,
    args: Iterable[str],
    defaults: list[tuple[tuple[str, ...], list[str]]],
) -> list[str]:
    args = list(args)
    argv = [sys.executable, "-m", "celery", "-A", app_module, command]
    for options, default in defaults:
        if not any(a in options or a.startswith(tuple(o + "=" for o in options)) for a in args):
            argv += default
    return argv + args


def _env(broker_url: str, extra: Mapping[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PGBROKER_TEST_BROKER_URL"] = broker_url
    try:
        env["PGBROKER_DATABASE_URL"] = normalize_url(broker_url)
    except ValueError:  # another broker (RabbitMQ): tasks record in PGBROKER_TEST_RUNS_URL
        pass
    env["PYTHONUNBUFFERED"] = "1"
    pythonpath = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + pythonpath if pythonpath else "")
    env.update(extra or {})
    return env


def _log_path(log_dir: Path | None, name: str) -> Path:
    if log_dir is None:
        log_dir = log_dir_provider() if log_dir_provider is not None else None
    if log_dir is None:
        log_dir = Path(tempfile.mkdtemp(prefix="pgbroker-celery-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    return log_dir / f"{name}.log"


@atexit.register
def _stop_all() -> None:
    for proc in list(_live):
        proc.stop(timeout=5)


#: ``cli("stats", "--json")`` -> (exit status, stdout, stderr): the ``cli`` fixtures' type.
Run = Callable[..., tuple[int, str, str]]


@contextlib.contextmanager
def pgbroker_process(*args: str, log: Path, env: dict[str, str] | None = None
                     ) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m pgbroker ARGS`` in its own session, output in ``log``. Leaving the block
    sends SIGTERM, which it must obey with exit status 0; it is killed if anything failed."""
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pgbroker", *args], stdout=out,
                                stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT,
                                start_new_session=True)
    try:
        yield proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
