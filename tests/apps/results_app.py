"""The Celery app of the result-backend tests: pgbroker as broker AND as result backend.

``celery -A tests.apps.results_app worker`` builds it from ``PGBROKER_TEST_BROKER_URL``; a test
builds its own producer with :func:`make_app` pointed at its database. Both register the same
task names (``tests.apps.results_app.<function>``). Runs are recorded in ``public.runs`` (the
helpers of ``tests/apps/e2e_app.py``), so a test counts callback runs with SQL.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from celery import Celery, group

import pgbroker  # noqa: F401 - registers pgbroker://
from tests.apps.e2e_app import WORKER_CONF, record


class Boom(Exception):
    """What ``fail`` raises."""


NAME = "tests.apps.results_app."


# Plain functions, registered on each app by make_app (the same callable under the same name,
# so Celery does not warn about duplicate task names across apps).
def add(self, x: int, y: int) -> int:
    return x + y


def fail(self, message: str) -> None:
    raise Boom(message)


def collect(self, results: list[int]) -> list[int]:
    """A chord body: records its run, returns what it was given."""
    record(self, "collect")
    return results


def touch(self, key: str) -> str:
    record(self, key)
    return key


def nest(self, n: int, acc: list[int] | None = None) -> list[int]:
    """Replaces itself (same task id, same retries) until ``n`` is 0: ``nest(3)`` is
    ``[0, 1, 2, 3]``."""
    acc = [n, *(acc or [])]
    if n == 0:
        return acc
    return self.replace(self.app.tasks[NAME + "nest"].s(n - 1, acc))


def fan(self, results: list[int]) -> None:
    """A chord body that replaces itself with a group: the chord's result is the group's."""
    raise self.replace(group(self.app.tasks[NAME + "add"].s(r, 1) for r in results))


def request_view(self) -> dict[str, Any]:
    """What the task sees of its own message: its custom headers, eta and expires."""
    return {"headers": self.request.headers, "eta": self.request.eta,
            "expires": self.request.expires}


def make_app(url: str, **conf: Any) -> Celery:
    """An app with ``broker_url = result_backend = url``, the test tasks registered, and
    ``conf`` on top of the defaults below."""
    app = Celery("results_app", broker=url, backend=url, set_as_current=False)
    app.conf.update(WORKER_CONF, result_extended=True)
    app.conf.update(conf)

    for func in (add, fail, collect, touch, nest, fan, request_view):
        app.task(bind=True, name=NAME + func.__name__)(func)
    return app


@contextlib.contextmanager
def producer(url: str, *, poll_interval: float = 3600, **conf: Any) -> Iterator[Celery]:
    """A test's producer app (closed afterwards). Its waiters re-read pending results only every
    ``poll_interval`` seconds (an hour by default): only a NOTIFY can wake them sooner, so a
    test that gets its result in time proves the NOTIFY path."""
    options = {"poll_interval": poll_interval, **conf.pop("result_backend_transport_options", {})}
    app = make_app(url, result_backend_transport_options=options, **conf)
    try:
        yield app
    finally:
        app.backend.close()
        app.close()


app = make_app(os.environ.get("PGBROKER_TEST_BROKER_URL", "pgbroker://postgres@127.0.0.1/postgres"))
