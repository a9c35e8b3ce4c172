"""Tasks for tests/e2e/test_hostile_input.py: the e2e app (``tests.apps.e2e_app``) plus tasks that
fail with text PostgreSQL cannot store as it is, or that take a long time.

Run as ``celery -A tests.e2e.hostile_app worker``; every task records its runs in
``public.runs`` like those of tests.apps.e2e_app.
"""

from __future__ import annotations

import time

from tests.apps.e2e_app import app, record
# the e2e app's tasks, registered on the same app
from tests.apps.e2e_app import *  # noqa: F403


#: Exception texts PostgreSQL cannot store as they are: a NUL, and a lone surrogate (what
#: ``os.listdir`` returns for a file name that is not UTF-8).
TEXTS = {"nul": "bad \x00 name",
         "surrogate": "bad " + b"caf\xe9".decode("utf-8", "surrogateescape"),
         "plain": "plain"}


@app.task(bind=True)
def fail_with(self, key: str, kind: str) -> None:
    """Raises ``ValueError(TEXTS[kind])``."""
    record(self, key)
    raise ValueError(TEXTS[kind])


@app.task(bind=True)
def record_arg(self, arg: str) -> None:
    """Records its argument as JSON text (ASCII: a NUL or a surrogate fits in public.runs)."""
    import json

    record(self, json.dumps(arg))


@app.task(bind=True)
def long_nap(self, key: str, seconds: float) -> str:
    record(self, key)
    time.sleep(seconds)  # the task's body: a task that runs this long
    record(self, key + ":done")
    return key


from celery.worker.control import control_command  # noqa: E402 - the section's own import


@control_command(args=[("key", str)], signature="<key>")
def count_me(state, key: str) -> dict:
    """Records each time it runs: a broadcast replayed by a spoofed NOTIFY would run it again."""
    import os

    from tests.apps.e2e_app import _db

    _db().execute("INSERT INTO public.runs (task, key, pid) VALUES ('count_me', %s, %s)",
                  (key, os.getpid()))
    return {"ok": key}
