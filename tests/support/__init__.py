"""What the test tiers share: helpers written once, imported by any tier.

* :mod:`tests.support.processes` -- real ``celery worker`` / ``celery beat`` processes, and
  :func:`~tests.support.processes.wait_for`.
* :mod:`tests.support.db` -- reading the database as a test does: its clock, the ``jobs`` rows,
  counts per state; and a free TCP port.
* :mod:`tests.support.producers` -- a Celery app pointed at this test's database, and its
  connections forgotten afterwards.
* :mod:`tests.support.fixtures` -- the fixtures more than one tier uses (loaded by
  ``tests/conftest.py`` as a plugin, so no test module imports a fixture).

A tier's own fixtures live in its ``conftest.py``; its own helpers in its ``*_support.py``.
"""
