-- 0014 the claim starts where the last one ended: its cost no longer grows with the dead row
-- versions that VACUUM is not allowed to remove.
--
-- Every claim turns a 'pending' row into 'running', and the row's old version keeps its entry
-- in jobs_claim_idx until VACUUM removes it. While any snapshot older than that claim is open on
-- the server (a report, pg_dump, a session idle in transaction, a standby's feedback) VACUUM may
-- remove none of them, nor may an index scan mark them dead: they pile up at the head of the
-- index -- the oldest run_at of the queue, where every claim began its walk. At 250 jobs/s a held
-- snapshot made each claim read tens of thousands of such entries within minutes, the claim
-- became slower than the arrivals and the backlog ran away (issue 26; docs/benchmarks.md).
--
-- 1. jobs_claim_idx is rebuilt with the priority negated, so that its whole order (-priority,
--    run_at, id) is ascending and a row comparison can start the walk anywhere:
--    `(-priority, run_at, id) > (cursor)` is an index condition, not a filter. The order is the
--    same as before (priority DESC, run_at, id): nothing claims in another order.
-- 2. The consumer keeps, per queue, the position of the last row it claimed, and its next
--    claim starts after it (pgbroker._consume.claim_policy.ClaimPolicy): the dead entries behind it are never
--    read again. A row can become pending behind that position (a transaction that committed
--    late, a higher priority, a promotion, a requeue, a rescue); the NOTIFY that says so carries
--    the lowest position it made pending, and the consumer moves its cursor back to it. Every
--    poll (poll_interval) and every wake-up without a position starts again from the head of
--    the index, so a lost notification delays a job by one poll at most, as before.
-- 3. jobs_wake_payload: the NOTIFY payload of a queue's wake-up, '<delay>,<priority>,<run_at in
--    microseconds since the epoch> <queue>' (the older '<delay> <queue>' is still read: a wake-up
--    without a position). One definition for every statement that makes rows pending.
--
-- 4. The insert reads back its job's priority for that payload: every role that may insert jobs
--    gets SELECT on jobs.priority (roles.sql.example's producer role reads a few columns only).
--
-- Operational caveats: jobs_claim_idx is rebuilt in this transaction: claims and inserts wait
-- while it is built (a scan of the table, about a second per million rows; the index itself
-- holds the pending rows only). Workers of an older pgbroker still running against the new
-- index claim correctly but sort their queue's backlog at each claim, and do not understand the
-- new wake-ups (they find new jobs at their poll_interval): deploy the workers first, then the
-- producers.

DROP INDEX IF EXISTS {schema}.jobs_claim_idx;
CREATE INDEX jobs_claim_idx ON {schema}.jobs (queue, task_paused, (-priority), run_at, id)
    WHERE state = 'pending';

-- STABLE (extract from a timestamptz is), and a single SELECT: inlined into the statements
-- that call it.
CREATE OR REPLACE FUNCTION {schema}.jobs_wake_payload(p_delay numeric, p_priority integer,
                                                      p_run_at timestamptz, p_queue text)
RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT greatest(p_delay, 0)::text || ',' || p_priority::text || ','
           || (extract(epoch FROM p_run_at) * 1000000)::bigint::text || ' ' || p_queue
$$;

DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT DISTINCT a.grantee::regrole::text AS name
             FROM pg_class AS c, aclexplode(c.relacl) AS a
             WHERE c.oid = '{schema}.jobs'::regclass AND a.privilege_type = 'INSERT'
               AND a.grantee <> 0 AND a.grantee <> c.relowner
               AND NOT has_column_privilege(a.grantee, '{schema}.jobs', 'priority', 'SELECT')
    LOOP
        EXECUTE format('GRANT SELECT (priority) ON {schema}.jobs TO %s', r.name);
    END LOOP;
END
$$;
