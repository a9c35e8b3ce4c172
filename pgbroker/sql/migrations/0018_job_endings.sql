-- 0018 job endings: the record says what happened (issue 27, item 7).
--
-- Two facts only the worker sees, written into the delivery's row before (or just after) its
-- ack, each matched by (id, attempt) as failed_attempt is (pgbroker/_celery/endings.py, sql/endings.sql):
--
-- cancelled_attempt: Celery carried out a revoke on this attempt (its task_revoked signal): it
--   discarded the delivery before the task started, or terminated the pool process running it.
--   Only then does a revoked job end 'cancelled' at its ack. A revoke that arrived while the task
--   ran and that the pool could not carry out (threads, solo and gevent pools cannot terminate;
--   a revoke without terminate never stops a running task) leaves the job as its task ended it
--   -- 'completed', or 'dead' -- with revoked_at and its last_error saying a revoke came. Before
--   0018, revoked_at alone made every such job 'cancelled', though its task had run to the end.
-- retried_attempt: the task of this attempt sent a Celery retry (self.retry(), autoretry_for;
--   its task_retry signal, in the process that ran it, before the ack). Its row ends
--   'completed' -- Celery acks it -- and the next try is a new row of the same task id with
--   retries + 1; counts (pgbroker stats, /metrics, the admin page) count it as retried, and
--   `pgbroker jobs show` and the job page show the chain. No new state: the finished rows'
--   partial index (jobs_finished_idx) and the retention's prune keep reading 'completed'.
--
-- Operational caveats: adds two nullable columns without a default, which PostgreSQL does as a
-- catalog change (no table rewrite), but under a brief ACCESS EXCLUSIVE lock on `jobs`: the
-- migration waits for the transactions using `jobs` to finish, and claims and publishes wait
-- behind it for that moment. No index. Deploy order: workers of an older pgbroker keep ending
-- every revoked job 'cancelled' (they read revoked_at) and write neither column; mixed with
-- newer ones, a revoked job may end either way until every worker is upgraded.

ALTER TABLE {schema}.jobs
    ADD COLUMN cancelled_attempt integer,  -- the attempt Celery discarded or terminated (revoke)
    ADD COLUMN retried_attempt integer;    -- the attempt whose task sent a Celery retry
