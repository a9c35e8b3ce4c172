-- 0005 revoke: Celery's revoke made durable (issue 17, point 8).
--
-- `app.control.revoke(id)` / `celery control revoke ID` cancels a pending or scheduled job in the
-- database (pgbroker/_produce/revoke.py); a job already claimed (running, or prefetched in a worker's
-- memory) cannot be taken back from its worker, so it is flagged instead: `revoked_at`. Every
-- statement that ends a delivery reads the flag -- an ack, a requeue, a sweeper rescue or a
-- restore of unacked messages ends a flagged job `cancelled`, never `completed` or `pending` --
-- so a revoked job never comes back to run later.
--
-- Operational caveats: adds one nullable column without a default, which PostgreSQL does as a
-- catalog change (no table rewrite), but under a brief ACCESS EXCLUSIVE lock on `jobs`: the
-- migration waits for the transactions using `jobs` to finish, and claims and publishes wait
-- behind it for that moment. No index: a revoke finds its jobs by task id, through the unique
-- publish index, which leads with task_id.

ALTER TABLE {schema}.jobs ADD COLUMN revoked_at timestamptz;  -- when a revoke named this job
