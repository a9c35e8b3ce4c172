-- 0012 the dedupe key's hand-over to a Celery retry, by a trigger of the schema's owner.
--
-- A Celery retry (Task.retry, autoretry: a new message with the same task id and retries + 1)
-- continues its job, so it takes the dedupe slot over from its own copy -- which, with
-- dedupe_active, still holds it while it runs -- and is never dropped as a duplicate: when
-- another copy holds the slot (one queued while this job ran) it is queued without the slot.
-- job_insert did both in a step of its own statement (an UPDATE of dedupe_key), and PostgreSQL
-- checks the privileges of every step of a statement, even one that touches no row: every
-- role that publishes needed UPDATE (dedupe_key) on jobs, so any producer credential could
-- clear any job's key (and let a second copy of a deduplicated task run). Here the hand-over
-- is a BEFORE INSERT trigger, SECURITY DEFINER: it runs as the role that ran this migration
-- (the schema's owner), only for a row being inserted with a dedupe key and retries > 0 (its
-- WHEN clause: every other insert pays for evaluating that clause alone), and it only moves
-- the key from the rows of the same task, key and task id with fewer retries to that new row
-- -- which then holds the slot: the key is never freed by it. A trigger function cannot be
-- called on its own. Every insert statement gets it, job_insert_many's batches included (a
-- retry published inside pgbroker.transaction() was dropped as a duplicate of its running copy).
--
-- The new row's slot is checked after the trigger (the unique index, ON CONFLICT DO NOTHING):
-- the copy's old row version, deleted by this transaction, no longer conflicts.
--
-- Operational caveats: CREATE TRIGGER waits for a SHARE ROW EXCLUSIVE lock on jobs (behind any
-- long transaction writing it), held for a catalog change only. Run it as the schema's owner
-- (`pgbroker migrate` as the migration role): the function acts with its privileges.

CREATE OR REPLACE FUNCTION {schema}.jobs_dedupe_handover() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NEW.dedupe_active THEN
        -- its own copies (still queued, or running) give the slot up: the column says who
        -- holds the slot; their headers keep the key as sent
        UPDATE {schema}.jobs AS j SET dedupe_key = NULL
        WHERE j.task = NEW.task AND j.dedupe_key = NEW.dedupe_key AND j.task_id = NEW.task_id
          AND j.retries < NEW.retries
          AND j.dedupe_active AND j.state IN ('pending', 'scheduled', 'running');
    END IF;
    -- another copy holds the slot (jobs_dedupe_idx's predicate): queued without it
    IF EXISTS (SELECT 1 FROM {schema}.jobs AS h
               WHERE h.task = NEW.task AND h.dedupe_key = NEW.dedupe_key
                 AND h.task_id IS DISTINCT FROM NEW.task_id
                 AND ((h.state IN ('pending', 'scheduled') AND h.attempts = 0)
                      OR (h.dedupe_active AND h.state IN ('pending', 'scheduled', 'running'))))
    THEN
        NEW.dedupe_key := NULL;
    END IF;
    RETURN NEW;
END
$$;

REVOKE ALL ON FUNCTION {schema}.jobs_dedupe_handover() FROM PUBLIC;

DROP TRIGGER IF EXISTS jobs_dedupe_handover ON {schema}.jobs;
CREATE TRIGGER jobs_dedupe_handover
    BEFORE INSERT ON {schema}.jobs
    FOR EACH ROW
    WHEN (NEW.retries > 0 AND NEW.dedupe_key IS NOT NULL)
    EXECUTE FUNCTION {schema}.jobs_dedupe_handover();
