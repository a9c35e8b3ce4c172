-- 0008 job keys: dedupe while queued, concurrency keys, cluster-wide rate limits (issue 22).
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
-- pgbroker._jobkeys checked at publish.
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

CREATE TABLE IF NOT EXISTS {schema}.rate_limits (
    task        text             PRIMARY KEY,
    max_starts  integer          NOT NULL CHECK (max_starts > 0),
    period_s    double precision NOT NULL CHECK (period_s > 0),
    rate        text             NOT NULL,          -- as configured: '10/s'
    starts      timestamptz[]    NOT NULL DEFAULT '{}',
    updated_at  timestamptz      NOT NULL DEFAULT now()
);

-- The LISTEN/NOTIFY channel of this schema (Settings.channel), for statements that have no
-- channel parameter (the claim's deferrals).
CREATE OR REPLACE FUNCTION {schema}.jobs_channel() RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT n.nspname || '.jobs' FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
    WHERE c.oid = '{schema}.jobs'::regclass
$$;
