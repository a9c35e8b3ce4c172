"""Bench of the claim behind a paused task's backlog (marker ``bench``): a queue whose head holds N
pending jobs of a paused task name, and 3,000 jobs of another name behind them, claimed in claims
of 10 through ``Store.claim`` (paused_backlog_run.py, each run in a fresh database), for
N = 0, 10,000 and 100,000. Prints the median time per claim and its ratio against N = 0 of the
same tree, for this branch and, when its tree is there, main's.

``PGBROKER_BENCH_MAIN`` is main's source tree (default /work/main; the main side is skipped when
it is missing). Figures are printed, not asserted.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.bench.harness import empty_database

pytestmark = pytest.mark.bench

BRANCH = Path(__file__).resolve().parents[2]
MAIN = Path(os.environ.get("PGBROKER_BENCH_MAIN", "/work/main"))
RUN = Path(__file__).resolve().parent / "paused_backlog_run.py"
BACKLOGS = (0, 10_000, 100_000)
OTHERS, BATCH = 3_000, 10


def _run(database_url: str, tree: Path, backlog: int) -> tuple[float, float]:
    """(median ms per claim, claimed jobs/s) of one run of ``tree``'s pgbroker."""
    with empty_database(database_url, f"pausedbench_{uuid.uuid4().hex[:10]}") as url:
        out = subprocess.run([sys.executable, str(RUN), url, str(backlog), str(OTHERS),
                              str(BATCH)], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                             check=True, capture_output=True, text=True).stdout
        ms, rate = out.split()[-2:]
        return float(ms), float(rate)


def test_claim_behind_a_paused_backlog(database_url: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    trees = {"branch": BRANCH}
    if (MAIN / "pgbroker" / "__init__.py").exists():
        trees["main"] = MAIN
    figures = {label: {n: _run(database_url, tree, n) for n in BACKLOGS}
               for label, tree in trees.items()}
    with capsys.disabled():
        print(f"\n[figure] claims of {BATCH} of {OTHERS:,} jobs behind N pending jobs of a paused"
              " task name (median ms per claim, jobs/s, ratio of ms to N = 0):")
        for label, rows in figures.items():
            base = rows[0][0]
            print(f"  {label:6} " + "   ".join(
                f"N={n:>7,}: {ms:7.3f} ms {rate:6.0f}/s x{ms / base:6.1f}"
                for n, (ms, rate) in rows.items()))
