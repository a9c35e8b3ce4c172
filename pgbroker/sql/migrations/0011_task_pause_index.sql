-- 0011 task pause out of the claim's way: a paused task's waiting jobs leave the claim's walk.
--
-- Until now a paused task name's pending jobs stayed where the claim walks (jobs_claim_idx) and
-- job_claim passed them one by one with a filter: behind 100,000 of them at the head of a queue,
-- every claim of that queue read them all (0.9 ms -> 30 ms a claim; tests/bench/
-- test_paused_backlog_bench.py), for as long as the pause lasted.
--
-- 1. jobs.task_paused: this waiting job's task name is paused. Set on the task's pending and
--    scheduled jobs by the statement that pauses it (task_set_paused, task_loss_record) and on
--    the jobs inserted while it is paused (job_insert, job_insert_many, job_insert_routed);
--    cleared by the resume (task_set_paused), and by the sweeper's promotion for a task that is
--    no longer paused (a job inserted by a transaction that began before a resume).
--    The job's state stays 'pending' (or 'scheduled'): every reader of states (stats, metrics,
--    admin, `celery inspect scheduled`, dedupe slots, purge, revoke) sees it as before.
-- 2. jobs_claim_idx leads with (queue, task_paused): the claim reads `queue = $1 AND NOT
--    task_paused` as the index's first two columns and walks the rest in order, so a paused
--    backlog is never read; a reader of a queue's pending rows still has the index.
-- 3. jobs_task_paused_idx: the marked jobs by task name, for the resume and the sweeper.
-- 4. The insert now reads task_pauses: every role that may insert jobs gets SELECT on it
--    (roles.sql.example's producer role, set up before this migration).
--
-- Operational caveats: ADD COLUMN with a constant default changes only the catalog, but waits for
-- an ACCESS EXCLUSIVE lock on jobs (behind any long transaction reading it). jobs_claim_idx is
-- rebuilt in this transaction: claims and inserts wait while it is built (a scan of the table,
-- about a second per million rows; the index itself holds the pending rows only).

ALTER TABLE {schema}.jobs ADD COLUMN IF NOT EXISTS task_paused boolean NOT NULL DEFAULT false;

-- the jobs of the task names paused now
UPDATE {schema}.jobs SET task_paused = true
WHERE state IN ('pending', 'scheduled') AND task IN (SELECT tp.task FROM {schema}.task_pauses AS tp);

DROP INDEX IF EXISTS {schema}.jobs_claim_idx;
CREATE INDEX jobs_claim_idx ON {schema}.jobs (queue, task_paused, priority DESC, run_at, id)
    WHERE state = 'pending';

CREATE INDEX IF NOT EXISTS jobs_task_paused_idx ON {schema}.jobs (task) WHERE task_paused;

DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT DISTINCT a.grantee::regrole::text AS name
             FROM pg_class AS c, aclexplode(c.relacl) AS a
             WHERE c.oid = '{schema}.jobs'::regclass AND a.privilege_type = 'INSERT'
               AND a.grantee <> 0 AND a.grantee <> c.relowner
               AND NOT has_table_privilege(a.grantee, '{schema}.task_pauses', 'SELECT')
    LOOP
        EXECUTE format('GRANT SELECT ON {schema}.task_pauses TO %s', r.name);
    END LOOP;
END
$$;
