"""Benchmarks (issue 9): pgbroker side by side with Celery on RabbitMQ and Redis, kombu's
SQLAlchemy and PGMQ transports, and the pgbench ceiling of the same database.

Deselected by default (marker ``bench``). Run ``python -m tests.bench`` (see ``--help``) or
``pytest -m "bench and not slow" tests/bench``; docs/benchmarks.md has the results and how to
reproduce them. The query-plan test beside them is an ordinary test and runs with the suite.
"""
