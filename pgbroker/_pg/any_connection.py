"""One coroutine for a psycopg ``Connection`` and an ``AsyncConnection`` alike.

pgbroker's writes into a caller's transaction (:mod:`pgbroker._produce.write`,
:mod:`pgbroker._produce.transaction`) are written once, as coroutines: each driver call goes through
:func:`awaited`, which awaits what an ``AsyncConnection`` returns and passes a ``Connection``'s
result through. Awaited by :mod:`pgbroker.aio`, they run on the caller's event loop; the synchronous
API runs the same coroutine with :func:`run_sync`, which needs no event loop because a coroutine
that awaits nothing but synchronous results never suspends. (psycopg itself writes its code once,
async, and generates the sync copy; a generated copy here would be two texts to keep equal.)
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

import psycopg

__all__ = ["awaited", "pipeline", "run_sync", "sync_context"]

T = TypeVar("T")


async def awaited(result: Any) -> Any:
    """``result`` of a driver call, awaited if it is awaitable (an ``AsyncConnection``'s)."""
    return await result if inspect.isawaitable(result) else result


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` to its end, here and now, and return its result.

    Only for a coroutine whose awaits are all of synchronous results (:func:`awaited` on a
    ``Connection``): it cannot suspend. If it does (it was handed an asyncio connection), it is
    closed and RuntimeError raised.
    """
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    coroutine.close()
    raise RuntimeError("pgbroker: a synchronous call waited on an asyncio connection (use the "
                       "pgbroker.aenqueue / aenqueue_many / atransaction forms for those)")


@contextlib.asynccontextmanager
async def pipeline(conn: Any) -> AsyncIterator[None]:
    """``conn.pipeline()`` of either kind of connection."""
    if isinstance(conn, psycopg.AsyncConnection):
        async with conn.pipeline():
            yield
    else:
        with conn.pipeline():
            yield


@contextlib.contextmanager
def sync_context(manager: contextlib.AbstractAsyncContextManager[Any]) -> Iterator[None]:
    """An async context manager that never suspends (see :func:`run_sync`) as a plain one."""
    run_sync(manager.__aenter__())
    try:
        yield
    except BaseException as exc:
        if not run_sync(manager.__aexit__(type(exc), exc, exc.__traceback__)):
            raise
    else:
        run_sync(manager.__aexit__(None, None, None))
