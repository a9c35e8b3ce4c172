-- 0015 vacuum settings: autovacuum settings of the hot tables, chosen for a queue's churn.
--
-- Every claim and ack leaves a dead row version in jobs (both are non-HOT updates: state is
-- indexed), and its entry stays at the head of jobs_claim_idx, which every claim walks, until
-- VACUUM removes it; the small tables are rewritten all the time too (a heartbeat every 5 s per
-- consumer, the queue rows each heartbeat and declaration touches, a rate limit's starts at
-- every claim of its task, concurrency keys at every claim and ack of a keyed job, task losses,
-- broadcasts). PostgreSQL's defaults vacuum a table once 50 + 20 % of its rows are dead: for a
-- table of 20 rows that is 54 dead versions, but for jobs holding a day of finished rows
-- (retention) it is millions. The anchors do the same in their own ways: PgQueuer's
-- `pgq autovac` tunes its queue tables' autovacuum, River and Que VACUUM after their sweeps.
-- Why each value is what it is (docs/operations.md, "Vacuum", has the same table):
--
-- jobs
--   autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 1000: a vacuum after
--     1,000 + 1 % of its rows are dead (0001 had 2 %). With a day of retention, a vacuum comes
--     every ~7 minutes whatever the rate (1 % of a day's rows, at 2 dead versions a task), and
--     the claim never walks more than ~1 % of the table in dead entries; the 1,000 keeps a
--     nearly empty table from being vacuumed at every nap. Lower costs a full pass over every
--     index of the table each time, for little.
--   autovacuum_vacuum_insert_scale_factor = 0.01: inserts alone (a backlog of scheduled jobs)
--     also start a vacuum after 1 % of the table, which sets the visibility map (the metrics'
--     counts are index-only scans) and freezes in small steps instead of one anti-wraparound
--     pass over millions of rows.
--   autovacuum_vacuum_cost_limit = 2000 (10x the default 200, the delay left at its 2 ms): the
--     queue's vacuum is the one whose slowness costs every claim; throttled at the default it
--     can still be at work when the next one is due.
-- consumers, queues, concurrency_keys, rate_limits, task_losses, broadcasts
--   autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 200: tables of tens of
--     rows updated every few seconds; a vacuum every 200 dead versions whatever their size
--     (autovacuum_naptime, 1 min, bounds how often), which keeps them a few pages long. A
--     percentage of a table of ten rows means nothing.
--   autovacuum_vacuum_cost_delay = 0: a few pages; sleeping between them only keeps the dead
--     versions longer.
-- autovacuum_analyze_* are left as they are (0001's 2 % for jobs): the statistics of these
-- tables do not drift with their churn.
--
-- None of this helps while the horizon is held (a long transaction, a snapshot, a replication
-- slot): VACUUM then removes nothing that died since. pgbroker shows who holds it (pgbroker
-- stats, health vacuum, /metrics, the admin page) and a worker warns (xmin_warn_after). When
-- autovacuum is off, the sweeper vacuums these tables itself on the same thresholds.
--
-- Operational caveats: ALTER TABLE ... SET (autovacuum_*) takes a SHARE UPDATE EXCLUSIVE lock
-- on each table until the migration commits: reads, claims, acks and inserts go on (their locks
-- do not conflict with it); it waits for a VACUUM or ANALYZE of the table running then (an
-- autovacuum gives way to it after deadlock_timeout, one preventing wraparound does not).
-- Nothing is rewritten.

ALTER TABLE {schema}.jobs SET (autovacuum_vacuum_scale_factor = 0.01,
                               autovacuum_vacuum_threshold = 1000,
                               autovacuum_vacuum_insert_scale_factor = 0.01,
                               autovacuum_vacuum_cost_limit = 2000);

-- The small hot tables, each the same way.
DO $$
DECLARE
    hot text;
BEGIN
    FOREACH hot IN ARRAY ARRAY['consumers', 'queues', 'concurrency_keys', 'rate_limits',
                               'task_losses', 'broadcasts'] LOOP
        EXECUTE format('ALTER TABLE {schema}.%I SET (autovacuum_vacuum_scale_factor = 0, '
                       'autovacuum_vacuum_threshold = 200, autovacuum_vacuum_cost_delay = 0)',
                       hot);
    END LOOP;
END
$$;
