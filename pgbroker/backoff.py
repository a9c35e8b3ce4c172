"""A fixed table of retry delays, with jitter, for ordinary ``autoretry_for`` tasks.

Celery's own ``retry_backoff`` only doubles (1 s, 2 s, 4 s, ... up to ``retry_backoff_max``).
Some contracts fix the waits instead -- seed 000's job contract: 10 s, 40 s, 3 min, 12 min,
50 min after the 1st..5th failure, the last one repeated beyond the table. :class:`TableBackoff`
is a Celery task base class that gives every retry without its own ``countdown``/``eta`` (so
every autoretry) the table's delay for ``request.retries``::

    from pgbroker.backoff import TableBackoff

    @app.task(base=TableBackoff, autoretry_for=(GatewayTimeout,), max_retries=6,
              acks_late=True)
    def capture_payment(payment_id): ...

    # another table: a subclass, or the task option
    @app.task(base=TableBackoff, retry_table=(5, 30, 120), retry_table_jitter=0.1, ...)

Leave ``retry_backoff`` off (its countdown would win). Jitter: each delay is drawn uniformly
within ``retry_table_jitter`` (default 20 %) either side of the table's value, so jobs that
failed together do not all come back in the same second; 0 keeps the table exact. The retry is a
new job row (Celery publishes the next try with ``retries + 1``); it waits in the database as
``scheduled`` until due, not in a worker's memory.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from celery import Task

__all__ = ["SEED_TABLE", "table_delay", "TableBackoff"]

#: Seed 000's delays in seconds after the 1st, 2nd, ... failure: 10 s, 40 s, 3 min, 12 min,
#: 50 min (the last one repeated beyond it).
SEED_TABLE: tuple[float, ...] = (10.0, 40.0, 180.0, 720.0, 3000.0)


def table_delay(retries: int, table: Sequence[float] = SEED_TABLE, jitter: float = 0.2,
                rng: random.Random | None = None) -> float:
    """Seconds to wait before retry number ``retries + 1`` (``retries``: Celery's
    ``request.retries``, 0 after the first failure): ``table[retries]``, the last entry beyond
    the table, moved by up to ``jitter`` (a fraction) either way.

    Raises:
        ValueError: an empty table, a negative delay or retries, a jitter outside [0, 1).
    """
    if not table:
        raise ValueError("the backoff table is empty")
    if any(not isinstance(d, (int, float)) or isinstance(d, bool) or d < 0 for d in table):
        raise ValueError(f"backoff delays must be seconds >= 0, not {list(table)!r}")
    if not isinstance(retries, int) or retries < 0:
        raise ValueError(f"retries must be an integer >= 0, not {retries!r}")
    if not 0 <= jitter < 1:
        raise ValueError(f"jitter must be a fraction in [0, 1), not {jitter!r}")
    delay = float(table[min(retries, len(table) - 1)])
    if not jitter:
        return delay
    return (rng or random).uniform(delay * (1 - jitter), delay * (1 + jitter))


class TableBackoff(Task):
    """A task whose retries wait :data:`retry_table`'s delays (see the module docstring)."""

    abstract = True
    #: delays in seconds after the 1st, 2nd, ... failure; the last one repeats
    retry_table: Sequence[float] = SEED_TABLE
    #: fraction of each delay drawn at random either way
    retry_table_jitter: float = 0.2

    def retry(self, args: Any = None, kwargs: Any = None, exc: Any = None, throw: bool = True,
              eta: Any = None, countdown: Any = None, max_retries: Any = None,
              **options: Any) -> Any:
        if eta is None and countdown is None:
            countdown = table_delay(self.request.retries or 0, self.retry_table,
                                    self.retry_table_jitter)
        return super().retry(args=args, kwargs=kwargs, exc=exc, throw=throw, eta=eta,
                             countdown=countdown, max_retries=max_retries, **options)
