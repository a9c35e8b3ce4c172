"""Receivers of pgbroker's signals for ``tests.e2e.jobsem_app``: each writes what it received, and
the pid of the process that sent it, to ``public.signals``. In the app's ``include`` list, so only
processes that import it (a worker, ``pgbroker -A tests.e2e.jobsem_app sweep``) have them."""

from __future__ import annotations

import os

from pgbroker import signals
from tests.apps.e2e_app import _db


@signals.job_dead.connect
def _on_dead(sender, job_id, task, reason, attempts, **_):
    _db().execute("INSERT INTO public.signals (kind, task, job_id, reason, attempts, pid) "
                  "VALUES ('job_dead', %s, %s, %s, %s, %s)",
                  (task, job_id, reason, attempts, os.getpid()))


@signals.task_paused.connect
def _on_paused(sender, task, reason, job_ids, actor, **_):
    _db().execute("INSERT INTO public.signals (kind, task, reason, job_ids, actor, pid) "
                  "VALUES ('task_paused', %s, %s, %s, %s, %s)",
                  (task, reason, list(job_ids), actor, os.getpid()))
