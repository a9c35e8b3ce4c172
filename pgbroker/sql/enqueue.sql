-- pgbroker.enqueue's statements. The inserts themselves are job_insert / job_insert_many of
-- queries.sql: one way to write a job, whoever writes it.

-- name: job_enqueued_ids
-- The job each published message ended up as, in input order: the row just inserted (its id was
-- made in Python), else the job it duplicates -- the same (task, idempotency_key), or the same
-- message (task_id, queue, message_digest), the two unique keys the insert's ON CONFLICT DO
-- NOTHING skipped on -- and which key matched ('key', 'message'; NULL for the row itself).
-- It runs as a statement of its own after the insert: under READ COMMITTED it takes a fresh
-- snapshot, so it also sees a duplicate that a concurrent transaction committed while the insert
-- was waiting for it. NULL: the duplicate was deleted in between (the caller tries again).
-- The transport runs it only for a message its insert skipped; pgbroker.enqueue for those and
-- for every message with an idempotency key.
WITH found AS MATERIALIZED (
    SELECT m.n, m.queue, m.id AS made, coalesce(own.id, keyed.id, same.id) AS id,
           CASE WHEN own.id IS NOT NULL THEN NULL
                WHEN keyed.id IS NOT NULL THEN 'key'
                WHEN same.id IS NOT NULL THEN 'message' END AS matched
    FROM unnest(%(id)s::uuid[], %(task)s::text[], %(idempotency_key)s::text[],
                %(queue)s::text[], %(task_id)s::text[], %(message_digest)s::bytea[])
         WITH ORDINALITY AS m(id, task, idempotency_key, queue, task_id, message_digest, n)
    LEFT JOIN LATERAL (SELECT j.id FROM {schema}.jobs AS j WHERE j.id = m.id) AS own ON true
    -- jobs_idempotency_key_idx (the equality implies its "idempotency_key IS NOT NULL")
    LEFT JOIN LATERAL (SELECT j.id FROM {schema}.jobs AS j
                       WHERE j.task = m.task AND j.idempotency_key = m.idempotency_key
                       ) AS keyed ON true
    -- jobs_message_idx
    LEFT JOIN LATERAL (SELECT j.id FROM {schema}.jobs AS j
                       WHERE j.task_id = m.task_id AND j.queue = m.queue
                         AND j.message_digest = m.message_digest) AS same ON true
), counted AS (
    -- The duplicates counter (pgbroker stats): one new row per statement and queue, never an
    -- UPDATE, so that a caller's open transaction never holds a counter row that another
    -- publisher would wait for (or deadlock on); the sweeper folds the rows
    -- (publish_duplicates_fold).
    INSERT INTO {schema}.publish_duplicates (queue, duplicates)
    SELECT queue, count(*) FROM found WHERE id IS DISTINCT FROM made GROUP BY queue
)
SELECT id, matched FROM found ORDER BY n;
