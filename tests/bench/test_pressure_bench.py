"""The pressure benchmark of issue 26 (tests/bench/pressure.py), short: 20-second phases at
100 jobs/s, each scenario on a server of its own (marker ``bench``: deselected by default).

Only that the figures came out is asserted: the speed claims are the printed ratios of a full
run (``python -m tests.bench.pressure xid --hold 600``; docs/benchmarks.md, "Pressure").
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench import pressure
from tests.support.throwaway import require_bindir

pytestmark = pytest.mark.bench


@pytest.mark.timeout(600)
@pytest.mark.parametrize("scenario", sorted(pressure.SCENARIOS))
def test_pressure_scenario_figures(scenario: str, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    require_bindir()
    opts = pressure.Options(rate=100, clean=20, stress=20, recovery=20, warmup=5,
                            out=str(tmp_path), log=lambda text: None)
    [result] = pressure.run([scenario], opts)
    with capsys.disabled():
        print("\n" + pressure.report(result))

    phases = {row["phase"]: row for row in result["phases"]}
    assert list(phases) == ["clean", pressure.SCENARIOS[scenario].stress, "recovery"]
    for row in phases.values():
        assert row["completed"] > 0, row
        assert row["sent_per_s"] > 0, row
        assert None not in (row["p50_ms"], row["p95_ms"], row["p99_ms"]), row
        assert row["depth"] is not None and row["dead_tuples"] is not None, row
        if result["server"]["shared_preload_libraries"] == "pg_stat_statements":
            assert row["claim"]["calls"] > 0 and row["claim"]["blocks_per_call"] > 0, row
    assert phases["recovery"]["vs_clean"]["p99"] is not None
    assert "recovered_after_s" in result["recovery"]
    assert len(result["windows"]) == 6  # three phases of two 10-second windows
    assert (tmp_path / f"pressure-{scenario}.json").exists()
