"""The claim stays cheap at any table size: its plan uses the partial index ``jobs_claim_idx``.

Not a benchmark (it runs with the ordinary suite): it asserts the *plan*, never a time. The table
holds what a busy production table holds: 1,000,000 completed rows inside the retention window,
100,000 scheduled jobs (future ``run_at``) and a backlog of pending jobs in the claimed queue and
in another one, all in the claimed queue's name where it hurts most; then ANALYZE. Both plans a
worker can get are checked: the custom plan of a one-off execution, and the generic plan psycopg
gets once it prepares the statement (its 5th execution on a connection).
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
from psycopg import sql

from pgbroker._model.claimed import after_params
from pgbroker._pg.catalogue import queries
from pgbroker._pg.libpq import numbered as _numbered
from pgbroker.ops import Operations
from tests.bench.harness import fill

COMPLETED = 1_000_000
SCHEDULED = 100_000
BACKLOG = 10_000          # pending in the claimed queue
OTHER_BACKLOG = 20_000    # pending in another queue

SAMPLE = {"task": "bench.noop", "routing_key": "celery", "body": b'[[], {}, {}]',
          "content_type": "application/json", "content_encoding": "utf-8",
          "headers": {"task": "bench.noop"}, "properties": {}}

PARAM_TYPES = {"queue": "text", "limit": "int", "consumer": "uuid", "ids": "uuid[]",
               "attempts": "int[]", "after_priority": "smallint", "after_run_at": "timestamptz",
               "after_id": "uuid"}


def _params() -> dict[str, Any]:
    return {"queue": "celery", "limit": 10, "consumer": uuid.uuid4(),
            "ids": [uuid.uuid4() for _ in range(10)], "attempts": [1] * 10, **after_params()}


def _custom_plan(pg: psycopg.Connection, query: str) -> dict[str, Any]:
    return pg.execute("EXPLAIN (FORMAT JSON) " + query, _params()).fetchone()[0][0]["Plan"]


def _generic_plan(pg: psycopg.Connection, query: str) -> dict[str, Any]:
    """The plan of the statement prepared with $n parameters, as the generic plan."""
    text, names = _numbered(query)
    prepared = text.decode()
    types = ", ".join(PARAM_TYPES[name] for name in names)
    pg.execute(f"PREPARE claim_plan ({types}) AS {prepared}")
    try:
        pg.execute("SET plan_cache_mode = force_generic_plan")
        params = _params()
        args = sql.SQL(", ").join(sql.Literal(params[name]) for name in names)
        explain = sql.SQL("EXPLAIN (FORMAT JSON) EXECUTE claim_plan ({})").format(args)
        return pg.execute(explain).fetchone()[0][0]["Plan"]
    finally:
        pg.execute("RESET plan_cache_mode")
        pg.execute("DEALLOCATE claim_plan")


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    found = [plan]
    for child in plan.get("Plans", []):
        found += _nodes(child)
    return found


def _candidate_scans(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The scans of ``jobs`` inside the ``candidates`` CTE: the claim's row selection."""
    ctes = [n for n in _nodes(plan) if n.get("Subplan Name") == "CTE candidates"]
    assert len(ctes) == 1, f"no single 'candidates' CTE in the plan: {plan}"
    return [n for n in _nodes(ctes[0]) if n.get("Relation Name") in ("jobs", "jobs_live")]


def _assert_uses_claim_index(plan: dict[str, Any]) -> None:
    scans = _candidate_scans(plan)
    assert scans, "the candidates CTE scans no jobs relation"
    for scan in scans:
        assert scan["Node Type"] in ("Index Scan", "Index Only Scan"), scan
        assert scan["Index Name"] == "jobs_claim_idx", scan
    seq = [n for n in _nodes(plan) if n["Node Type"] == "Seq Scan"
           and n.get("Relation Name") in ("jobs", "jobs_live", "jobs_done")]
    assert not seq, f"a sequential scan of jobs in the claim: {seq}"


def test_claim_plan_uses_partial_index_at_scale(db_url: str, pg: psycopg.Connection) -> None:
    fill(db_url, SAMPLE, "celery", "completed", COMPLETED)
    fill(db_url, SAMPLE, "celery", "scheduled", SCHEDULED)
    fill(db_url, SAMPLE, "celery", "pending", BACKLOG)
    fill(db_url, SAMPLE, "other", "pending", OTHER_BACKLOG)
    pg.execute("ANALYZE pgbroker.jobs")
    counts = dict(pg.execute("SELECT state, count(*) FROM pgbroker.jobs GROUP BY state"))
    assert counts == {"completed": COMPLETED, "scheduled": SCHEDULED,
                      "pending": BACKLOG + OTHER_BACKLOG}

    claim = queries("pgbroker")["job_claim"]
    _assert_uses_claim_index(_custom_plan(pg, claim))
    _assert_uses_claim_index(_generic_plan(pg, claim))

    # The check can fail: without the partial index the same claim is planned otherwise.
    with pg.transaction(force_rollback=True):
        pg.execute("DROP INDEX pgbroker.jobs_claim_idx")
        scans = _candidate_scans(_custom_plan(pg, claim))
        assert all(s.get("Index Name") != "jobs_claim_idx" for s in scans), scans


def test_claim_plan_on_statistics_that_see_an_empty_table(db_url: str,
                                                          pg: psycopg.Connection) -> None:
    """After a drained queue's VACUUM the statistics say ``jobs`` is empty while its pages stay,
    and a burst gets plans made for an empty table. Every scan of ``jobs`` must still go through
    an index condition: the acks' former join walked all of ``jobs_pkey`` there (22 ms per claim
    with 10,000 running rows, against 0.6 ms)."""
    # the state under test must not be fixed by an ANALYZE behind the test's back
    pg.execute("ALTER TABLE pgbroker.jobs_live SET (autovacuum_enabled = false)")
    fill(db_url, SAMPLE, "celery", "pending", 50_000)
    pg.execute("DELETE FROM pgbroker.jobs")
    pg.execute("VACUUM (TRUNCATE false) pgbroker.jobs")
    fill(db_url, SAMPLE, "celery", "pending", 3_000)
    fill(db_url, SAMPLE, "other", "pending", 10_000)
    pg.execute("UPDATE pgbroker.jobs SET state = 'running', attempts = 1, "
               "locked_by = gen_random_uuid() WHERE queue = 'other'")
    assert pg.execute("SELECT reltuples FROM pg_class "
                      "WHERE oid = 'pgbroker.jobs_live'::regclass").fetchone()[0] <= 0

    claim = queries("pgbroker")["job_claim"]
    for plan in (_custom_plan(pg, claim), _generic_plan(pg, claim)):
        scans = [n for n in _nodes(plan) if n.get("Relation Name") == "jobs_live"]
        assert scans
        for scan in scans:
            assert scan["Node Type"] != "Seq Scan", scan
            if scan["Node Type"] in ("Index Scan", "Index Only Scan"):
                assert "Index Cond" in scan, f"a whole index walked: {scan}"


def test_the_claim_reads_none_of_a_paused_tasks_backlog(db_url: str,
                                                         pg: psycopg.Connection) -> None:
    """A paused task name's backlog at the head of the queue (100,000 jobs, claimed first were
    it not paused) is not read by the claim: its rows wait outside the part of jobs_claim_idx the
    claim walks (0011_task_pause_index.sql), instead of being read and filtered out by every
    claim for as long as the pause lasts (30 ms a claim instead of 0.9 ms:
    tests/bench/test_paused_backlog_bench.py)."""
    paused = {**SAMPLE, "task": "bench.paused", "headers": {"task": "bench.paused"}}
    fill(db_url, SAMPLE, "celery", "completed", 200_000)
    fill(db_url, paused, "celery", "pending", 100_000)
    fill(db_url, SAMPLE, "celery", "pending", BACKLOG)
    pg.execute("UPDATE pgbroker.jobs SET priority = 9 WHERE task = 'bench.paused'")  # the head
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert Operations(conn, actor="test", via="test").pause_task("bench.paused")
    pg.execute("VACUUM ANALYZE pgbroker.jobs")

    claim = queries("pgbroker")["job_claim"]
    with pg.transaction(force_rollback=True):
        plan = pg.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + claim,
                          _params()).fetchone()[0][0]["Plan"]
    [scan] = _candidate_scans(plan)
    assert (scan["Actual Rows"], scan.get("Rows Removed by Filter", 0)) == (10, 0), scan
    for plan in (_custom_plan(pg, claim), _generic_plan(pg, claim)):
        _assert_uses_claim_index(plan)
        assert all("task_paused" in s["Index Cond"] for s in _candidate_scans(plan))


def test_the_claim_stays_an_index_walk_with_a_task_paused(db_url: str,
                                                          pg: psycopg.Connection) -> None:
    """The paused-task filter must not turn the claim into a bitmap scan and a sort of the
    backlog (as a NOT EXISTS per row, or a filter on task's own statistics, did)."""
    fill(db_url, SAMPLE, "celery", "completed", 200_000)
    fill(db_url, SAMPLE, "celery", "pending", BACKLOG)
    pg.execute("INSERT INTO pgbroker.task_pauses (task, paused_by, reason) "
               "VALUES ('bench.other', 'test', 'test')")
    pg.execute("ANALYZE pgbroker.jobs")
    claim = queries("pgbroker")["job_claim"]
    _assert_uses_claim_index(_custom_plan(pg, claim))
    _assert_uses_claim_index(_generic_plan(pg, claim))
