-- 0007 republish: a publish is a duplicate only when it is the same message; fanout exchanges
-- store their messages in durable bound queues.
--
-- 1. The publish dedupe key was (task_id, retries, queue): it took Task.replace() (same task id,
--    same retries) and two canvas members given the same explicit id for a producer's retry,
--    and dropped them. It is now (task_id, queue, message_digest): the SHA-256 of what the
--    producer sent (body, content type and encoding, exchange, routing key, headers,
--    properties without kombu's per-publish delivery_tag), made in Python by
--    pgbroker._pg.store.message_digest. Only kombu's ensure() re-running one publish sends the same.
-- 2. publish_duplicates counts, per queue, the publishes dropped by that key or by an
--    idempotency key (pgbroker stats, Prometheus).
-- 3. queues remember how they were declared (durable, auto_delete): a fanout message becomes a
--    job in every bound queue that was not declared auto-delete or exclusive, where it waits to
--    be consumed as in AMQP; the others (Celery's mailboxes, broadcast and event queues) still
--    get a broadcast, read by the consumers listening then. broadcasts.queues names those.
--
-- Operational caveats:
-- * CREATE UNIQUE INDEX holds a SHARE lock on jobs while it is built: publishes, claims and acks
--   wait for it (about a second per million rows). On a large table build it beforehand, by hand,
--   without blocking (the statements below then find it all done):
--       ALTER TABLE pgbroker.jobs ADD COLUMN IF NOT EXISTS message_digest bytea;
--       CREATE UNIQUE INDEX CONCURRENTLY jobs_message_idx
--           ON pgbroker.jobs (task_id, queue, message_digest) WHERE task_id IS NOT NULL;
--       DROP INDEX CONCURRENTLY pgbroker.jobs_task_delivery_idx;
--   (the old index is then gone before the code that no longer needs it runs: pgbroker's own
--   older versions still insert correctly, without their publish dedupe, until upgraded)
-- * ADD COLUMN without a default changes only the catalog, but waits for an ACCESS EXCLUSIVE lock
--   on jobs, queues and broadcasts (behind any long transaction reading them).
-- * Rows written before (and by a pgbroker older than this one, during a rolling upgrade) have
--   no digest: they never count as the same message as another; an old producer's own publish
--   retry can then leave two jobs, as nothing else changes for them.
-- * beat_last_delivery (0004) is recreated: the newest delivery of a task id is now the newest
--   row, since a replacement has the retries of the task it replaced.

ALTER TABLE {schema}.jobs ADD COLUMN IF NOT EXISTS message_digest bytea;

CREATE UNIQUE INDEX IF NOT EXISTS jobs_message_idx
    ON {schema}.jobs (task_id, queue, message_digest) WHERE task_id IS NOT NULL;
-- Led by task_id, it still serves look-ups by Celery task id (revoke, the admin page, beat).
DROP INDEX IF EXISTS {schema}.jobs_task_delivery_idx;

CREATE OR REPLACE FUNCTION {schema}.beat_last_delivery(p_task_id text)
RETURNS TABLE (state text, updated_at timestamptz)
LANGUAGE sql STABLE
AS $$
    SELECT j.state, j.updated_at
    FROM {schema}.jobs AS j
    WHERE j.task_id = p_task_id
    -- a retry has retries + 1; a replacement the same retries and a newer (UUIDv7) id
    ORDER BY j.retries DESC, j.id DESC
    LIMIT 1
$$;

-- The publishes dropped by either unique key, per queue: appended (one row per statement that
-- found duplicates, never an UPDATE, so an open transaction of a caller never holds a row
-- another publisher waits for), folded into one row per queue by the sweeper.
CREATE TABLE {schema}.publish_duplicates (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    queue       text        NOT NULL,
    duplicates  bigint      NOT NULL CHECK (duplicates > 0),
    at          timestamptz NOT NULL DEFAULT now()          -- the latest duplicate counted
);

-- NULL: declared by an older pgbroker, or created by a binding before its declaration (treated
-- as auto-delete: broadcasts only, the behaviour before this migration).
ALTER TABLE {schema}.queues ADD COLUMN IF NOT EXISTS durable boolean,
                            ADD COLUMN IF NOT EXISTS auto_delete boolean;

-- The queues a broadcast is for (the auto-delete ones bound when it was published); NULL: every
-- queue bound to its exchange (written by an older pgbroker).
ALTER TABLE {schema}.broadcasts ADD COLUMN IF NOT EXISTS queues text[];
