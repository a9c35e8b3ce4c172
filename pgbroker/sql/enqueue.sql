-- pgbroker.enqueue's statements. The inserts themselves are job_insert / job_insert_many of
-- queries.sql: one way to write a job, whoever writes it.

-- name: job_enqueued_ids
-- The job each published message ended up as, in input order: the row just inserted (its id was
-- made in Python), else the job it duplicates -- the same (task, idempotency_key), the copy
-- holding the (task, dedupe_key) slot, or the same message (task_id, queue, message_digest),
-- the unique keys the insert's ON CONFLICT DO NOTHING skipped on -- and which key matched
-- ('key', 'dedupe', 'message'; NULL for the row itself). A dedupe slot's copy may have started
-- (left the slot) since the insert met it: it is still the job this publish duplicated, found
-- as the newest row with the key.
-- It runs as a statement of its own after the insert: under READ COMMITTED it takes a fresh
-- snapshot, so it also sees a duplicate that a concurrent transaction committed while the insert
-- was waiting for it. NULL: the duplicate was deleted in between (the caller tries again).
-- The transport runs it only for a message its insert skipped; pgbroker.enqueue for those and
-- for every message with an idempotency key.
WITH found AS MATERIALIZED (
    SELECT m.n, m.queue, m.id AS made,
           coalesce(own.id, keyed.id, holder.id, newest.id, same.id) AS id,
           CASE WHEN own.id IS NOT NULL THEN NULL
                WHEN keyed.id IS NOT NULL THEN 'key'
                WHEN coalesce(holder.id, newest.id) IS NOT NULL THEN 'dedupe'
                WHEN same.id IS NOT NULL THEN 'message' END AS matched
    FROM unnest(%(id)s::uuid[], %(task)s::text[], %(idempotency_key)s::text[],
                %(queue)s::text[], %(task_id)s::text[], %(message_digest)s::bytea[],
                %(dedupe_key)s::text[])
         WITH ORDINALITY AS m(id, task, idempotency_key, queue, task_id, message_digest,
                              dedupe_key, n)
    LEFT JOIN LATERAL (SELECT j.id FROM {schema}.jobs AS j WHERE j.id = m.id) AS own ON true
    -- jobs_idempotency_key_idx (the equality implies its "idempotency_key IS NOT NULL")
    LEFT JOIN LATERAL (SELECT j.id FROM {schema}.jobs AS j
                       WHERE j.task = m.task AND j.idempotency_key = m.idempotency_key
                       ) AS keyed ON true
    -- jobs_dedupe_idx: the copy holding the slot (its predicate, written out, is implied)
    LEFT JOIN LATERAL (SELECT j.id FROM {schema}.jobs AS j
                       WHERE j.task = m.task AND j.dedupe_key = m.dedupe_key
                         AND ((j.state IN ('pending', 'scheduled') AND j.attempts = 0)
                              OR (j.dedupe_active
                                  AND j.state IN ('pending', 'scheduled', 'running')))
                       ) AS holder ON true
    -- jobs_dedupe_rows_idx: else the newest row with the key (the holder, started meanwhile)
    LEFT JOIN LATERAL (SELECT j.id FROM {schema}.jobs AS j
                       WHERE own.id IS NULL AND holder.id IS NULL
                         AND j.task = m.task AND j.dedupe_key = m.dedupe_key
                       ORDER BY j.id DESC LIMIT 1) AS newest ON true
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
