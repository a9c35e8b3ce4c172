"""A change's cost on the harness's own figures, in adjacent pairs: a git revision's tree
(default ``main``, exported with ``git archive``) and this tree each run ``python -m tests.bench
--sections compare --brokers pgbroker --rounds 1`` in turn (A B, B A, ...), each with its own
pgbroker on ``PYTHONPATH``, so that a load drift on a shared machine hits both alike. Prints,
for publish rate, drain rate and p50/p99 pickup latency in each worker configuration, both
sides' medians and the median of the pairs' ratios (this tree / the other; for latencies the
other / this tree, so that below 1 is always worse).

    python -m tests.bench.tree_pairs [--against REV] [--pairs N] [--n TASKS]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIGURES = (("publish", False), ("drain", False), ("p50_ms", True), ("p99_ms", True))


def run_side(tree: str, n: int, out: str) -> dict[str, dict[str, float]]:
    """One round of the harness's compare section on ``tree``: {config: {figure: value}}."""
    subprocess.run([sys.executable, "-m", "tests.bench", "--sections", "compare", "--brokers",
                    "pgbroker", "--rounds", "1", "--n", str(n), "--out", out], cwd=tree,
                   env={**os.environ, "PYTHONPATH": tree}, check=True,
                   stdout=subprocess.DEVNULL)
    runs = json.loads(Path(out, "results.json").read_text())["compare"]["runs"]["pgbroker"]
    found = {}
    for config, results in runs.items():
        if "error" in results[0]:
            raise RuntimeError(f"{tree} {config}: {results[0]['error']}")
        found[config] = {key: results[0][key] for key, _ in FIGURES}
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default="main", metavar="REV")
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--n", type=int, default=2000, help="tasks per measurement")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tree_pairs_") as work:
        other = os.path.join(work, "other")
        os.makedirs(other)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.against],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", other], input=archive, check=True)
        sides = {"other": other, "this": str(REPO)}
        got: dict[str, list[dict[str, dict[str, float]]]] = {"other": [], "this": []}
        for i in range(args.pairs):
            for name in (("other", "this") if i % 2 == 0 else ("this", "other")):
                got[name].append(run_side(sides[name], args.n, os.path.join(work, f"{name}{i}")))
                print(f"pair {i + 1} {name}: {json.dumps(got[name][-1])}", flush=True)
    print(f"\n{args.pairs} pairs, {args.n} tasks a measurement; this tree against {args.against}")
    for config in got["this"][0]:
        for key, lower_is_better in FIGURES:
            this = [r[config][key] for r in got["this"]]
            that = [r[config][key] for r in got["other"]]
            ratios = [(b / a) if lower_is_better else (a / b) for a, b in zip(this, that)]
            print(f"{config:>12} {key:>8}: this {statistics.median(this):10.1f}  other "
                  f"{statistics.median(that):10.1f}  ratio (median of pairs) "
                  f"{statistics.median(ratios):.3f}  [{min(ratios):.3f}-{max(ratios):.3f}]")


if __name__ == "__main__":
    main()
