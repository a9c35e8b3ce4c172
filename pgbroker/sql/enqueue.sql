-- pgbroker.enqueue's statements. The inserts themselves are job_insert / job_insert_many of
-- queries.sql: one way to write a job, whoever writes it.

-- name: job_enqueued_ids
-- The job each enqueued message ended up as, in input order: the row just inserted (its id was
-- made in Python), else the job it duplicates -- the same (task, idempotency_key) or the same
-- (queue, task_id, retries), the two unique keys the insert's ON CONFLICT DO NOTHING skipped on.
-- It runs as a statement of its own after the insert: under READ COMMITTED it takes a fresh
-- snapshot, so it also sees a duplicate that a concurrent transaction committed while the insert
-- was waiting for it. NULL: the duplicate was deleted in between (the caller tries again).
SELECT coalesce(
    (SELECT j.id FROM {schema}.jobs AS j WHERE j.id = m.id),
    -- jobs_idempotency_key_idx (the equality implies its "idempotency_key IS NOT NULL")
    (SELECT j.id FROM {schema}.jobs AS j
     WHERE j.task = m.task AND j.idempotency_key = m.idempotency_key),
    -- jobs_task_delivery_idx
    (SELECT j.id FROM {schema}.jobs AS j
     WHERE j.queue = m.queue AND j.task_id = m.task_id AND j.retries = m.retries))
FROM unnest(%(id)s::uuid[], %(task)s::text[], %(idempotency_key)s::text[], %(queue)s::text[],
            %(task_id)s::text[], %(retries)s::int[]) WITH ORDINALITY
     AS m(id, task, idempotency_key, queue, task_id, retries, n)
ORDER BY m.n;
