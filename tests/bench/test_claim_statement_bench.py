"""Bench of the claim statement alone (marker ``bench``): main's pgbroker and this branch's on an
unkeyed queue, in paired rounds (main, branch; branch, main; ...), each in a fresh database
(claim_statement_run.py: 6,000 jobs, claims of 4 with the previous claim's acks folded in, no
Celery). Issue 22: an unkeyed queue's claim costs what main's does.

``PGBROKER_BENCH_MAIN`` is main's source tree (default /work/main), ``PGBROKER_BENCH_ROUNDS`` the
rounds (default 6). Rates are printed with the median per-round ratio, not asserted.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.bench.harness import empty_database

pytestmark = pytest.mark.bench

BRANCH = Path(__file__).resolve().parents[2]
MAIN = Path(os.environ.get("PGBROKER_BENCH_MAIN", "/work/main"))
RUN = Path(__file__).resolve().parent / "claim_statement_run.py"


def _rate(database_url: str, tree: Path, n: int, batch: int) -> float:
    with empty_database(database_url, f"claimbench_{uuid.uuid4().hex[:10]}") as url:
        out = subprocess.run([sys.executable, str(RUN), url, str(n), str(batch)], cwd=tree,
                             env={**os.environ, "PYTHONPATH": str(tree)}, check=True,
                             capture_output=True, text=True).stdout
        return float(out.split()[-1])


def test_unkeyed_claim_statement_main_vs_branch(database_url: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    if not (MAIN / "pgbroker" / "__init__.py").exists():
        pytest.skip(f"no main tree at {MAIN} (PGBROKER_BENCH_MAIN)")
    rounds = int(os.environ.get("PGBROKER_BENCH_ROUNDS", "6"))
    main, branch = [], []
    for r in range(rounds):  # which goes first alternates (the other runs after a DROP DATABASE)
        if r % 2:
            branch.append(_rate(database_url, BRANCH, 6000, 4))
        main.append(_rate(database_url, MAIN, 6000, 4))
        if not r % 2:
            branch.append(_rate(database_url, BRANCH, 6000, 4))
    ratios = [b / m for b, m in zip(branch, main, strict=True)]
    with capsys.disabled():
        print(f"\n[figure] claim statement, 6,000 unkeyed jobs, claims of 4, acks folded,"
              f" {rounds} paired rounds (jobs/s):")
        print("  main   " + "  ".join(f"{v:6.0f}" for v in main))
        print("  branch " + "  ".join(f"{v:6.0f}" for v in branch))
        print("  branch/main per round: " + "  ".join(f"{x:.2f}" for x in ratios)
              + f"   median {statistics.median(ratios):.2f}")
