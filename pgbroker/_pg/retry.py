"""Statements sent again when they failed on a living connection: result writes, loss records.

A statement can fail while its connection lives on: a full disk (53100), a lock or statement
timeout (55P03, 57014), a deadlock or serialization failure (40001, 40P01), an I/O error (58030).
Sent again a moment later it may pass -- the disk has room again, the lock is gone -- so the
writes whose loss would tell a wrong story (a success without its result, a loss not counted)
are tried a few times, a short pause apart, before their caller gives up. Not a lost connection
(class 08, 57P01-57P03, a socket error: its owner connects again, as before), nor a value the
table refuses (it would fail the same way every time).

Limits: the pauses block the calling thread (0.1 + 0.2 + 0.4 s at most, by default); a fault
that lasts longer is surfaced by the caller as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import sleep
from typing import TypeVar

import psycopg

__all__ = ["TRIES", "BACKOFF", "retried", "statement_failure"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Tries in all, and the first pause between two (doubled each time).
TRIES = 4
BACKOFF = 0.1

#: SQLSTATE classes of a statement that may pass when sent again: a serialization failure or
#: deadlock (40), insufficient resources such as a full disk (53), a lock not available (55),
#: a statement cancelled by a timeout (57, but 57P0x: the server is going away), a system I/O
#: error (58).
_TRANSIENT_CLASSES = frozenset({"40", "53", "55", "57", "58"})


def statement_failure(exc: BaseException) -> str | None:
    """``"<SQLSTATE> <message>"`` when ``exc`` (or the driver error it was translated from) is
    a statement that failed on a living connection and may pass when sent again, else None."""
    error = exc if isinstance(exc, psycopg.Error) else exc.__cause__
    state = getattr(error, "sqlstate", None)
    if not isinstance(error, psycopg.Error) or not state or state.startswith("57P") \
            or state[:2] not in _TRANSIENT_CLASSES:
        return None
    text = (error.diag.message_primary or str(error)).strip().splitlines()
    return f"{state} {text[0] if text else type(error).__name__}"


def retried(run: Callable[[], T], what: str, tries: int = TRIES, backoff: float = BACKOFF) -> T:
    """``run()``, sent again while it fails with a :func:`statement_failure`, ``tries`` times
    in all, ``backoff`` seconds apart and doubling; the last failure (or any other) is raised.
    ``what`` names it in the WARNING logged before each new try."""
    left, delay = tries, backoff
    while True:
        try:
            return run()
        except Exception as exc:
            left -= 1
            failure = statement_failure(exc)
            if failure is None or not left:
                raise
            logger.warning("pgbroker: %s failed (%s); trying again in %.1fs", what, failure,
                           delay)
            sleep(delay)
            delay *= 2
