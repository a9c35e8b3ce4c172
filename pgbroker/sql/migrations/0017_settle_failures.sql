-- 0017 a consumer whose acks keep failing says so in its row (issue 27, item 1).
--
-- A settling statement (ack, requeue, burial) can fail on a living connection: a full disk
-- (53100), a statement or lock timeout set on the database, a trigger. The worker keeps those
-- deliveries 'running' under itself and tries them again every second (pgbroker._consume.settle), with
-- a WARNING in its log; its heartbeat writes since when they fail and the last error here, so
-- that `pgbroker health worker`, /metrics and the admin page's workers show it. NULL: none fails.
-- (When the disk is really full the heartbeat cannot be written either: the log says it then.)
--
-- Operational caveats: ADD COLUMN without a default changes only the catalog, but waits for an
-- ACCESS EXCLUSIVE lock on consumers (a small table; heartbeats wait for it a moment).

ALTER TABLE {schema}.consumers ADD COLUMN IF NOT EXISTS settle_failing_since timestamptz,
                               ADD COLUMN IF NOT EXISTS settle_error text;
