"""pgbroker._pg.any_connection: one coroutine for a synchronous and an asyncio psycopg connection
(no database:
the driver calls here are plain values and plain coroutines)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from pgbroker._pg import any_connection as _io


async def write(value: object, fail: bool = False) -> object:
    """What a write does: await driver results -- here plain values, as a Connection's are."""
    first = await _io.awaited(value)
    if fail:
        raise ZeroDivisionError("the statement failed")
    return (first, await _io.awaited([first]))


def test_run_sync_runs_a_coroutine_that_awaits_only_plain_results() -> None:
    assert _io.run_sync(write(7)) == (7, [7])
    with pytest.raises(ZeroDivisionError, match="the statement failed"):
        _io.run_sync(write(7, fail=True))


def test_run_sync_refuses_a_coroutine_that_suspends() -> None:
    """An asyncio connection handed to the synchronous API: a clear error, nothing left open."""
    closed = []

    async def waits() -> None:
        try:
            await asyncio.sleep(0)  # a real suspension, as an AsyncConnection's call makes
        finally:
            closed.append(True)

    with pytest.raises(RuntimeError, match="waited on an asyncio connection"):
        _io.run_sync(waits())
    assert closed == [True]


def test_awaited_awaits_an_awaitable_on_an_event_loop() -> None:
    async def main() -> object:
        return await _io.awaited(asyncio.sleep(0.01, result="slept"))

    assert asyncio.run(main()) == "slept"


def test_sync_context_runs_an_async_context_manager_and_passes_exceptions_to_it() -> None:
    seen: list[object] = []

    @contextlib.asynccontextmanager
    async def block() -> AsyncIterator[None]:
        seen.append("enter")
        try:
            yield
        except KeyError as exc:
            seen.append(("error", exc.args))
            raise
        seen.append("exit")

    with _io.sync_context(block()):
        seen.append("body")
    with pytest.raises(KeyError), _io.sync_context(block()):
        raise KeyError("k")
    assert seen == ["enter", "body", "exit", "enter", ("error", ("k",))]
