-- 0010 job keys: dedupe while queued, concurrency keys, cluster-wide rate limits (issue 22).
--
-- 1. jobs.dedupe_key / dedupe_active: at most one copy of a (task, dedupe key) holds the key's
--    slot -- one not started yet (pending or scheduled, attempts = 0), or, with dedupe_active,
--    one queued or running. jobs_dedupe_idx is a partial unique index over exactly those rows
--    (River's unique_states idea: the row's state decides whether it still counts), so the
--    insert's ON CONFLICT DO NOTHING makes a duplicate insert nothing, race-free, without an
--    error that would abort the caller's transaction. A row leaves the index by changing state
--    (claimed, completed, dead...); dedupe_key is set NULL when a row gives up its slot without
--    that (handed to its Celery retry), so the column says who holds the slot, and the headers
--    keep the key as sent.
-- 2. jobs.concurrency_key / concurrency_limit, and concurrency_keys: how many jobs of each key
--    run now. The claim takes a slot by updating the key's row (a row lock, so two consumers
--    never both see the last free slot); jobs_concurrency_release gives it back whenever a keyed
--    job leaves 'running' by any path (ack, requeue, rescue, bury, revoke, delete), so no
--    statement can forget to.
-- 3. rate_limits: per task name, at most max_starts claims in any period_s seconds, across every
--    consumer; starts holds the claim times of the current window (a sliding log: exact, and
--    at most max_starts entries). Written by consumers from the rate_limits transport option.
--
-- The four job columns are filled by the insert statements from the message's headers, which
-- pgbroker._model.keys checked at publish.
--
-- Operational caveats:
-- * ADD COLUMN without a default changes only the catalog, but waits for an ACCESS EXCLUSIVE
--   lock on jobs (behind any long transaction reading it).
-- * The two indexes are partial over rows with a key: built over none on an existing table
--   (still a SHARE lock while the table is scanned: about a second per million rows).
-- * The release trigger runs only for rows with a concurrency key (its WHEN clause); every
--   other update of jobs pays for evaluating that clause alone.

ALTER TABLE {schema}.jobs ADD COLUMN IF NOT EXISTS dedupe_key text,
                          ADD COLUMN IF NOT EXISTS dedupe_active boolean,
                          ADD COLUMN IF NOT EXISTS concurrency_key text,
                          ADD COLUMN IF NOT EXISTS concurrency_limit integer;

-- The slot of a (task, dedupe key). A copy put back after it started (its worker lost, or
-- requeued) has attempts > 0: without dedupe_active it never takes the slot back, so putting it
-- back can never conflict with a copy queued meanwhile.
CREATE UNIQUE INDEX IF NOT EXISTS jobs_dedupe_idx ON {schema}.jobs (task, dedupe_key)
    WHERE dedupe_key IS NOT NULL
      AND ((state IN ('pending', 'scheduled') AND attempts = 0)
           OR (dedupe_active AND state IN ('pending', 'scheduled', 'running')));

-- The job a duplicate publish is reported as when the copy that held the slot started between
-- the insert and its look-up (job_enqueued_ids): the newest row with the key.
CREATE INDEX IF NOT EXISTS jobs_dedupe_rows_idx ON {schema}.jobs (task, dedupe_key, id)
    WHERE dedupe_key IS NOT NULL;

CREATE TABLE IF NOT EXISTS {schema}.concurrency_keys (
    key         text        PRIMARY KEY,
    running     integer     NOT NULL DEFAULT 0 CHECK (running >= 0),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

-- A keyed job leaves 'running': its slot is free again, and the consumers of its queue are
-- woken (a job of the key may be waiting there, passed over by every claim until now).
CREATE OR REPLACE FUNCTION {schema}.jobs_concurrency_release() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE {schema}.concurrency_keys
    SET running = greatest(running - 1, 0), updated_at = now()
    WHERE key = OLD.concurrency_key;
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.jobs', '0 ' || OLD.queue);
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS jobs_concurrency_release ON {schema}.jobs;
CREATE TRIGGER jobs_concurrency_release
    AFTER UPDATE OF state ON {schema}.jobs
    FOR EACH ROW
    WHEN (OLD.state = 'running' AND NEW.state <> 'running' AND OLD.concurrency_key IS NOT NULL)
    EXECUTE FUNCTION {schema}.jobs_concurrency_release();

DROP TRIGGER IF EXISTS jobs_concurrency_release_deleted ON {schema}.jobs;
CREATE TRIGGER jobs_concurrency_release_deleted
    AFTER DELETE ON {schema}.jobs
    FOR EACH ROW
    WHEN (OLD.state = 'running' AND OLD.concurrency_key IS NOT NULL)
    EXECUTE FUNCTION {schema}.jobs_concurrency_release();

-- The queues that have held a job with a concurrency key ('' while a rate limit exists, see
-- rate_limits_gate): claimed by job_claim_gated, the others by job_claim, which then pays
-- nothing for the keys (the claim's cost of main's). A
-- row is added by a trigger on every way a keyed job enters a queue (insert, moved), in the
-- same transaction, so a claim that sees the job sees its queue gated. Sticky: never removed
-- (a queue that had keyed jobs keeps the gated claim).
-- No index, on purpose: the table holds a few rows, read by a sequential scan of one page, and
-- job_claim locks one relation less. A statement locking more than 16 relations overflows the
-- backend's fast-path lock slots into the shared lock table: with the index (gated_queues,
-- its index, queues, its index, jobs and its 11) the claim ran at ~0.8 of main's. Two keyed
-- inserts racing may both add the queue: harmless (the readers ask whether one row exists).
CREATE TABLE IF NOT EXISTS {schema}.gated_queues (
    name        text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE OR REPLACE FUNCTION {schema}.jobs_gate_queue() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- the look-up first: once the queue is gated, keyed inserts write (and wait for) nothing
    IF NOT EXISTS (SELECT 1 FROM {schema}.gated_queues WHERE name = NEW.queue) THEN
        INSERT INTO {schema}.gated_queues (name) VALUES (NEW.queue);
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS jobs_gate_queue ON {schema}.jobs;
CREATE TRIGGER jobs_gate_queue
    AFTER INSERT OR UPDATE OF queue, concurrency_key ON {schema}.jobs
    FOR EACH ROW
    WHEN (NEW.concurrency_key IS NOT NULL)
    EXECUTE FUNCTION {schema}.jobs_gate_queue();

CREATE TABLE IF NOT EXISTS {schema}.rate_limits (
    task        text             PRIMARY KEY,
    max_starts  integer          NOT NULL CHECK (max_starts > 0),
    period_s    double precision NOT NULL CHECK (period_s > 0),
    rate        text             NOT NULL,          -- as configured: '10/s'
    starts      timestamptz[]    NOT NULL DEFAULT '{}',
    updated_at  timestamptz      NOT NULL DEFAULT now()
);

-- While a rate limit exists, every queue is gated: gated_queues holds '' (no queue's name).
-- Consumers writing their limits at once are serialised (an advisory lock of the transaction),
-- and each statement of the function reads what was committed before it, so the last one to
-- commit leaves '' exactly when rate_limits has a row.
CREATE OR REPLACE FUNCTION {schema}.rate_limits_gate() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtext('{schema}.rate_limits_gate'));
    IF NOT EXISTS (SELECT 1 FROM {schema}.rate_limits) THEN
        DELETE FROM {schema}.gated_queues WHERE name = '';
    ELSIF NOT EXISTS (SELECT 1 FROM {schema}.gated_queues WHERE name = '') THEN
        INSERT INTO {schema}.gated_queues (name) VALUES ('');
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS rate_limits_gate ON {schema}.rate_limits;
CREATE TRIGGER rate_limits_gate
    AFTER INSERT OR DELETE OR TRUNCATE ON {schema}.rate_limits
    FOR EACH STATEMENT
    EXECUTE FUNCTION {schema}.rate_limits_gate();

-- The LISTEN/NOTIFY channel of this schema (Settings.channel), for statements that have no
-- channel parameter (the claim's deferrals).
CREATE OR REPLACE FUNCTION {schema}.jobs_channel() RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT n.nspname || '.jobs' FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
    WHERE c.oid = '{schema}.jobs'::regclass
$$;

-- The claim's gate (job_claim calls it only when a candidate has a concurrency key or a
-- rate-limited task, so unkeyed claims pay nothing for it): of the candidates p_ids (rows the
-- claim holds locked, still pending), which to claim now (defer_at NULL) and which to defer to
-- 'scheduled' until defer_at; those not returned stay pending. p_acks / p_attempts: the
-- deliveries the claim acks, whose keys' slots count as free already (the release trigger frees
-- them at the claim's end). The consumers of a queue with deferred jobs are sent the delay of
-- the first (their eta timers wake them, as for job_insert's NOTIFY). VOLATILE: each statement
-- sees what was committed before it.
CREATE OR REPLACE FUNCTION {schema}.jobs_gate(p_ids uuid[], p_acks uuid[], p_attempts int[])
RETURNS TABLE (gate_id uuid, defer_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    ids uuid[];
    ats timestamptz[];
BEGIN
    IF cardinality(p_ids) = 0 THEN
        RETURN;
    END IF;
    WITH acking AS MATERIALIZED (
        SELECT j.concurrency_key AS key, count(*) AS n
        FROM unnest(p_acks, p_attempts) AS d(id, attempt)
        JOIN {schema}.jobs AS j ON j.id = d.id
        WHERE j.state = 'running' AND j.attempts = d.attempt AND j.concurrency_key IS NOT NULL
        GROUP BY j.concurrency_key
    ), gated AS MATERIALIZED (
        -- numbered per task in claim order
        SELECT j.id, j.task, j.concurrency_key, j.concurrency_limit, j.priority, j.run_at,
               r.task IS NOT NULL AS limited,
               row_number() OVER (PARTITION BY j.task ORDER BY j.priority DESC, j.run_at, j.id)
                   AS task_n
        FROM {schema}.jobs AS j LEFT JOIN {schema}.rate_limits AS r ON r.task = j.task
        WHERE j.id = ANY(p_ids)
    ), buckets AS MATERIALIZED (
        -- The rate-limited tasks' claim times within their period, from the newest version of
        -- their row: FOR UPDATE (as for the keys below). SKIP LOCKED: a task another claim
        -- holds right now waits for this turn.
        SELECT r.task, r.max_starts, make_interval(secs => r.period_s) AS period,
               ARRAY(SELECT t FROM unnest(r.starts) AS t
                     WHERE t > now() - make_interval(secs => r.period_s) ORDER BY t) AS recent
        FROM {schema}.rate_limits AS r
        WHERE r.task IN (SELECT task FROM gated WHERE limited)
        FOR UPDATE SKIP LOCKED
    ), rated AS MATERIALIZED (
        -- 'go': within its task's free starts (or not rate-limited); 'defer': beyond them, the
        -- n-th one late until the n-th start in the window is a period old; 'wait': its
        -- task's row is another claim's now
        SELECT g.id, g.task, g.concurrency_key, g.concurrency_limit, g.priority, g.run_at,
               CASE WHEN NOT g.limited THEN 'go'
                    WHEN b.task IS NULL THEN 'wait'
                    WHEN g.task_n <= b.max_starts - cardinality(b.recent) THEN 'go'
                    ELSE 'defer' END AS verdict,
               g.task_n - (b.max_starts - cardinality(b.recent)) AS late
        FROM gated AS g LEFT JOIN buckets AS b ON b.task = g.task
    ), wanted AS (
        -- the slots asked for, per key: its candidates, at most its limit (the smallest its
        -- copies were sent with)
        SELECT concurrency_key AS key, min(concurrency_limit) AS lim,
               least(count(*), min(concurrency_limit)) AS want
        FROM rated WHERE verdict = 'go' AND concurrency_key IS NOT NULL
        GROUP BY concurrency_key
    ), locked_keys AS MATERIALIZED (
        -- FOR UPDATE under READ COMMITTED reads the newest version of a key's row, even one
        -- another claim committed after this statement began: 'running' is exact, so two
        -- consumers never both take a key's last slot. SKIP LOCKED: a key another claim (or an
        -- ack) holds right now is left for this turn. In key order, so claims lock alike.
        -- 'running' is net of this claim's own acks.
        SELECT k.key, k.running - coalesce(a.n, 0) AS running
        FROM {schema}.concurrency_keys AS k LEFT JOIN acking AS a ON a.key = k.key
        WHERE k.key IN (SELECT key FROM wanted)
        ORDER BY k.key
        FOR UPDATE OF k SKIP LOCKED
    ), created AS (
        -- a key never claimed before gets its row, with the slots taken (another claim
        -- creating it at this moment: ON CONFLICT waits for it, then none of it this turn)
        INSERT INTO {schema}.concurrency_keys AS k (key, running)
        SELECT w.key, w.want FROM wanted AS w
        WHERE NOT EXISTS (SELECT 1 FROM {schema}.concurrency_keys AS e WHERE e.key = w.key)
        ORDER BY w.key
        ON CONFLICT (key) DO NOTHING
        RETURNING k.key, k.running AS granted
    ), grown AS (
        UPDATE {schema}.concurrency_keys AS k
        SET running = k.running + least(w.want, w.lim - l.running), updated_at = now()
        FROM locked_keys AS l JOIN wanted AS w ON w.key = l.key
        WHERE k.key = l.key AND l.running < w.lim
        RETURNING k.key, least(w.want, w.lim - l.running) AS granted
    ), chosen AS MATERIALIZED (
        -- every unkeyed 'go', and of each key as many as it was granted, in claim order
        SELECT g.id, g.task
        FROM (SELECT id, task, concurrency_key,
                     row_number() OVER (PARTITION BY concurrency_key
                                        ORDER BY priority DESC, run_at, id) AS n
              FROM rated WHERE verdict = 'go') AS g
        LEFT JOIN (SELECT key, granted FROM created UNION ALL SELECT key, granted FROM grown)
            AS s ON s.key = g.concurrency_key
        WHERE g.concurrency_key IS NULL OR g.n <= s.granted
    ), started AS (
        -- the claim times of the rate-limited tasks' claimed jobs, added to their window
        UPDATE {schema}.rate_limits AS r
        SET starts = b.recent || array_fill(now(), ARRAY[n.claimed]), updated_at = now()
        FROM buckets AS b
        JOIN (SELECT task, count(*)::int AS claimed FROM chosen GROUP BY task) AS n
          ON n.task = b.task
        WHERE r.task = b.task
        RETURNING r.task, r.starts, b.period
    )
    SELECT array_agg(x.id), array_agg(x.at) INTO ids, ats
    FROM (SELECT c.id, NULL::timestamptz AS at FROM chosen AS c
          UNION ALL
          -- when each deferred job may start: the 'late'-th start of the window (as it is now)
          -- is a period old then (the last one's for those later still: deferred again then)
          SELECT d.id, coalesce(w.starts[least(d.late, cardinality(w.starts))], now())
                       + w.period
          FROM rated AS d
          JOIN (SELECT b.task, coalesce(s.starts, b.recent) AS starts, b.period
                FROM buckets AS b LEFT JOIN started AS s ON s.task = b.task) AS w
            ON w.task = d.task
          WHERE d.verdict = 'defer') AS x;
    PERFORM pg_notify({schema}.jobs_channel(),
                      greatest(extract(epoch FROM min(v.at) - now()), 0)::text || ' ' || j.queue)
    FROM unnest(ids, ats) AS v(id, at) JOIN {schema}.jobs AS j ON j.id = v.id
    WHERE v.at IS NOT NULL
    GROUP BY j.queue;
    RETURN QUERY SELECT v.id, v.at FROM unnest(ids, ats) AS v(id, at);
END
$$;
