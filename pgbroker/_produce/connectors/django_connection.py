"""The Django connector: pgbroker writes in the transaction of a Django database connection.

Django has no commit hook pgbroker uses: as with a raw psycopg connection,
:func:`pgbroker.transaction` writes when its block is left. The connection under Django's is
:func:`pgbroker._pg.django_db.driver_connection`'s.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import psycopg

from ..._pg.django_db import driver_connection

__all__ = ["DjangoConnector"]


class DjangoConnector:
    """A Django database connection (``django.db.connection`` or ``connections[alias]``)."""

    has_events = False

    def __init__(self, db: Any):
        self.db = db

    def connection(self) -> psycopg.Connection[Any]:
        return driver_connection(self.db)

    @contextlib.contextmanager
    def hooks(self, flush: Callable[[], None], discard: Callable[[], None]) -> Iterator[None]:
        yield  # no commit hook: transaction() writes when its block is left
