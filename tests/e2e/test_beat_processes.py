"""Real ``celery beat`` processes with pgbroker's scheduler (``tests/apps/beat_app.py``).

Several beats at once fire each occurrence of a 1-second entry exactly once, with none missed,
and keep doing so when one of them is killed with SIGKILL; a worker's task reads the occurrence
it was fired for; an entry disabled and enabled at run time is followed without a restart. Every
figure comes from the jobs table (the occurrence each job was fired for), not from the logs.
"""

from __future__ import annotations

import itertools
import signal
import time
from collections import Counter
from datetime import datetime, timedelta

import psycopg
import pytest

from pgbroker.beat import Schedules
from tests.apps.beat_app import TICK
from tests.support.db import db_now
from tests.support.processes import BeatProcess, run_beat, run_worker, wait_for

SECOND = timedelta(seconds=1)


def occurrences(pg: psycopg.Connection) -> list[datetime]:
    """The occurrence of every job beat enqueued (with repeats, if any), in order."""
    return [datetime.fromisoformat(r[0]) for r in pg.execute(
        "SELECT headers->>'pgbroker_occurrence' FROM pgbroker.jobs WHERE task = %s"
        " ORDER BY 1", (TICK,))]


def figures(found: list[datetime]) -> tuple[int, int, timedelta]:
    """(distinct occurrences, duplicates, largest gap between consecutive occurrences)."""
    distinct = sorted(set(found))
    gaps = [b - a for a, b in itertools.pairwise(distinct)]
    return len(distinct), len(found) - len(distinct), max(gaps, default=timedelta(0))


def sent(beat: BeatProcess) -> int:
    return beat.log_path.read_text(errors="replace").count("Sending due task tick")


def test_three_beats_fire_each_occurrence_once(broker_url: str, pg: psycopg.Connection) -> None:
    beats = [run_beat("tests.apps.beat_app", broker_url, "-S", "pgbroker"),  # the entry point
             run_beat("tests.apps.beat_app", broker_url),  # beat_scheduler from the config
             run_beat("tests.apps.beat_app", broker_url)]
    # the run under test: ten occurrences, each one raced for by three beats
    wait_for(lambda: len(set(occurrences(pg))) >= 10, 60, interval=0.2,
             message="ten occurrences")
    for beat in beats:
        beat.stop()

    found = occurrences(pg)
    count, duplicates, max_gap = figures(found)
    print(f"\n3 beats: {count} occurrences, {duplicates} duplicates, largest gap "
          f"{max_gap.total_seconds():g} s; sent by each beat: {[sent(b) for b in beats]}")
    assert duplicates == 0
    assert max_gap == SECOND, sorted(found)  # none missed
    assert count >= 10
    assert sum(sent(b) for b in beats) == count  # each job sent by exactly one beat
    assert all(b.returncode == 0 for b in beats), [b.returncode for b in beats]


def test_beats_carry_on_when_one_is_killed(broker_url: str, pg: psycopg.Connection) -> None:
    beats = [run_beat("tests.apps.beat_app", broker_url) for _ in range(3)]
    wait_for(lambda: len(set(occurrences(pg))) >= 4, 60, interval=0.2,
             message="4 occurrences before the kill")
    victim = max(beats, key=sent)  # the one that has been winning the races
    victim.kill(signal.SIGKILL)
    victim.wait(10)
    killed_at = db_now(pg)
    before = len(set(occurrences(pg)))
    wait_for(lambda: len([o for o in occurrences(pg) if o > killed_at]) >= 8, 60, interval=0.2,
             message="8 occurrences after the kill")
    for beat in beats:
        beat.stop()

    found = occurrences(pg)
    count, duplicates, max_gap = figures(found)
    after = len([o for o in set(found) if o > killed_at])
    print(f"\n3 beats, one SIGKILLed after {before} occurrences: {count} occurrences "
          f"({after} after the kill), {duplicates} duplicates, largest gap "
          f"{max_gap.total_seconds():g} s; sent by each beat: {[sent(b) for b in beats]}")
    assert duplicates == 0
    assert max_gap == SECOND, sorted(found)
    assert victim.returncode == -signal.SIGKILL


@pytest.mark.usefixtures("runs")
def test_a_task_reads_its_occurrence_and_run_time_switches_are_followed(
        broker_url: str, pg: psycopg.Connection) -> None:
    # -S: the entry point, as in test_three_beats_fire_each_occurrence_once (.ci/matrix's older
    # Celery versions run this test, not that one)
    beat = run_beat("tests.apps.beat_app", broker_url, "-S", "pgbroker")
    worker = run_worker("tests.apps.beat_app", broker_url, "-c", "1").wait_ready(60)

    def tick_runs() -> list[str]:
        return [r[0] for r in pg.execute("SELECT key FROM public.runs WHERE task = 'tick'")]

    wait_for(lambda: len(tick_runs()) >= 2, 60, interval=0.2, message="two runs of tick")
    sent_for = {o.isoformat() for o in occurrences(pg)}
    assert set(tick_runs()) <= sent_for  # self.request.pgbroker_occurrence = the job's header

    schedules = Schedules(pg, actor="test", via="test")
    assert schedules.set_enabled("tick", False)
    disabled_at = db_now(pg)
    time.sleep(8)  # more than beat's 5 s max_interval: the switch has been read
    assert max(occurrences(pg)) <= disabled_at  # nothing fired for an occurrence after it
    count_disabled = len(occurrences(pg))

    assert schedules.set_enabled("tick", True)
    enabled_at = db_now(pg)
    wait_for(lambda: max(occurrences(pg)) >= enabled_at - SECOND, 30, interval=0.2,
             message="an occurrence after the entry was enabled again")
    wait_for(lambda: set(tick_runs()) == {o.isoformat() for o in occurrences(pg)}, 30,
             interval=0.2, message="the worker to run every job beat sent")
    counts = Counter(tick_runs())
    print(f"\nruns of tick: {len(counts)}, each occurrence run once: "
          f"{set(counts.values()) == {1}}; jobs while disabled: {count_disabled}")
    assert set(counts.values()) == {1}
    for process in (beat, worker):
        process.stop()


def test_beat_stopped_while_it_applies_its_config_exits(broker_url: str, db_url: str,
                                                        pg: psycopg.Connection) -> None:
    """SIGTERM while the first scheduler applies the config, its config lock held: Celery's
    handler builds a second scheduler (Service.sync reads Service.scheduler, not set yet), which
    must not wait for that lock. It did, and beat hung until SIGKILL."""
    # An entry of an earlier config: this beat's sync marks it removed, and waits for its row.
    pg.execute("INSERT INTO pgbroker.beat_schedule (name, task, schedule, source, "
               "next_occurrence) VALUES ('gone', 'gone', '{\"every\": 60}', 'config', now())")
    with psycopg.connect(db_url) as holder, holder.transaction():
        holder.execute("SELECT 1 FROM pgbroker.beat_schedule WHERE name = 'gone' FOR UPDATE")
        beat = run_beat("tests.apps.beat_app", broker_url)
        wait_for(lambda: pg.execute(
            "SELECT 1 FROM pg_stat_activity WHERE application_name = 'pgbroker beat' "
            "AND wait_event_type = 'Lock' AND datname = current_database()").fetchone(), 60,
            message="beat waiting for the row")
        beat.kill(signal.SIGTERM)
        time.sleep(0.5)  # the signal is in; beat goes on once the row is free
    assert beat.wait(20) == 0, beat.log()[-3000:]
