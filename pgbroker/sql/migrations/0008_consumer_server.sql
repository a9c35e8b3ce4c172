-- 0008 consumer server (issue 20; the brief reserves number 0010 for it: load() wants 1..n, so
-- it is 0008 on this branch alone, to be renumbered after 0008 and 0009 at merge): which server
-- instance a consumer registered on.
--
-- A consumer whose session advisory lock is not held is dead -- on the server instance where it
-- took the lock. After a restart or a failover (a standby promoted), no consumer's lock is held
-- there: every worker is reconnecting, and its running jobs must not be rescued as if it were
-- dead (that turned every job in flight into a duplicate). server_started records
-- pg_postmaster_start_time() at registration; job_rescue trusts a missing lock only for the
-- consumers registered on the running instance, and judges the others by their heartbeat
-- (lease_timeout), until they register again (they do as soon as they reconnect).
--
-- Operational caveat: ADD COLUMN with a stable default changes only the catalog (existing rows
-- read the default computed now), but waits for an ACCESS EXCLUSIVE lock on consumers (a small
-- table, locked briefly by heartbeats).

ALTER TABLE {schema}.consumers
    ADD COLUMN IF NOT EXISTS server_started timestamptz NOT NULL
    DEFAULT pg_postmaster_start_time();
