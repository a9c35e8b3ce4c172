"""The benchmark as pytest tests (marker ``bench``: deselected by default).

``pytest -m "bench and not slow" tests/bench`` runs a smaller side-by-side pass (N from
``PGBROKER_BENCH_N``, default 2,000; one round) and prints the table; ``pytest -m bench`` adds the
slow memory bench. Speeds are printed, never asserted: what is asserted is that every measured
task ran exactly once on every broker, and that a worker's memory does not grow with the number
of tasks it ran. ``python -m tests.bench`` is the full run (docs/benchmarks.md).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.bench import capacity, harness
from tests.bench.__main__ import ceiling_report, table

pytestmark = pytest.mark.bench


def test_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    opts = harness.Options(
        n=int(os.environ.get("PGBROKER_BENCH_N", "2000")), rounds=1, latency_samples=100,
        latency_budget=15.0, scale_sizes=(0, 100_000), bulk_jobs=5_000, pgbench_seconds=3.0)
    results = harness.run(opts, str(tmp_path))
    with capsys.disabled():
        print("\n" + table(results))

    assert not results.get("failed"), results["failed"]
    runs = results["compare"]["runs"]
    assert "pgbroker" in runs, results["compare"]["skipped"]
    for broker, per_config in runs.items():
        for config, measured in per_config.items():
            for result in measured:
                assert "error" not in result, (broker, config, result)
                assert result["lost_or_duplicated"] == 0, (broker, config, result)
                assert result["latency_samples"] > 0, (broker, config, result)
    for point in results["scale"]["points"]:
        assert len(point["filled"]) == len(point["empty"]) == 1
    assert len(results["bulk"]["enqueue_many"]) >= 3


def test_ceiling(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same drain on pgbroker's schema and on a bare table: every task still runs once."""
    opts = harness.Options(n=int(os.environ.get("PGBROKER_BENCH_N", "2000")), rounds=1,
                           latency_samples=50, sections=("ceiling",))
    results = harness.run(opts, str(tmp_path))
    assert not results.get("failed"), results["failed"]
    report = ceiling_report(results["ceiling"])
    with capsys.disabled():
        print("\n" + report)
    runs = results["ceiling"]["runs"]
    assert {"pgbroker", "pgbroker_bare"} <= set(runs)
    for broker, measured in runs.items():
        assert [r["lost_or_duplicated"] for r in measured] == [0], (broker, measured)
    assert "| drain, tasks/s | " in report


@pytest.mark.slow
def test_worker_memory_does_not_grow(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """100,000 tasks through one pgbroker worker: the RSS of its main process and of its pool
    children after them is within a few MB of what it was after a 5,000-task warm-up (a leak of
    a few hundred bytes per task would show as tens of MB)."""
    results = harness.run(harness.Options(sections=("memory",)), str(tmp_path))
    with capsys.disabled():
        print("\n" + table(results))
    assert not results.get("failed"), results["failed"]
    memory = results["memory"]
    (warm_main, warm_children), (main, children) = memory["warm"], memory["after"]
    assert memory["tasks"] >= 100_000
    assert main - warm_main < 20, memory
    assert len(children) == len(warm_children) == 2, memory
    assert all(after - before < 20 for before, after in zip(warm_children, children)), memory


def test_durable_publish_and_capacity(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """RabbitMQ with publisher confirms beside pgbroker (every task once on each), and the
    per-task cost on a server of its own with pg_stat_statements (issue 20)."""
    opts = harness.Options(n=int(os.environ.get("PGBROKER_BENCH_N", "1000")), rounds=1,
                           latency_samples=30, sections=capacity.SECTIONS)
    results = capacity.run(opts, str(tmp_path))
    with capsys.disabled():
        print("\n" + capacity.durable_report(results["durable"]))
        print("\n" + capacity.capacity_report(results["capacity"]))
    for broker, measured in results["durable"]["runs"].items():
        assert [r["lost_or_duplicated"] for r in measured] == [0], (broker, measured)
    phases = results["capacity"]
    assert {"publish[default]", "drain[default]"} <= set(phases)
    # one INSERT per publish, about one claim statement per task at prefetch 1 (acks folded in)
    assert phases["publish[default]"]["statements_per_task"] >= 1
    assert all(p["cpu_ms_per_task"] > 0 and p["wal_bytes_per_task"] > 0 for p in phases.values())
