"""What the test tiers share: helpers written once, imported by any tier.

A tier (tests/unit, tests/integration, tests/e2e, tests/chaos, tests/bench, ...) imports only
this package, the shared apps of :mod:`tests.apps` and its own modules, never another tier's
(tests/unit/test_test_tiers.py holds every tier to it); this package imports no tier.

* :mod:`tests.support.processes` -- real ``celery worker`` / ``celery beat`` processes, and
  :func:`~tests.support.processes.wait_for`.
* :mod:`tests.support.workers` -- a worker of the e2e app with transport options, and the runs
  and job rows it leaves (the e2e and chaos tests, and the integration tests that start one).
* :mod:`tests.support.db` -- reading the database as a test does: its clock, the ``jobs`` rows,
  counts per state; and a free TCP port.
* :mod:`tests.support.producers` -- a Celery app pointed at this test's database, and its
  connections forgotten afterwards.
* :mod:`tests.support.transport` -- kombu driven directly (no worker), a :class:`Store`.
* :mod:`tests.support.enqueue`, :mod:`tests.support.tickets`, :mod:`tests.support.admin`,
  :mod:`tests.support.control` -- the enqueue callers, ticketflow's look-ups, the admin page's
  logins and history, remote control: each used by more than one tier.
* :mod:`tests.support.throwaway` -- a PostgreSQL server of a test's own, to stop or cut off.
* :mod:`tests.support.fixtures` -- the fixtures more than one tier uses (loaded by
  ``tests/conftest.py`` as a plugin, so no test module imports a fixture).

A tier's own fixtures live in its ``conftest.py``; its own helpers in its ``*_support.py``.
"""
