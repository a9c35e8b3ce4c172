"""Bench of issue 22's claim (marker ``bench``): the drain of unkeyed jobs by main's pgbroker and
by this branch's, in paired rounds (main, branch, branch keyed; again), and the drain of keyed
jobs on this branch.

``PGBROKER_BENCH_MAIN`` is main's source tree (default /work/main); ``PGBROKER_BENCH_N`` the jobs
per drain (default 3,000), ``PGBROKER_BENCH_ROUNDS`` the rounds (default 3). Each drain gets a
fresh database, its N jobs queued first, then one ``celery worker -c 4`` (prefetch 4, acks late)
of that tree; the drain is first claim to last ack, by the database clock (``locked_at`` ->
``updated_at``). Speeds are printed, not asserted; asserted is that every job completed once.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from tests.support.processes import wait_for

pytestmark = pytest.mark.bench

BRANCH = Path(__file__).resolve().parents[2]
MAIN = Path(os.environ.get("PGBROKER_BENCH_MAIN", "/work/main"))
HERE = Path(__file__).resolve().parent


def _drain(database_url: str, tree: Path, n: int, keys: int, log: Path) -> float:
    """Jobs per second of one drain by ``tree``'s pgbroker in a fresh database."""
    name = f"keysbench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = database_url.rsplit("/", 1)[0] + "/" + name
    env = {**os.environ, "PGBROKER_TEST_BROKER_URL": "pgbroker://" + url.split("://", 1)[1],
           "PYTHONPATH": f"{tree}{os.pathsep}{HERE}"}
    try:
        # cwd = the tree: python -m puts it first on sys.path, so its pgbroker is the one used
        subprocess.run([sys.executable, str(HERE / "keys_bench_app.py"), str(n), str(keys)],
                       env=env, cwd=tree, check=True)
        with log.open("w") as out:
            worker = subprocess.Popen(
                [sys.executable, "-m", "celery", "-A", "keys_bench_app", "worker", "-c", "4",
                 "-P", "prefork", "--loglevel=WARNING", "-n", f"{name}@%h"],
                env=env, cwd=tree, stdout=out, stderr=subprocess.STDOUT)
        try:
            with psycopg.connect(url, autocommit=True) as pg:
                wait_for(lambda: pg.execute(
                    "SELECT count(*) FROM pgbroker.jobs WHERE state = 'completed'").fetchone()[0]
                    == n, 300, interval=0.1, message=f"{n} completed jobs ({log})")
                seconds, runs = pg.execute(
                    "SELECT extract(epoch FROM max(updated_at) - min(locked_at))::float8,"
                    " max(attempts) FROM pgbroker.jobs").fetchone()
                assert runs == 1  # nothing delivered twice
        finally:
            worker.terminate()
            worker.wait(30)
    finally:
        time.sleep(0.2)
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))
    return n / seconds


def test_unkeyed_drain_main_vs_branch_and_keyed_drain(database_url: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    if not (MAIN / "pgbroker" / "__init__.py").exists():
        pytest.skip(f"no main tree at {MAIN} (PGBROKER_BENCH_MAIN)")
    n = int(os.environ.get("PGBROKER_BENCH_N", "3000"))
    rounds = int(os.environ.get("PGBROKER_BENCH_ROUNDS", "3"))
    rates: dict[str, list[float]] = {"main": [], "branch": [], "branch, 100 keys": [],
                                     "branch, 4 keys": []}
    for r in range(rounds):
        rates["main"].append(_drain(database_url, MAIN, n, 0, tmp_path / f"main{r}.log"))
        rates["branch"].append(_drain(database_url, BRANCH, n, 0, tmp_path / f"branch{r}.log"))
        rates["branch, 100 keys"].append(
            _drain(database_url, BRANCH, n, 100, tmp_path / f"keyed{r}.log"))
        rates["branch, 4 keys"].append(
            _drain(database_url, BRANCH, n, 4, tmp_path / f"hot{r}.log"))
    ratios = [b / m for b, m in zip(rates["branch"], rates["main"], strict=True)]
    with capsys.disabled():
        print(f"\n[figure] drain of {n:,} jobs, one worker -c 4, {rounds} paired rounds (jobs/s):")
        for label, values in rates.items():
            print(f"  {label:18} " + "  ".join(f"{v:7.0f}" for v in values)
                  + f"   median {statistics.median(values):7.0f}")
        print("  branch/main per round: " + "  ".join(f"{x:.2f}" for x in ratios)
              + f"   median {statistics.median(ratios):.2f}")
