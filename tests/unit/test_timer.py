"""The consumer's one timer type (pgbroker._consume.timer): earliest wins, on the event loop's
timers or as a deadline the synchronous path checks."""

from __future__ import annotations

from time import monotonic
from typing import Any

from pgbroker._consume.timer import Timer


class Entry:
    def __init__(self, loop: FakeLoop, delay: float, callback: Any):
        self.loop, self.delay, self.callback, self.cancelled = loop, delay, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class FakeLoop:
    """kombu's hub as far as a Timer uses it: call_later, and entries that can be cancelled."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []

    def call_later(self, delay: float, callback: Any) -> Entry:
        self.entries.append(Entry(self, delay, callback))
        return self.entries[-1]

    def live(self) -> list[Entry]:
        return [e for e in self.entries if not e.cancelled]


def test_the_earliest_time_wins_and_a_later_one_changes_nothing() -> None:
    fired: list[int] = []
    timer = Timer(lambda: fired.append(1))
    now = monotonic()
    timer.at_latest(now + 10)
    timer.at_latest(now + 5)
    timer.at_latest(now + 20)
    assert timer.at == now + 5
    assert not timer.fire_if_due(now + 4.9) and fired == []
    assert timer.fire_if_due(now + 5) and fired == [1]
    assert timer.at is None and not timer.fire_if_due(now + 100)


def test_in_a_loop_it_is_one_entry_moved_earlier_and_gone_when_detached() -> None:
    fired: list[int] = []
    timer, loop = Timer(lambda: fired.append(1)), FakeLoop()
    timer.at_latest(monotonic() + 60)  # armed before there is a loop: kept for it
    timer.attach(loop)
    assert len(loop.live()) == 1 and 59 < loop.live()[0].delay <= 60
    timer.at_latest(monotonic() + 1)
    (entry,) = loop.live()
    assert entry.delay <= 1
    entry.callback()
    assert fired == [1] and timer.at is None
    timer.at_latest(monotonic() + 1)
    timer.detach()
    assert loop.live() == [] and timer.at is None


def test_fired_by_hand_it_cancels_its_entry_and_may_be_armed_again_by_its_callback() -> None:
    loop = FakeLoop()
    timer = Timer(lambda: timer.at_latest(monotonic() + 30))
    timer.attach(loop)
    timer.at_latest(monotonic() + 5)
    first = loop.live()[0]
    timer.fire()  # the poll promotes at once
    assert first.cancelled
    (again,) = loop.live()
    assert 29 < again.delay <= 30
