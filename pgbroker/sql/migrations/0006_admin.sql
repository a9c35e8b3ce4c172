-- 0006 admin: per-minute statistics for the admin page's charts, and its server-side sessions.
--
-- Charts over the last hour (or week) must not read the jobs table at each refresh: at 1,000
-- jobs/s an hour is 3.6 M rows, and finished rows are pruned after the retention anyway. So the
-- sweeper (every worker's, or `pgbroker sweep`) rolls the rows that finished in each closed minute
-- up into stats_finished once, and samples the backlog into stats_depth once a minute
-- (`stats_rollup` in sql/admin.sql). Both are kept 7 days.
--
-- No index is added to jobs: every index there is written by each insert, claim and ack (a claim
-- changes `state`, which partial indexes depend on, so its update is never HOT). The rollup reads
-- what exists: jobs_finished_idx (updated_at) and jobs_dead_idx for the minute's rows,
-- jobs_task_delivery_idx to tell a Celery retry, the partial indexes of each state for the depth.
--
-- Operational caveats: creates new tables and functions only; no lock on jobs. The function
-- stats_finished_between reads jobs (state, updated_at, locked_at, run_at, queue, task, task_id,
-- retries): a later migration that changes those columns must recreate it.

-- One row per closed minute, queue and task that finished something.
CREATE TABLE {schema}.stats_finished (
    minute     timestamptz NOT NULL,                -- by updated_at, the finishing statement's
    queue      text        NOT NULL,
    task       text        NOT NULL DEFAULT '',     -- '' for plain kombu messages
    succeeded  integer     NOT NULL DEFAULT 0,      -- completed
    retried    integer     NOT NULL DEFAULT 0,      -- completed by a Celery retry: the next try
                                                    -- is a new row with retries + 1
    failed     integer     NOT NULL DEFAULT 0,      -- dead
    cancelled  integer     NOT NULL DEFAULT 0,
    expired    integer     NOT NULL DEFAULT 0,
    -- histograms {bucket: count} (stats_bucket): claim -> finish of the attempts that ran, and
    -- due (run_at) -> claim
    run_ms     jsonb       NOT NULL DEFAULT '{}',
    wait_ms    jsonb       NOT NULL DEFAULT '{}',
    PRIMARY KEY (minute, queue, task)
);

-- The backlog, sampled once a minute (not the minute's peak).
CREATE TABLE {schema}.stats_depth (
    minute     timestamptz NOT NULL,
    queue      text        NOT NULL,
    task       text        NOT NULL DEFAULT '',
    pending    integer     NOT NULL DEFAULT 0,
    scheduled  integer     NOT NULL DEFAULT 0,
    running    integer     NOT NULL DEFAULT 0,
    oldest_pending float8,                          -- seconds, by the database clock
    PRIMARY KEY (minute, queue, task)
);

-- How far the rollup got: one row, locked (SKIP LOCKED) by the one sweeper that rolls up.
CREATE TABLE {schema}.stats_rollup (
    id             boolean     PRIMARY KEY DEFAULT true CHECK (id),
    finished_upto  timestamptz,                     -- minutes before it are in stats_finished
    depth_minute   timestamptz                      -- the minute of the last depth sample
);
INSERT INTO {schema}.stats_rollup DEFAULT VALUES;

-- Histogram buckets of a duration in milliseconds, two per doubling: bucket 0 is [0, 1 ms),
-- bucket b >= 1 is [2^((b-1)/2), 2^(b/2)) ms, bucket 63 everything from ~12 days on. A
-- percentile read from them is exact to within a bucket (a factor of 1.41).
CREATE FUNCTION {schema}.stats_bucket(ms float8)
RETURNS integer
LANGUAGE sql IMMUTABLE
AS $$
    SELECT CASE WHEN ms IS NULL THEN NULL
                WHEN ms < 1 THEN 0
                ELSE least(63, 1 + floor(2 * ln(ms) / ln(2)))::integer END
$$;

-- What finished in [p_since, p_until), per minute, queue and task: the rollup's input, and the
-- admin page's reading of the minutes not rolled up yet. One SELECT in LANGUAGE sql, STABLE.
CREATE FUNCTION {schema}.stats_finished_between(p_since timestamptz, p_until timestamptz)
RETURNS TABLE (minute timestamptz, queue text, task text, succeeded bigint, retried bigint,
               failed bigint, cancelled bigint, expired bigint, run_ms jsonb, wait_ms jsonb)
LANGUAGE sql STABLE
AS $$
    WITH finished AS (
        -- one branch per index: the finished states' (jobs_finished_idx, by updated_at) ...
        SELECT j.updated_at, j.queue, j.task, j.state, j.task_id, j.retries, j.locked_at,
               j.run_at
        FROM {schema}.jobs AS j
        WHERE j.state IN ('completed', 'cancelled', 'expired')
          AND j.updated_at >= p_since AND j.updated_at < p_until
        UNION ALL
        -- ... and the dead letters' (jobs_dead_idx: as many as are dead, not the table)
        SELECT j.updated_at, j.queue, j.task, j.state, j.task_id, j.retries, j.locked_at,
               j.run_at
        FROM {schema}.jobs AS j
        WHERE j.state = 'dead' AND j.updated_at >= p_since AND j.updated_at < p_until
    ), classified AS (
        SELECT date_trunc('minute', f.updated_at) AS minute, f.queue,
               coalesce(f.task, '') AS task,
               CASE WHEN f.state <> 'completed' THEN f.state
                    -- self.retry() and autoretry publish the next try (same task id,
                    -- retries + 1) before this one is acked: jobs_task_delivery_idx finds it
                    WHEN f.task_id IS NOT NULL AND EXISTS (
                        SELECT 1 FROM {schema}.jobs AS n
                        WHERE n.task_id = f.task_id AND n.retries = f.retries + 1)
                    THEN 'retried'
                    ELSE 'succeeded' END AS outcome,
               -- of the jobs that ran: locked_at is their last claim (kept at the ack)
               CASE WHEN f.state IN ('completed', 'dead') THEN {schema}.stats_bucket(
                   1000 * extract(epoch FROM f.updated_at - f.locked_at)::float8) END AS run_b,
               CASE WHEN f.state IN ('completed', 'dead') THEN {schema}.stats_bucket(
                   1000 * extract(epoch FROM f.locked_at - f.run_at)::float8) END AS wait_b
        FROM finished AS f
    ), counts AS (
        SELECT c.minute, c.queue, c.task,
               count(*) FILTER (WHERE c.outcome = 'succeeded') AS succeeded,
               count(*) FILTER (WHERE c.outcome = 'retried') AS retried,
               count(*) FILTER (WHERE c.outcome = 'dead') AS failed,
               count(*) FILTER (WHERE c.outcome = 'cancelled') AS cancelled,
               count(*) FILTER (WHERE c.outcome = 'expired') AS expired
        FROM classified AS c
        GROUP BY c.minute, c.queue, c.task
    ), run_hist AS (
        -- each histogram by a GROUP BY of its own, then joined: one pass over the rows
        SELECT h.minute, h.queue, h.task, jsonb_object_agg(h.b, h.n) AS ms
        FROM (SELECT c.minute, c.queue, c.task, c.run_b AS b, count(*) AS n FROM classified AS c
              WHERE c.run_b IS NOT NULL GROUP BY 1, 2, 3, 4) AS h
        GROUP BY 1, 2, 3
    ), wait_hist AS (
        SELECT h.minute, h.queue, h.task, jsonb_object_agg(h.b, h.n) AS ms
        FROM (SELECT c.minute, c.queue, c.task, c.wait_b AS b, count(*) AS n FROM classified AS c
              WHERE c.wait_b IS NOT NULL GROUP BY 1, 2, 3, 4) AS h
        GROUP BY 1, 2, 3
    )
    SELECT n.minute, n.queue, n.task, n.succeeded, n.retried, n.failed, n.cancelled, n.expired,
           coalesce(r.ms, '{}'), coalesce(w.ms, '{}')
    FROM counts AS n
    LEFT JOIN run_hist AS r USING (minute, queue, task)
    LEFT JOIN wait_hist AS w USING (minute, queue, task)
$$;

-- The admin page's logins. The cookie carries a random session id; this table keeps only its
-- SHA-256, so a reader of the table cannot log in with it. Logout deletes the row: a cookie saved
-- before that is worth nothing afterwards.
CREATE TABLE {schema}.admin_sessions (
    id          bytea       PRIMARY KEY,            -- sha256 of the cookie's session id
    actor       text        NOT NULL,
    role        text        NOT NULL CHECK (role IN ('operator', 'viewer')),
    csrf        text        NOT NULL,               -- the token every form of the session carries
    address     text,                               -- where the login came from
    created_at  timestamptz NOT NULL DEFAULT now(),
    seen_at     timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL
);
CREATE INDEX admin_sessions_expires_idx ON {schema}.admin_sessions (expires_at);
