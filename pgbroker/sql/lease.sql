-- The consumer lease's own statements (pgbroker/_consume/lease.py). Loaded with queries.sql.

-- name: consumer_lock_try
-- The consumer's session advisory lock, taken before its row is written: a sweeper that sees
-- the row but not the lock knows its connection died (job_rescue). Never waits: a key another
-- session holds returns false and the lease tries another.
SELECT pg_try_advisory_lock(%(class)s, %(key)s);

-- name: consumer_unlock
-- A closing lease lets its lock go: the connection it was taken on is shared and stays open.
SELECT pg_advisory_unlock(%(class)s, %(key)s);
