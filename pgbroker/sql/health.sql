-- pgbroker.health's statements: is a worker alive, is a queue served, is beat firing
-- (`pgbroker health`). Read-only; every age is by the database clock, as the sweeper counts it.

-- name: health_consumers
-- Consumers by id, host, pid or queue (a NULL parameter matches all), newest heartbeat first,
-- with what the sweeper's job_rescue tests: the heartbeat's age against the consumer's own lease
-- (%(lease)s for a row of an older pgbroker, which has none), and whether the session still
-- holds its advisory lock (a consumer whose connection died is gone at once, heartbeat or not).
-- Remote-control clients (celery inspect, status) consume nothing but their reply queue and
-- come and go in a second: they are not workers, so they are left out.
SELECT c.id, c.host, c.pid, c.queues, c.started_at,
       extract(epoch FROM now() - c.heartbeat_at)::float8 AS heartbeat_age,
       coalesce(c.lease_timeout, %(lease)s::float8) AS lease_timeout,
       c.lock_key IS NULL OR EXISTS (
           SELECT 1 FROM pg_locks AS l
           WHERE l.locktype = 'advisory' AND l.granted
             AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
             AND l.classid = %(lock_class)s::oid AND l.objid = c.lock_key::oid
             AND l.objsubid = 2) AS connected,
       -- its acks (requeues, burials) fail on a living connection since then (0017)
       extract(epoch FROM now() - c.settle_failing_since)::float8 AS settle_failing_for,
       c.settle_error
FROM {schema}.consumers AS c
WHERE (%(id)s::uuid IS NULL OR c.id = %(id)s::uuid)
  AND (%(host)s::text IS NULL OR c.host = %(host)s::text)
  AND (%(pid)s::integer IS NULL OR c.pid = %(pid)s::integer)
  AND (%(queue)s::text IS NULL OR %(queue)s::text = ANY (c.queues))
  AND EXISTS (SELECT 1 FROM unnest(c.queues) AS q(name) WHERE q.name NOT LIKE '%%.reply.%%pidbox')
ORDER BY c.heartbeat_at DESC;

-- name: health_queue
-- One queue: whether it is known (a row in queues, or jobs waiting in it), paused, and how long
-- its oldest due job has waited. The pending rows of the queue are read from jobs_claim_idx:
-- the cost is the queue's backlog, never the table.
SELECT EXISTS (SELECT 1 FROM {schema}.queues WHERE name = %(queue)s)
           OR EXISTS (SELECT 1 FROM {schema}.jobs
                      WHERE state IN ('pending', 'scheduled') AND queue = %(queue)s) AS known,
       coalesce((SELECT paused FROM {schema}.queues WHERE name = %(queue)s), false) AS paused,
       (SELECT extract(epoch FROM now() - min(run_at))::float8 FROM {schema}.jobs
        WHERE state = 'pending' AND queue = %(queue)s) AS oldest_pending_age;

-- name: health_beat
-- The entries beat fires (enabled and still configured), with their grid, since when they are
-- owed runs (created_at: nothing is owed before), their last completed run as beat_status
-- reads it (the live last job, else the stored time), and the database clock.
SELECT e.name, e.schedule, e.created_at, s.last_completed_at, e.last_job_state, now() AS now
FROM {schema}.beat_schedule AS e
JOIN {schema}.beat_status AS s ON s.entry = e.name
WHERE e.enabled AND e.removed_at IS NULL
ORDER BY e.name;

-- name: health_beat_entry
-- Whether an entry exists at all, and if so why it is not checked (disabled, removed).
SELECT enabled, removed_at IS NOT NULL AS removed FROM {schema}.beat_schedule WHERE name = %(name)s;

-- name: horizon_holders
-- What holds back VACUUM's horizon in this database (pgbroker._pg.vacuum), oldest first: VACUUM
-- removes no row version that died after the oldest of these began, in any table. Every kind
-- PostgreSQL counts (ComputeXidHorizons): sessions, prepared transactions, replication slots,
-- standbys with hot_standby_feedback. %(now)s (NULL: now()) is the clock of the ages in seconds.
WITH sessions AS (
    -- Sessions of this database with a snapshot or a transaction id, and those of any database
    -- with a transaction id: every new snapshot here (a claim's too) counts a running xid of
    -- any database as running. Not this session; not autovacuum (a VACUUM holds back no other
    -- VACUUM); not walsenders (standbys, below). Without pg_read_all_stats, the type, state,
    -- start and query of another role's session are NULL / '<insufficient privilege>': its
    -- pid, application and xids are still shown (autovacuum, which has no user, is left out).
    SELECT a.pid, a.application_name, a.datname, a.state, a.xact_start, a.query,
           a.backend_xid, a.backend_xmin
    FROM pg_stat_activity AS a
    WHERE a.pid <> pg_backend_pid() AND a.usesysid IS NOT NULL
      AND coalesce(a.backend_type, '') NOT IN ('autovacuum worker', 'walsender')
      AND (a.backend_xid IS NOT NULL
           OR (a.backend_xmin IS NOT NULL AND a.datname = current_database()))
), holders AS (
    -- a session holds the older of its xid and its snapshot's xmin
    SELECT CASE WHEN s.backend_xid IS NULL THEN 'snapshot' ELSE 'transaction' END AS kind,
           s.pid, s.application_name AS name, nullif(s.datname, current_database()) AS database,
           s.state, s.xact_start AS since,
           left(s.query, 1000) AS query,
           CASE WHEN s.backend_xmin IS NULL OR age(s.backend_xid) >= age(s.backend_xmin)
                THEN s.backend_xid ELSE s.backend_xmin END AS held
    FROM sessions AS s
    -- a statement running now whose snapshot's xmin is another session's running xid is held
    -- back by that session, not holding (every claim that runs meanwhile has one): left out.
    -- An open transaction's snapshot is kept: it still holds when that session has ended.
    WHERE s.backend_xid IS NOT NULL OR s.state IS DISTINCT FROM 'active'
       OR NOT EXISTS (SELECT 1 FROM sessions AS o WHERE o.backend_xid = s.backend_xmin)
    UNION ALL
    -- a prepared transaction holds its xid until COMMIT PREPARED / ROLLBACK PREPARED, in any
    -- database, whoever prepared it
    SELECT 'prepared transaction', NULL, p.gid, nullif(p.database, current_database()),
           'prepared by ' || p.owner, p.prepared, NULL, p.transaction
    FROM pg_prepared_xacts AS p
    UNION ALL
    -- a replication slot keeps xmin for its standby (hot_standby_feedback), active or not
    SELECT 'replication slot', r.active_pid, r.slot_name, NULL,
           CASE WHEN r.active THEN 'active' ELSE 'inactive' END, NULL, NULL, r.xmin
    FROM pg_replication_slots AS r WHERE r.xmin IS NOT NULL
    UNION ALL
    -- a logical slot's catalog_xmin holds back the system catalogs only (not pgbroker's tables)
    SELECT 'replication slot (catalogs)', r.active_pid, r.slot_name, NULL,
           CASE WHEN r.active THEN 'active' ELSE 'inactive' END, NULL, NULL, r.catalog_xmin
    FROM pg_replication_slots AS r WHERE r.catalog_xmin IS NOT NULL
    UNION ALL
    -- a standby without a slot, with hot_standby_feedback: its walsender carries its xmin
    SELECT 'standby', w.pid, w.application_name, NULL, w.state, NULL, NULL, w.backend_xmin
    FROM pg_stat_replication AS w WHERE w.backend_xmin IS NOT NULL
)
SELECT h.kind, h.pid, h.name, h.database, h.state, h.since,
       extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - h.since)::float8 AS age,
       age(h.held) AS xid_age, h.held::text AS xmin, h.query
FROM holders AS h
ORDER BY age(h.held) DESC, h.since NULLS LAST, h.pid
LIMIT %(limit)s;

-- name: hot_tables_vacuum
-- pgbroker's hot tables (%(tables)s, in that order): live and dead row versions, when they were
-- last vacuumed (by hand or by autovacuum), whether autovacuum looks after each (the server's
-- autovacuum and track_counts, and the table's autovacuum_enabled), and whether the sweeper's
-- fallback is due to vacuum it (pgbroker._pg.vacuum): not looked after, more dead versions than
-- autovacuum's own trigger would allow (the table's threshold and scale factor, migration
-- 0015, else the server's), and not vacuumed in the last %(interval)s seconds (a VACUUM cannot
-- remove what a held horizon keeps: it must not run again and again for nothing).
WITH hot AS (
    SELECT t.relname::text AS "table", t.n_live_tup AS live, t.n_dead_tup AS dead,
           t.last_vacuum, t.last_autovacuum,
           greatest(t.last_vacuum, t.last_autovacuum) AS vacuumed_at,
           c.reltuples, o.options,
           current_setting('autovacuum')::boolean AND current_setting('track_counts')::boolean
           AND coalesce((o.options ->> 'autovacuum_enabled')::boolean, true) AS autovacuum
    FROM pg_stat_user_tables AS t
    JOIN pg_class AS c ON c.oid = t.relid
    -- the table's storage parameters as a JSON object (NULL when none is set)
    CROSS JOIN LATERAL (SELECT jsonb_object_agg(option_name, option_value) AS options
                        FROM pg_options_to_table(c.reloptions)) AS o
    WHERE t.schemaname = %(schema)s AND t.relname = ANY (%(tables)s::text[])
)
SELECT h."table", h.live, h.dead, h.last_vacuum, h.last_autovacuum, h.vacuumed_at,
       h.autovacuum,
       NOT h.autovacuum
       AND h.dead > coalesce((h.options ->> 'autovacuum_vacuum_threshold')::float8,
                             current_setting('autovacuum_vacuum_threshold')::float8)
                    + coalesce((h.options ->> 'autovacuum_vacuum_scale_factor')::float8,
                               current_setting('autovacuum_vacuum_scale_factor')::float8)
                      * greatest(h.reltuples, 0)
       AND (h.vacuumed_at IS NULL
            OR h.vacuumed_at < now() - make_interval(secs => %(interval)s)) AS due
FROM hot AS h
ORDER BY array_position(%(tables)s::text[], h."table");
