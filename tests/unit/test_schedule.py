"""pgbroker._model.schedule alone: grids, daylight saving, and the misfire/overlap plan (no
database).

The scheduler that runs them against PostgreSQL is tested in ``tests/integration/test_beat.py``.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from celery.schedules import crontab, schedule, solar

from pgbroker._model.schedule import (
    Cron,
    Every,
    Grid,
    grid_from_spec,
    grid_of,
    iso_utc,
    occurrence_key,
    plan,
    zone_name,
)
from pgbroker.errors import ConfigurationError

UTC = timezone.utc
PARIS = ZoneInfo("Europe/Paris")
T0 = datetime(2025, 1, 6, 12, 0, 30, tzinfo=UTC)  # a Monday
MIN = timedelta(minutes=1)


def at(*args: int) -> datetime:
    return datetime(*args, tzinfo=UTC)


# -- grids -------------------------------------------------------------------------------------

def test_intervals_sit_on_a_grid_counted_from_the_epoch() -> None:
    grid = Every(timedelta(seconds=60))
    assert grid.next_after(at(2025, 1, 1, 12, 0, 0)) == at(2025, 1, 1, 12, 1, 0)
    assert grid.next_after(at(2025, 1, 1, 12, 0, 59)) == at(2025, 1, 1, 12, 1, 0)
    assert grid.latest_at_or_before(at(2025, 1, 1, 12, 5, 10), at(2025, 1, 1, 12, 1)) \
        == at(2025, 1, 1, 12, 5)
    assert Every(timedelta(hours=1)).next_after(T0) == at(2025, 1, 6, 13)
    with pytest.raises(ConfigurationError, match="at least 1 ms"):
        Every(timedelta(0))


@pytest.mark.parametrize("misfire, overlap, unfinished, now, expected", [
    # on time, and late within its own period: the due occurrence fires
    ("latest", "skip", False, at(2025, 1, 1, 12, 1, 0), ("fired", 1, 2)),
    ("skip", "skip", False, at(2025, 1, 1, 12, 1, 59), ("fired", 1, 2)),
    # down 5 minutes: latest fires once for the latest occurrence, skip waits for the next
    ("latest", "allow", False, at(2025, 1, 1, 12, 6, 10), ("fired", 6, 7)),
    ("skip", "allow", False, at(2025, 1, 1, 12, 6, 10), ("missed", None, 7)),
    # the previous job is unfinished
    ("latest", "skip", True, at(2025, 1, 1, 12, 1, 5), ("overlap", None, 2)),
    ("latest", "queue", True, at(2025, 1, 1, 12, 1, 5), ("held", None, 1)),
    ("latest", "allow", True, at(2025, 1, 1, 12, 1, 5), ("fired", 1, 2)),
])
def test_plan(misfire: str, overlap: str, unfinished: bool, now: datetime,
              expected: tuple[str, int | None, int]) -> None:
    p = plan(Every(MIN), at(2025, 1, 1, 12, 1), now, misfire, overlap, unfinished)
    outcome, fire_minute, next_minute = expected
    assert p.outcome == outcome
    assert p.fire == (None if fire_minute is None else at(2025, 1, 1, 12, fire_minute))
    assert p.next_occurrence == at(2025, 1, 1, 12, next_minute)


def test_crontab_grid_follows_wall_clock_across_daylight_saving() -> None:
    grid = Cron({"minute": "30", "hour": "2"}, "Europe/Paris")
    # 2025-03-30: 02:30 does not exist in Paris (clocks go 02:00 -> 03:00): that day it fires
    # an hour later by the wall clock, at the same UTC time (as cron does), and never twice
    found, t = [], at(2025, 3, 28, 0, 0)
    for _ in range(4):
        t = grid.next_after(t)
        found.append(t)
    assert found[0] == at(2025, 3, 28, 1, 30)  # 02:30 CET
    assert [o.astimezone(PARIS).strftime("%d %H:%M") for o in found] == [
        "28 02:30", "29 02:30", "30 03:30", "31 02:30"]
    # and the latest at or before a time, searched backwards
    assert grid.latest_at_or_before(at(2025, 4, 10, 12), found[0]) == at(2025, 4, 10, 0, 30)


def test_solar_entries_fire_at_the_event() -> None:
    ephem = pytest.importorskip("ephem")
    grid = grid_of(solar("sunrise", 48.85, 2.35))
    t, found = at(2025, 6, 1, 0, 0), []
    for _ in range(3):
        t = grid.next_after(t)
        found.append(t)
    paris = ephem.Observer()
    paris.lat, paris.lon, paris.horizon, paris.pressure = "48.85", "2.35", "-0:34", 0
    for day, occurrence in zip((1, 2, 3), found):
        expected = paris.next_rising(ephem.Sun(), start=datetime(2025, 6, day)).datetime()
        assert abs(occurrence.replace(tzinfo=None) - expected) < timedelta(seconds=1)
        assert occurrence.astimezone(PARIS).strftime("%H") == "05"  # a Parisian June sunrise


def test_a_crontab_fires_once_in_the_hour_repeated_when_clocks_go_back() -> None:
    grid = Cron({"minute": "30", "hour": "2"}, "Europe/Paris")
    # 2025-10-26: 02:00-03:00 happens twice in Paris (CEST, then CET); 02:30 fires once a day
    found, t = [], at(2025, 10, 25, 0, 0)
    for _ in range(3):
        t = grid.next_after(t)
        found.append(t)
    assert [o.astimezone(PARIS).strftime("%d %H:%M") for o in found] == [
        "25 02:30", "26 02:30", "27 02:30"]
    assert all(b > a for a, b in zip(found, found[1:]))


def test_every_latest_occurrence_is_the_same_closed_form_or_searched() -> None:
    grid = Every(timedelta(seconds=7))
    for now in (at(2025, 1, 1, 12, 0, 0), at(2025, 1, 1, 12, 3, 5), at(2025, 2, 3, 4, 5, 6)):
        start = grid.next_after(now - timedelta(hours=1))
        assert grid.latest_at_or_before(now, start) \
            == Grid.latest_at_or_before(grid, now, start)


def test_grids_round_trip_through_their_stored_spec() -> None:
    weekdays = crontab(minute="*/15", hour="9-17", day_of_week="mon-fri")
    for grid in (grid_of(90), grid_of(timedelta(hours=2)), grid_of(schedule(timedelta(seconds=5))),
                 grid_of(weekdays, "Europe/Paris")):
        again = grid_from_spec(grid.spec)
        assert again.spec == grid.spec and again.describe() == grid.describe()
        assert again.next_after(T0) == grid.next_after(T0)
    assert grid_of(90).describe() == "every 90s"


@pytest.mark.parametrize("bad, message", [
    ("daily", "cannot be stored in PostgreSQL"),
    (True, "cannot be stored in PostgreSQL"),
])
def test_a_schedule_that_cannot_be_stored_is_refused(bad: object, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        grid_of(bad)


def test_a_bad_stored_spec_or_zone_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="is not an object"):
        grid_from_spec(["every", 60])  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="neither every, crontab nor solar"):
        grid_from_spec({"hourly": True})
    with pytest.raises(ConfigurationError, match="unknown time zone"):
        Cron({"minute": "0"}, "Mars/Olympus")
    with pytest.raises(ConfigurationError, match="unknown crontab field"):
        Cron({"second": "0"}, "UTC")


def test_zone_names_and_occurrence_keys() -> None:
    assert zone_name(timezone.utc) == "UTC"
    assert zone_name(PARIS) == "Europe/Paris"
    with pytest.raises(ConfigurationError, match="no IANA name"):
        zone_name(timezone(timedelta(hours=2)))
    paris_noon = datetime(2025, 1, 6, 13, 0, tzinfo=PARIS)
    assert iso_utc(paris_noon) == "2025-01-06T12:00:00+00:00"
    assert occurrence_key("report", paris_noon) == "beat:report:2025-01-06T12:00:00+00:00"


# -- the plan ----------------------------------------------------------------------------------

@pytest.mark.parametrize("overlap, expected", [
    ("skip", ("missed", None, 7)), ("queue", ("missed", None, 7)), ("allow", ("missed", None, 7)),
])
def test_misfire_skip_waits_whatever_the_previous_job(overlap: str,
                                                      expected: tuple[str, None, int]) -> None:
    p = plan(Every(MIN), at(2025, 1, 1, 12, 1), at(2025, 1, 1, 12, 6, 10), "skip", overlap, True)
    assert (p.outcome, p.fire, p.next_occurrence) == (
        expected[0], None, at(2025, 1, 1, 12, expected[2]))


def test_misfire_latest_with_overlap_skip_skips_past_the_latest_occurrence() -> None:
    p = plan(Every(MIN), at(2025, 1, 1, 12, 1), at(2025, 1, 1, 12, 6, 10), "latest", "skip", True)
    assert (p.outcome, p.fire, p.next_occurrence) == ("overlap", None, at(2025, 1, 1, 12, 7))
