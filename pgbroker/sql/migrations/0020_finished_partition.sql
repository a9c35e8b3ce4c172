-- 0020 finished partition: finished jobs leave the hot table (issue 26, the storage change).
--
-- jobs becomes a table partitioned by state: jobs_live holds what is still to run (scheduled,
-- pending, running), jobs_done what has ended (completed, cancelled, expired, dead) for its
-- retention. An ack, a burial, an expiry or a revoke moves the row (PostgreSQL's row movement:
-- a DELETE from jobs_live and an INSERT into jobs_done in the same statement); a dead letter
-- retried moves back. Every statement still names jobs: a state in its WHERE picks the
-- partition. Before, a day of finished rows (retention) stayed in the table every claim and ack
-- works in: at 100 tasks/s 8.6 million rows, in every index and every VACUUM of it, and each
-- pruned row one more dead version. Now jobs_live holds the backlog and the running jobs only,
-- and its size follows them, not the retention; jobs_done is written once per job (an insert,
-- never an update in the hot path) and pruned by the sweeper as before (job_prune).
--
-- A unique index of a partitioned table must hold the partition key, so uniqueness across the
-- two partitions is kept another way:
-- * idempotency keys (task, idempotency_key), exactly, by job_keys: a row per key, taken by the
--   trigger jobs_key_take when a keyed job enters jobs_live (a duplicate inserts nothing, as ON
--   CONFLICT DO NOTHING did; race-free through job_keys' primary key) and given back by
--   jobs_key_free when the job is deleted. A key whose job does not exist any more (its insert
--   was skipped on another key, a TRUNCATE) is taken over by the next publish.
-- * a message published again (task_id, queue, message_digest) and the job's own id: the insert
--   statements skip a message whose job is in jobs_done (jobs_finished_ids, below), and
--   jobs_live's unique indexes catch the rest, as before. One case is left: a publish retried
--   in the very instant its job's ack is moving it (the ack not yet committed) inserts it
--   again, and it runs twice (at least once, as a lost publish reply always allowed).
--   jobs_done's index on the message is therefore not unique: a move must never fail.
--
-- Operational caveats: everything here runs under an ACCESS EXCLUSIVE lock on jobs, in the
-- migration's transaction: no claim, ack or publish until it commits. The old table becomes
-- jobs_done in place (no rewrite); what is still to run is moved into the new jobs_live (the
-- backlog: a delete and an insert per row), jobs_done's state is checked (a scan, about a
-- second per million rows), and its index on the message is built again, not unique (a second
-- scan). Workers and producers of an older pgbroker go on working (their statements name jobs);
-- an older producer's publish of a message whose job has finished is not skipped.

LOCK TABLE {schema}.jobs IN ACCESS EXCLUSIVE MODE;

-- 1. The old table becomes jobs_done: its triggers (they are for rows to run) and the indexes
--    of states it will not hold go.
ALTER TABLE {schema}.jobs RENAME TO jobs_done;
DROP TRIGGER jobs_concurrency_release ON {schema}.jobs_done;
DROP TRIGGER jobs_concurrency_release_deleted ON {schema}.jobs_done;
DROP TRIGGER jobs_gate_queue ON {schema}.jobs_done;
DROP TRIGGER jobs_dedupe_handover ON {schema}.jobs_done;
DROP INDEX {schema}.jobs_claim_idx, {schema}.jobs_dedupe_idx, {schema}.jobs_expires_idx,
           {schema}.jobs_running_idx, {schema}.jobs_scheduled_idx,
           {schema}.jobs_task_paused_idx, {schema}.jobs_message_idx;
ALTER INDEX {schema}.jobs_pkey RENAME TO jobs_done_pkey;
ALTER INDEX {schema}.jobs_dead_idx RENAME TO jobs_done_dead_idx;
ALTER INDEX {schema}.jobs_dedupe_rows_idx RENAME TO jobs_done_dedupe_rows_idx;
ALTER INDEX {schema}.jobs_finished_idx RENAME TO jobs_done_finished_idx;
ALTER INDEX {schema}.jobs_idempotency_key_idx RENAME TO jobs_done_idempotency_key_idx;
CREATE INDEX jobs_done_message_idx ON {schema}.jobs_done (task_id, queue, message_digest)
    WHERE task_id IS NOT NULL;
-- rows are written once (fillfactor 90 kept room for updates in place); the sweeper's prune
-- deletes. vacuum_truncate: see jobs_live's.
ALTER TABLE {schema}.jobs_done RESET (fillfactor);
ALTER TABLE {schema}.jobs_done SET (vacuum_truncate = false);

-- 2. The partitioned jobs, with the same columns, defaults and checks, and the privileges the
--    old table had granted (table and columns).
CREATE TABLE {schema}.jobs (LIKE {schema}.jobs_done INCLUDING DEFAULTS INCLUDING CONSTRAINTS
                            INCLUDING STORAGE INCLUDING COMMENTS)
    PARTITION BY LIST (state);

DO $$
DECLARE r record;
BEGIN
    FOR r IN SELECT a.privilege_type AS privilege, a.is_grantable,
                    CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END
                        AS grantee
             FROM pg_class AS c, aclexplode(c.relacl) AS a
             WHERE c.oid = '{schema}.jobs_done'::regclass AND a.grantee <> c.relowner LOOP
        EXECUTE format('GRANT %s ON {schema}.jobs TO %s%s', r.privilege, r.grantee,
                       CASE WHEN r.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
    FOR r IN SELECT att.attname, a.privilege_type AS privilege, a.is_grantable,
                    CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END
                        AS grantee
             FROM pg_attribute AS att, aclexplode(att.attacl) AS a
             WHERE att.attrelid = '{schema}.jobs_done'::regclass AND att.attacl IS NOT NULL
               AND NOT att.attisdropped LOOP
        EXECUTE format('GRANT %s (%I) ON {schema}.jobs TO %s%s', r.privilege, r.attname,
                       r.grantee, CASE WHEN r.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END
$$;

-- 3. jobs_live, with the claim's settings of 0015 (autovacuum for a queue's churn) and the
--    jobs still to run. vacuum_truncate = false: a VACUUM that finds empty pages at the end of
--    the table gives them back to the operating system under an ACCESS EXCLUSIVE lock, which
--    every claim, ack and publish then waits behind (the compressed soak measured it: a
--    consumer's acks past their lock_timeout, claims at 34 ms instead of 2); on a standby the
--    lock's replay cancels queries. A queue's table fills its pages again within seconds.
CREATE TABLE {schema}.jobs_live PARTITION OF {schema}.jobs
    FOR VALUES IN ('scheduled', 'pending', 'running')
    WITH (fillfactor = 90, vacuum_truncate = false, autovacuum_vacuum_scale_factor = 0.01,
          autovacuum_vacuum_threshold = 1000, autovacuum_vacuum_insert_scale_factor = 0.01,
          autovacuum_vacuum_cost_limit = 2000, autovacuum_analyze_scale_factor = 0.02);
WITH moved AS (
    DELETE FROM {schema}.jobs_done WHERE state IN ('scheduled', 'pending', 'running')
    RETURNING *
)
INSERT INTO {schema}.jobs_live SELECT * FROM moved;

ALTER TABLE {schema}.jobs_live ADD CONSTRAINT jobs_live_pkey PRIMARY KEY (id);
CREATE INDEX jobs_claim_idx ON {schema}.jobs_live (queue, task_paused, (-priority), run_at, id)
    WHERE state = 'pending';
CREATE INDEX jobs_scheduled_idx ON {schema}.jobs_live (queue, run_at) WHERE state = 'scheduled';
CREATE INDEX jobs_running_idx ON {schema}.jobs_live (locked_by) WHERE state = 'running';
CREATE INDEX jobs_expires_idx ON {schema}.jobs_live (expires_at)
    WHERE state IN ('pending', 'scheduled') AND expires_at IS NOT NULL;
CREATE UNIQUE INDEX jobs_idempotency_key_idx ON {schema}.jobs_live (task, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
CREATE UNIQUE INDEX jobs_message_idx ON {schema}.jobs_live (task_id, queue, message_digest)
    WHERE task_id IS NOT NULL;
CREATE UNIQUE INDEX jobs_dedupe_idx ON {schema}.jobs_live (task, dedupe_key)
    WHERE dedupe_key IS NOT NULL
      AND ((state IN ('pending', 'scheduled') AND attempts = 0)
           OR (dedupe_active AND state IN ('pending', 'scheduled', 'running')));
CREATE INDEX jobs_dedupe_rows_idx ON {schema}.jobs_live (task, dedupe_key, id)
    WHERE dedupe_key IS NOT NULL;
CREATE INDEX jobs_task_paused_idx ON {schema}.jobs_live (task) WHERE task_paused;

-- the triggers of 0010, 0012 and 0013, on the rows to run
CREATE TRIGGER jobs_concurrency_release AFTER UPDATE OF state ON {schema}.jobs_live
    FOR EACH ROW
    WHEN (OLD.state = 'running' AND NEW.state <> 'running' AND OLD.concurrency_key IS NOT NULL)
    EXECUTE FUNCTION {schema}.jobs_concurrency_release();
-- (a row moving to jobs_done is deleted from jobs_live: this one gives its slot back)
CREATE TRIGGER jobs_concurrency_release_deleted AFTER DELETE ON {schema}.jobs_live
    FOR EACH ROW WHEN (OLD.state = 'running' AND OLD.concurrency_key IS NOT NULL)
    EXECUTE FUNCTION {schema}.jobs_concurrency_release();
CREATE TRIGGER jobs_gate_queue AFTER INSERT OR UPDATE OF queue, concurrency_key
    ON {schema}.jobs_live FOR EACH ROW WHEN (NEW.concurrency_key IS NOT NULL)
    EXECUTE FUNCTION {schema}.jobs_gate_queue();
CREATE TRIGGER jobs_dedupe_handover BEFORE INSERT ON {schema}.jobs_live
    FOR EACH ROW WHEN (NEW.retries > 0 AND NEW.dedupe_key IS NOT NULL)
    EXECUTE FUNCTION {schema}.jobs_dedupe_handover();

-- 4. The old table is attached as jobs_done once its rows are known to be finished ones.
ALTER TABLE {schema}.jobs_done ADD CONSTRAINT jobs_done_state
    CHECK (state IN ('completed', 'cancelled', 'expired', 'dead'));
ALTER TABLE {schema}.jobs ATTACH PARTITION {schema}.jobs_done
    FOR VALUES IN ('completed', 'cancelled', 'expired', 'dead');
ALTER TABLE {schema}.jobs_done DROP CONSTRAINT jobs_done_state;

-- 5. A message published again after its job finished. The insert statements (job_insert,
--    job_insert_many, job_fanout, job_insert_dead) skip a message whose id or (task_id, queue,
--    message_digest) is in jobs_done through this function rather than a NOT EXISTS of their
--    own: a statement's plan is made with the statistics of its moment, and one cached while
--    jobs_done was empty (a prepared statement on a producer's connection keeps a generic plan
--    for its life) read the whole of jobs_done at every publish once it held a day of jobs --
--    measured: 15 ms and 1,982 buffers a publish of 5 jobs after a minute at 250 jobs/s. Their
--    own statements are planned with sequential scans and hash and merge joins off: index
--    probes, whatever the statistics say, and plpgsql keeps the plans for the session.
--    p_any_state: in jobs_live too (a dead letter is inserted into jobs_done, where no unique
--    index catches a copy of a message still to run).
CREATE FUNCTION {schema}.jobs_finished_ids(p_ids uuid[], p_task_ids text[], p_queues text[],
                                           p_digests bytea[], p_any_state boolean DEFAULT false)
RETURNS uuid[]
LANGUAGE plpgsql STABLE
SET enable_seqscan = off SET enable_bitmapscan = off SET enable_hashjoin = off
SET enable_mergejoin = off AS $$
BEGIN
    -- the ids of the messages whose job has finished (or, p_any_state, exists at all)
    RETURN ARRAY(
        SELECT m.id FROM unnest(p_ids, p_task_ids, p_queues, p_digests)
                         AS m(id, task_id, queue, digest)
        WHERE EXISTS (SELECT 1 FROM {schema}.jobs AS d
                      WHERE d.state IN ('completed', 'cancelled', 'expired', 'dead')
                        AND d.id = m.id)
           OR EXISTS (SELECT 1 FROM {schema}.jobs AS d
                      WHERE d.state IN ('completed', 'cancelled', 'expired', 'dead')
                        AND d.task_id = m.task_id AND d.queue = m.queue
                        AND d.message_digest = m.digest)
           OR (p_any_state AND EXISTS (SELECT 1 FROM {schema}.jobs AS d
                                       WHERE d.state IN ('scheduled', 'pending', 'running')
                                         AND d.task_id = m.task_id AND d.queue = m.queue
                                         AND d.message_digest = m.digest)));
END
$$;

-- 6. Idempotency keys across both partitions.
CREATE TABLE {schema}.job_keys (
    task text NOT NULL,
    idempotency_key text NOT NULL,
    id uuid NOT NULL,
    PRIMARY KEY (task, idempotency_key)
);
INSERT INTO {schema}.job_keys (task, idempotency_key, id)
SELECT task, idempotency_key, id FROM {schema}.jobs
WHERE idempotency_key IS NOT NULL AND task IS NOT NULL;

-- A keyed job entering jobs_live takes its key; NULL (nothing inserted, like ON CONFLICT DO
-- NOTHING) when another job holds it. Runs as the schema's owner (a producer has no privilege
-- on job_keys; as 0013). VOLATILE: each statement sees what committed before it, and the
-- INSERT ... ON CONFLICT waits for a publish of the same key still in flight.
CREATE FUNCTION {schema}.jobs_key_take() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    holder uuid;
BEGIN
    LOOP
        INSERT INTO {schema}.job_keys (task, idempotency_key, id)
        VALUES (NEW.task, NEW.idempotency_key, NEW.id)
        ON CONFLICT DO NOTHING;
        IF FOUND THEN
            RETURN NEW;
        END IF;
        SELECT k.id INTO holder FROM {schema}.job_keys AS k
        WHERE k.task = NEW.task AND k.idempotency_key = NEW.idempotency_key;
        IF holder = NEW.id THEN
            RETURN NEW;  -- the same job, moving back to run (a dead letter retried)
        END IF;
        IF EXISTS (SELECT 1 FROM {schema}.jobs AS j WHERE j.id = holder) THEN
            IF NEW.created_at < now() THEN
                -- a row moving here from jobs_done must never be skipped (it would be lost)
                RAISE EXCEPTION 'pgbroker: job % cannot run again: job % holds its idempotency key',
                    NEW.id, holder USING ERRCODE = 'unique_violation';
            END IF;
            RETURN NULL;  -- a duplicate: nothing inserted
        END IF;
        -- the key's job is gone: the key is free
        DELETE FROM {schema}.job_keys AS k
        WHERE k.task = NEW.task AND k.idempotency_key = NEW.idempotency_key AND k.id = holder;
    END LOOP;
END
$$;
REVOKE ALL ON FUNCTION {schema}.jobs_key_take() FROM PUBLIC;

-- A keyed job deleted gives its key back -- not one moving between the partitions (the row is
-- in the other one when this runs, at the end of the statement).
CREATE FUNCTION {schema}.jobs_key_free() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    DELETE FROM {schema}.job_keys AS k
    WHERE k.task = OLD.task AND k.idempotency_key = OLD.idempotency_key AND k.id = OLD.id
      AND NOT EXISTS (SELECT 1 FROM {schema}.jobs AS j WHERE j.id = OLD.id);
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION {schema}.jobs_key_free() FROM PUBLIC;

CREATE TRIGGER jobs_key_take BEFORE INSERT ON {schema}.jobs_live
    FOR EACH ROW WHEN (NEW.idempotency_key IS NOT NULL AND NEW.task IS NOT NULL)
    EXECUTE FUNCTION {schema}.jobs_key_take();
CREATE TRIGGER jobs_key_free AFTER DELETE ON {schema}.jobs_live
    FOR EACH ROW WHEN (OLD.idempotency_key IS NOT NULL AND OLD.task IS NOT NULL)
    EXECUTE FUNCTION {schema}.jobs_key_free();
CREATE TRIGGER jobs_key_free AFTER DELETE ON {schema}.jobs_done
    FOR EACH ROW WHEN (OLD.idempotency_key IS NOT NULL AND OLD.task IS NOT NULL)
    EXECUTE FUNCTION {schema}.jobs_key_free();
