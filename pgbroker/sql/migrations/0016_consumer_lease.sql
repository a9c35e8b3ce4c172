-- 0016 each consumer's lease is stored with it (issue 27, item 4).
--
-- lease_timeout was read from the settings of whoever judged a consumer (the sweeper in another
-- worker, `pgbroker sweep`, health, metrics, the admin page): a worker configured with 20 s
-- declared one configured with 60 s lost after 20 s of quiet, and redelivered its running jobs
-- while it lived. consumer_register now writes the worker's own lease (seconds) into its row,
-- and every judge reads coalesce(lease_timeout, <its own setting>): a row registered by an older
-- pgbroker has none and is judged as before, until that worker registers again.
--
-- Operational caveat: ADD COLUMN without a default changes only the catalog, but waits for an
-- ACCESS EXCLUSIVE lock on consumers (a small table, locked briefly by heartbeats); the CHECK
-- reads its few rows under that lock.

ALTER TABLE {schema}.consumers
    ADD COLUMN IF NOT EXISTS lease_timeout double precision
    CHECK (lease_timeout > 0);
