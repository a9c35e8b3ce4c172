-- The admin page's statements (pgbroker/admin/): its charts, workers, jobs browser, bulk actions
-- and sessions, and the rollup the sweeper runs for the charts (migration 0006). {schema} is the
-- quoted schema name; every value is a bound parameter. The admin page's connections never
-- prepare statements, so each is planned with its values: a state given as a parameter still
-- picks that state's partial index.

-- ---------------------------------------------------------------------------------------------
-- Statistics (stats_* tables of migration 0006)
-- ---------------------------------------------------------------------------------------------

-- name: stats_rollup
-- Roll the minutes that closed since the last rollup (at most %(minutes)s of them) up into
-- stats_finished, sample the backlog into stats_depth once a minute, and drop what is older than
-- 7 days. Run by the sweeper of every worker: the state row is taken with SKIP LOCKED, so one
-- sweeper does it and the others pass; and only when something is due, so a sweep with nothing
-- to do writes nothing (not even a row lock). A minute is closed %(lag)s seconds after its end:
-- a row is stamped with its transaction's start, and a finishing statement is one short
-- transaction (metrics_clock has the same rule). A first rollup starts %(backfill)s seconds ago.
WITH state AS MATERIALIZED (
    SELECT s.finished_upto, s.depth_minute,
           date_trunc('minute', now() - make_interval(secs => %(lag)s)) AS closed,
           date_trunc('minute', now()) AS this_minute
    FROM {schema}.stats_rollup AS s
    WHERE s.finished_upto IS NULL
       OR s.finished_upto < date_trunc('minute', now() - make_interval(secs => %(lag)s))
       OR s.depth_minute IS DISTINCT FROM date_trunc('minute', now())
    LIMIT 1  -- there is one row; and the planner then knows it
    FOR UPDATE SKIP LOCKED
), start AS (
    SELECT coalesce(st.finished_upto,
                    date_trunc('minute', now() - make_interval(secs => %(backfill)s))) AS at
    FROM state AS st
), span AS (
    -- from the first minute that has a finished row (empty minutes are skipped, so a long quiet
    -- spell or a first rollup costs one index probe per index), for %(minutes)s minutes
    SELECT f.since, least(st.closed, f.since + make_interval(mins => %(minutes)s)) AS until
    FROM state AS st, start, LATERAL (
        SELECT least(st.closed, greatest(start.at, date_trunc('minute', least(
            (SELECT min(j.updated_at) FROM {schema}.jobs AS j
             WHERE j.state IN ('completed', 'cancelled', 'expired') AND j.updated_at >= start.at),
            (SELECT min(j.updated_at) FROM {schema}.jobs AS j
             WHERE j.state = 'dead' AND j.updated_at >= start.at))))) AS since
    ) AS f
), rolled AS (
    INSERT INTO {schema}.stats_finished AS t (minute, queue, task, succeeded, retried, failed,
                                              cancelled, expired, run_ms, wait_ms)
    SELECT b.* FROM span,
           LATERAL {schema}.stats_finished_between(span.since, span.until) AS b
    WHERE span.until > span.since
    -- a minute is rolled up once; a conflict is a rollup whose state row was reset by hand
    ON CONFLICT (minute, queue, task) DO NOTHING
    RETURNING 1
), depth AS (
    -- one branch per state with the state as a constant: each reads its partial index only
    INSERT INTO {schema}.stats_depth (minute, queue, task, pending, scheduled, running,
                                      oldest_pending)
    SELECT st.this_minute, d.queue, d.task, sum(d.pending), sum(d.scheduled), sum(d.running),
           max(d.oldest)
    FROM state AS st, LATERAL (
        SELECT queue, coalesce(task, '') AS task, count(*) AS pending, 0 AS scheduled,
               0 AS running, extract(epoch FROM now() - min(run_at))::float8 AS oldest
        FROM {schema}.jobs WHERE state = 'pending' GROUP BY 1, 2
        UNION ALL
        SELECT queue, coalesce(task, ''), 0, count(*), 0, NULL
        FROM {schema}.jobs WHERE state = 'scheduled' GROUP BY 1, 2
        UNION ALL
        SELECT queue, coalesce(task, ''), 0, 0, count(*), NULL
        FROM {schema}.jobs WHERE state = 'running' GROUP BY 1, 2
    ) AS d
    WHERE st.depth_minute IS DISTINCT FROM st.this_minute
    GROUP BY st.this_minute, d.queue, d.task
    ON CONFLICT (minute, queue, task) DO NOTHING
    RETURNING 1
), advanced AS (
    UPDATE {schema}.stats_rollup AS s
    SET finished_upto = greatest(span.until, coalesce(s.finished_upto, span.until)),
        depth_minute = st.this_minute
    FROM state AS st, span
    WHERE s.id
    RETURNING 1
), pruned_finished AS (
    -- a range of the primary key (minute first); once a minute at most, like the rest
    DELETE FROM {schema}.stats_finished
    WHERE minute < now() - interval '7 days' AND EXISTS (SELECT 1 FROM state)
    RETURNING 1
), pruned_depth AS (
    DELETE FROM {schema}.stats_depth
    WHERE minute < now() - interval '7 days' AND EXISTS (SELECT 1 FROM state)
    RETURNING 1
)
SELECT (SELECT count(*) FROM rolled), (SELECT count(*) FROM depth),
       (SELECT count(*) FROM advanced),
       (SELECT count(*) FROM pruned_finished) + (SELECT count(*) FROM pruned_depth);

-- name: stats_rollup_due
-- Whether stats_rollup has anything to do: a one-row read that every sweep can afford (the
-- rollup itself takes milliseconds to plan).
SELECT EXISTS (
    SELECT 1 FROM {schema}.stats_rollup AS s
    WHERE s.finished_upto IS NULL
       OR s.finished_upto < date_trunc('minute', now() - make_interval(secs => %(lag)s))
       OR s.depth_minute IS DISTINCT FROM date_trunc('minute', now()));

-- name: stats_upto
-- Where the rollup is, and the database clock.
SELECT finished_upto, now() FROM {schema}.stats_rollup;

-- name: stats_finished_read
-- Finished jobs in [%(since)s, %(until)s) per step of %(step)s seconds, queue and task, from the
-- rolled-up minutes; each histogram summed bucket by bucket.
WITH picked AS (
    SELECT date_bin(make_interval(secs => %(step)s), f.minute, %(origin)s) AS t, f.*
    FROM {schema}.stats_finished AS f
    WHERE f.minute >= %(since)s AND f.minute < %(until)s
      AND (%(queue)s::text IS NULL OR f.queue = %(queue)s)
      AND (%(task)s::text IS NULL OR f.task = %(task)s)
)
SELECT p.t, p.queue, p.task, sum(p.succeeded), sum(p.retried), sum(p.failed), sum(p.cancelled),
       sum(p.expired),
       (SELECT coalesce(jsonb_object_agg(k, n), '{}') FROM (
            SELECT e.key AS k, sum(e.value::bigint) AS n
            FROM unnest(array_agg(p.run_ms)) AS h(ms), jsonb_each_text(h.ms) AS e
            GROUP BY e.key) AS s),
       (SELECT coalesce(jsonb_object_agg(k, n), '{}') FROM (
            SELECT e.key AS k, sum(e.value::bigint) AS n
            FROM unnest(array_agg(p.wait_ms)) AS h(ms), jsonb_each_text(h.ms) AS e
            GROUP BY e.key) AS s)
FROM picked AS p
GROUP BY p.t, p.queue, p.task;

-- name: stats_finished_live
-- The minutes not rolled up yet, read from jobs itself (normally the last minute or two).
SELECT minute, queue, task, succeeded, retried, failed, cancelled, expired, run_ms, wait_ms
FROM {schema}.stats_finished_between(%(since)s, %(until)s)
WHERE (%(queue)s::text IS NULL OR queue = %(queue)s)
  AND (%(task)s::text IS NULL OR task = %(task)s);

-- name: stats_depth_read
-- The backlog per step: the largest of the step's once-a-minute samples (summed over the
-- queues and tasks asked for).
SELECT date_bin(make_interval(secs => %(step)s), m.minute, %(origin)s) AS t,
       max(m.pending), max(m.scheduled), max(m.running), max(m.oldest)
FROM (SELECT d.minute, sum(d.pending) AS pending, sum(d.scheduled) AS scheduled,
             sum(d.running) AS running, max(d.oldest_pending) AS oldest
      FROM {schema}.stats_depth AS d
      WHERE d.minute >= %(since)s AND d.minute < %(until)s
        AND (%(queue)s::text IS NULL OR d.queue = %(queue)s)
        AND (%(task)s::text IS NULL OR d.task = %(task)s)
      GROUP BY d.minute) AS m
GROUP BY 1;

-- name: stats_tasks
-- Task names seen lately, for the filters' suggestions (the small table, not jobs).
SELECT DISTINCT queue, task FROM {schema}.stats_finished
WHERE minute > now() - interval '1 day' AND task <> ''
UNION
SELECT DISTINCT queue, task FROM {schema}.stats_depth
WHERE minute > now() - interval '1 hour' AND task <> ''
ORDER BY 1, 2;

-- ---------------------------------------------------------------------------------------------
-- Workers
-- ---------------------------------------------------------------------------------------------

-- name: consumer_list
-- Every registered consumer, with how long since its heartbeat (database clock), its own lease
-- (%(lease)s for a row of an older pgbroker, which has none) and how many jobs it holds
-- (jobs_running_idx, by locked_by).
SELECT c.id, c.host, c.pid, c.queues, c.started_at, c.heartbeat_at,
       extract(epoch FROM now() - c.heartbeat_at)::float8 AS heartbeat_age,
       coalesce(c.lease_timeout, %(lease)s::float8) AS lease_timeout,
       (SELECT count(*) FROM {schema}.jobs AS j
        WHERE j.state = 'running' AND j.locked_by = c.id) AS running
FROM {schema}.consumers AS c
ORDER BY c.host, c.pid, c.started_at;

-- name: consumer_running
-- What is running now, longest first, and whose it is (owned: its consumer is registered; an
-- unowned one is the sweeper's to redeliver).
SELECT j.id, j.queue, j.task, j.task_id, j.locked_by, j.locked_at, j.attempts, j.max_attempts,
       j.revoked_at, extract(epoch FROM now() - j.locked_at)::float8 AS age,
       left(j.headers ->> 'argsrepr', 200) AS args,
       EXISTS (SELECT 1 FROM {schema}.consumers AS c WHERE c.id = j.locked_by) AS owned
FROM {schema}.jobs AS j
WHERE j.state = 'running'
ORDER BY j.locked_at
LIMIT %(limit)s;

-- name: queue_paused_list
-- Paused queues with who paused them last, and when (the audit log).
SELECT q.name, a.actor, a.at
FROM {schema}.queues AS q
LEFT JOIN LATERAL (SELECT actor, at FROM {schema}.audit
                   WHERE target = q.name AND action = 'queue.pause'
                   ORDER BY at DESC LIMIT 1) AS a ON true
WHERE q.paused
ORDER BY q.name;

-- ---------------------------------------------------------------------------------------------
-- Jobs browser. The filter of every statement below (pgbroker.ops.JobFilter): queue, task,
-- created in [id_from, id_to) -- ids are UUIDv7, so an id range is a creation-time range and a
-- range scan of the primary key --, and a text that the raw body contains (bytes, exact) or that
-- Celery's argsrepr/kwargsrepr headers contain (any case).
-- ---------------------------------------------------------------------------------------------

-- name: job_browse_state
-- One state that stays small (pending, scheduled, running, dead): its partial index, all of it.
SELECT j.id, j.queue, j.task, j.state, j.attempts, j.max_attempts, j.retries, j.run_at,
       j.created_at, j.updated_at, j.last_error, left(j.headers ->> 'argsrepr', 200) AS args,
       left(j.headers ->> 'kwargsrepr', 200) AS kwargs
FROM {schema}.jobs AS j
WHERE j.state = %(state)s
  AND (%(queue)s::text IS NULL OR j.queue = %(queue)s)
  AND (%(task)s::text IS NULL OR j.task = %(task)s)
  AND j.id >= %(id_from)s AND j.id < %(id_to)s
  AND (%(text)s::text IS NULL OR position(%(text_bytes)s::bytea IN j.body) > 0
       OR j.headers ->> 'argsrepr' ILIKE %(text_like)s
       OR j.headers ->> 'kwargsrepr' ILIKE %(text_like)s)
ORDER BY j.id DESC
LIMIT %(limit)s;

-- name: job_browse_window
-- Any state, within a window of ids found by job_window: a range scan of the primary key, so a
-- filter that matches nothing costs the window, never the table.
SELECT j.id, j.queue, j.task, j.state, j.attempts, j.max_attempts, j.retries, j.run_at,
       j.created_at, j.updated_at, j.last_error, left(j.headers ->> 'argsrepr', 200) AS args,
       left(j.headers ->> 'kwargsrepr', 200) AS kwargs
FROM {schema}.jobs AS j
WHERE j.id >= %(id_from)s AND j.id < %(id_to)s
  AND (%(state)s::text IS NULL OR j.state = %(state)s)
  AND (%(queue)s::text IS NULL OR j.queue = %(queue)s)
  AND (%(task)s::text IS NULL OR j.task = %(task)s)
  AND (%(text)s::text IS NULL OR position(%(text_bytes)s::bytea IN j.body) > 0
       OR j.headers ->> 'argsrepr' ILIKE %(text_like)s
       OR j.headers ->> 'kwargsrepr' ILIKE %(text_like)s)
ORDER BY j.id DESC
LIMIT %(limit)s;

-- name: job_window
-- The lowest id among the newest %(scan)s jobs in [id_from, id_to) (NULL: none), and how many:
-- an index-only scan of the primary key.
WITH w AS (
    SELECT id FROM {schema}.jobs
    WHERE id >= %(id_from)s AND id < %(id_to)s
    ORDER BY id DESC LIMIT %(scan)s
)
SELECT (SELECT id FROM w ORDER BY id LIMIT 1), (SELECT count(*) FROM w);

-- name: job_count_matching
-- How many jobs of one small state match the filter (what a bulk action would act on): that
-- state's partial index.
SELECT count(*)
FROM {schema}.jobs AS j
WHERE j.state = %(state)s
  AND (%(queue)s::text IS NULL OR j.queue = %(queue)s)
  AND (%(task)s::text IS NULL OR j.task = %(task)s)
  AND j.id >= %(id_from)s AND j.id < %(id_to)s
  AND (%(text)s::text IS NULL OR position(%(text_bytes)s::bytea IN j.body) > 0
       OR j.headers ->> 'argsrepr' ILIKE %(text_like)s
       OR j.headers ->> 'kwargsrepr' ILIKE %(text_like)s);

-- name: job_cancel_matching
-- One batch of a bulk cancel: pending and scheduled jobs that match the filter and were created
-- before the operator confirmed (a producer publishing meanwhile cannot keep it going). Each
-- cancelled job gets its audit row, pointing at the bulk action's own row.
WITH picked AS MATERIALIZED (
    -- the two states as an OR of constants: a BitmapOr of their partial indexes (an IN list
    -- or = ANY would read the table)
    SELECT j.id FROM {schema}.jobs AS j
    WHERE (j.state = 'pending' OR j.state = 'scheduled')
      AND (%(queue)s::text IS NULL OR j.queue = %(queue)s)
      AND (%(task)s::text IS NULL OR j.task = %(task)s)
      AND j.id >= %(id_from)s AND j.id < %(id_to)s AND j.created_at <= %(before)s
      AND (%(text)s::text IS NULL OR position(%(text_bytes)s::bytea IN j.body) > 0
           OR j.headers ->> 'argsrepr' ILIKE %(text_like)s
           OR j.headers ->> 'kwargsrepr' ILIKE %(text_like)s)
    LIMIT %(limit)s FOR UPDATE SKIP LOCKED
), cancelled AS (
    UPDATE {schema}.jobs AS j
    SET state = 'cancelled', last_error = 'cancelled by ' || %(actor)s::text, updated_at = now()
    WHERE j.id IN (SELECT id FROM picked) AND j.state IN ('pending', 'scheduled')
    RETURNING j.id, j.queue, j.task, j.run_at
), audited AS (
    INSERT INTO {schema}.audit (actor, action, target, detail)
    SELECT %(actor)s, 'job.cancel', c.id::text,
           jsonb_build_object('via', %(via)s::text, 'queue', c.queue, 'task', c.task,
                              'run_at', c.run_at, 'bulk', %(bulk)s::bigint)
    FROM cancelled AS c
    RETURNING 1
)
SELECT (SELECT count(*) FROM cancelled), (SELECT count(*) FROM audited);

-- name: audit_bulk_done
-- The bulk action's own audit row: how many jobs it changed, counted batch by batch.
UPDATE {schema}.audit
SET detail = jsonb_set(detail, '{done}', to_jsonb(coalesce((detail ->> 'done')::bigint, 0)
                                                  + %(done)s::bigint))
WHERE id = %(id)s
RETURNING id;

-- ---------------------------------------------------------------------------------------------
-- A job's page
-- ---------------------------------------------------------------------------------------------

-- name: job_page
-- One job for its page: headers, properties and body cut at %(limit)s characters (bytes for
-- the body) with their full sizes, so a job with 10 MB of headers costs a page, not 10 MB.
SELECT j.id, j.queue, j.task, j.task_id, j.retries, j.state, j.priority, j.attempts,
       j.max_attempts, j.run_at, j.expires_at, j.locked_at, j.locked_by, j.revoked_at,
       j.last_error,
       j.last_traceback, j.idempotency_key, j.created_at, j.updated_at, j.exchange,
       j.routing_key, j.content_type, j.content_encoding,
       left(h.text, %(limit)s) AS headers, length(h.text) AS headers_size,
       left(p.text, %(limit)s) AS properties, length(p.text) AS properties_size,
       substring(j.body FROM 1 FOR %(limit)s) AS body, octet_length(j.body) AS body_size
FROM {schema}.jobs AS j
CROSS JOIN LATERAL (SELECT j.headers::text AS text) AS h
CROSS JOIN LATERAL (SELECT j.properties::text AS text) AS p
WHERE j.id = %(id)s;

-- name: job_raw
-- The whole of one part of a job, for download.
SELECT CASE %(part)s::text WHEN 'headers' THEN convert_to(j.headers::text, 'UTF8')
                           WHEN 'properties' THEN convert_to(j.properties::text, 'UTF8')
                           ELSE j.body END
FROM {schema}.jobs AS j WHERE j.id = %(id)s;

-- name: job_history
-- Every row of one Celery task id: each retry (self.retry(), autoretry) is a new row with
-- retries + 1, a replace() one with the same retries; jobs_message_idx (task_id first). Also
-- read by `pgbroker jobs show` (pgbroker.ops.Operations.chain).
SELECT id, queue, state, retries, attempts, max_attempts, created_at, run_at, locked_at,
       updated_at, last_error, revoked_at,
       -- retried: this try sent a Celery retry and was acked 'completed' (retried_attempt,
       -- pgbroker._celery.endings); a row acked before migration 0018 tells it by its next try
       state = 'completed'
       AND (coalesce(retried_attempt = attempts, false)
            OR coalesce(lead(retries) OVER (ORDER BY retries, id) > retries, false)) AS retried
FROM {schema}.jobs
WHERE task_id = %(task_id)s
ORDER BY retries, id
LIMIT 200;

-- name: audit_of_targets
SELECT id, at, actor, action, target, detail FROM {schema}.audit
WHERE target = ANY(%(targets)s::text[])
ORDER BY at DESC, id DESC
LIMIT %(limit)s;

-- name: result_of_task
-- The Celery result stored by pgbroker's backend, if this database holds it.
SELECT status, date_done, left(traceback, 20000) AS traceback
FROM {schema}.results WHERE task_id = %(task_id)s;

-- ---------------------------------------------------------------------------------------------
-- Sessions (pgbroker.admin.auth): the cookie holds a random id, the row its SHA-256.
-- ---------------------------------------------------------------------------------------------

-- name: admin_connection_setup
-- Each pooled connection of the admin page, once: UTC, as every pgbroker connection
-- (pgbroker._pg.driver.connect); and no JIT -- its reads are short, over partial indexes, and JIT
-- compiling (its cost model counts rows the indexes never read) took longer than the queries.
SELECT set_config('TimeZone', 'UTC', false), set_config('jit', 'off', false);

-- name: admin_now
-- The database clock, which every admin page shows its times in.
SELECT now();

-- name: admin_session_insert
WITH pruned AS (
    DELETE FROM {schema}.admin_sessions WHERE expires_at < now()
)
INSERT INTO {schema}.admin_sessions (id, actor, role, csrf, address, expires_at)
VALUES (%(id)s, %(actor)s, %(role)s, %(csrf)s, %(address)s,
        now() + make_interval(secs => least(%(idle)s, %(lifetime)s)));

-- name: admin_session_get
-- A live session, renewed for %(idle)s more seconds (never past %(lifetime)s after its login) --
-- written at most once a minute, not at every request and live update.
WITH touched AS (
    UPDATE {schema}.admin_sessions
    SET seen_at = now(),
        expires_at = least(created_at + make_interval(secs => %(lifetime)s),
                           now() + make_interval(secs => %(idle)s))
    WHERE id = %(id)s AND expires_at > now() AND seen_at < now() - interval '1 minute'
    RETURNING actor, role, csrf
)
SELECT actor, role, csrf FROM touched
UNION ALL
SELECT actor, role, csrf FROM {schema}.admin_sessions
WHERE id = %(id)s AND expires_at > now() AND NOT EXISTS (SELECT 1 FROM touched);

-- name: admin_session_delete
DELETE FROM {schema}.admin_sessions WHERE id = %(id)s RETURNING actor;
