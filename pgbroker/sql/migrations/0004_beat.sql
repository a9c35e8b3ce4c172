-- 0004 beat: the periodic schedule of pgbroker.beat.Scheduler (`celery beat -S pgbroker`).
--
-- One row per beat entry: what to send (task, args, kwargs, options), when (the serialised
-- schedule and the next occurrence on its grid), the policies, and what happened last. Every beat
-- process reads and advances these rows under a row lock, in the same transaction as the job it
-- enqueues, so any number of beats fire each occurrence once.
--
-- Operational caveats: creates a new table, a function and a view only; no lock on `jobs`. The
-- function `beat_last_delivery` (used by `beat_status` and sql/beat.sql) reads `jobs` (task_id,
-- retries, state, updated_at): a later migration that changes those columns must recreate it.

CREATE TABLE {schema}.beat_schedule (
    name              text        PRIMARY KEY,
    task              text        NOT NULL,
    args              jsonb       NOT NULL DEFAULT '[]',     -- kombu JSON (datetimes round-trip)
    kwargs            jsonb       NOT NULL DEFAULT '{}',
    options           jsonb       NOT NULL DEFAULT '{}',     -- enqueue options: queue, priority,
                                                             -- expires, headers, max_attempts
    -- {"every": seconds} on a grid anchored at the Unix epoch,
    -- {"crontab": {"minute": ..., "hour": ..., "day_of_week": ..., "day_of_month": ...,
    --  "month_of_year": ...}, "tz": "Europe/Paris"} or
    -- {"solar": {"event": "sunset", "lat": 48.85, "lon": 2.35}}
    schedule          jsonb       NOT NULL,
    enabled           boolean     NOT NULL DEFAULT true,     -- operator's switch, kept on restart
    misfire           text        NOT NULL DEFAULT 'latest',
    overlap           text        NOT NULL DEFAULT 'skip',
    source            text        NOT NULL DEFAULT 'runtime', -- 'config': from beat_schedule
    removed_at        timestamptz,                           -- a config entry no longer in the
                                                             -- config: kept, never fired
    next_occurrence   timestamptz NOT NULL,                  -- the next grid point to fire
    last_occurrence   timestamptz,                           -- the grid point fired last
    total_runs        bigint      NOT NULL DEFAULT 0,
    last_job_id       uuid,                                  -- jobs.id of the last occurrence
    last_task_id      text,                                  -- its Celery task id (retries keep it)
    last_job_state    text,                                  -- as beat last saw it: 'pending'
                                                             -- until it finished
    last_completed_at timestamptz,                           -- when a run last completed
    last_error        text,                                  -- why the last occurrence sent nothing
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT beat_schedule_name_check CHECK (name <> '' AND length(name) <= 200),
    CONSTRAINT beat_schedule_task_check CHECK (task <> ''),
    CONSTRAINT beat_schedule_args_check CHECK (jsonb_typeof(args) = 'array'),
    CONSTRAINT beat_schedule_kwargs_check CHECK (jsonb_typeof(kwargs) = 'object'),
    CONSTRAINT beat_schedule_options_check CHECK (jsonb_typeof(options) = 'object'),
    CONSTRAINT beat_schedule_schedule_check CHECK (jsonb_typeof(schedule) = 'object'),
    CONSTRAINT beat_schedule_misfire_check CHECK (misfire IN ('latest', 'skip')),
    CONSTRAINT beat_schedule_overlap_check CHECK (overlap IN ('skip', 'queue', 'allow')),
    CONSTRAINT beat_schedule_source_check CHECK (source IN ('config', 'runtime')),
    CONSTRAINT beat_schedule_total_runs_check CHECK (total_runs >= 0),
    CONSTRAINT beat_schedule_last_job_state_check CHECK (last_job_state IN
        ('pending', 'completed', 'dead', 'cancelled', 'expired', 'gone'))
);

-- Each tick of every beat asks "which entries are due?": only the active ones are indexed.
CREATE INDEX beat_schedule_due_idx ON {schema}.beat_schedule (next_occurrence)
    WHERE enabled AND removed_at IS NULL;

-- The newest delivery of a Celery task id: a retry (self.retry(), autoretry) is a new row with
-- the same task id and retries + 1, published before the old one is acked, so the newest row
-- tells whether a run is still to finish, and when it completed. One SELECT in LANGUAGE sql,
-- STABLE: the planner inlines it (jobs_task_delivery_idx, led by task_id).
CREATE FUNCTION {schema}.beat_last_delivery(p_task_id text)
RETURNS TABLE (state text, updated_at timestamptz)
LANGUAGE sql STABLE
AS $$
    SELECT j.state, j.updated_at
    FROM {schema}.jobs AS j
    WHERE j.task_id = p_task_id
    ORDER BY j.retries DESC
    LIMIT 1
$$;

-- Heartbeat of periodic work, what an alert such as "expire_reservations has not completed for
-- 5 minutes" reads: one row per entry, by the database clock. The last job is read live, so a
-- run is seen the moment it completes; the stored last_completed_at covers the runs whose rows
-- were replaced by a newer occurrence or pruned.
CREATE VIEW {schema}.beat_status AS
SELECT e.name AS entry,
       e.task,
       e.enabled AND e.removed_at IS NULL AS enabled,
       e.last_occurrence,
       e.next_occurrence,
       c.last_completed_at,
       extract(epoch FROM now() - c.last_completed_at)::float8 AS age_seconds
FROM {schema}.beat_schedule AS e
LEFT JOIN LATERAL {schema}.beat_last_delivery(e.last_task_id) AS d ON true
CROSS JOIN LATERAL (
    SELECT greatest(e.last_completed_at,
                    CASE WHEN d.state = 'completed' THEN d.updated_at END) AS last_completed_at
) AS c;
