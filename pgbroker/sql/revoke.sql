-- Celery's remote control over the jobs table: the durable revoke (pgbroker/_produce/revoke.py) and the
-- scheduled jobs `celery inspect scheduled` lists (pgbroker/_celery/inspect_scheduled.py). Loaded with
-- queries.sql.

-- name: job_revoke
-- Revoke the jobs of these Celery task ids, with an audit row per job and the revoke's broadcast
-- for the live workers, in one statement: the database and the workers are told together, and a
-- revoke sent while no worker runs is kept all the same. A job that has not been claimed is
-- cancelled; a claimed one (running, or prefetched in a worker's memory) cannot be taken back
-- from its worker, so it is flagged (revoked_at): it never runs again -- a requeue, a reject or a
-- rescue ends it 'cancelled' (job_requeue, job_bury, job_rescue in queries.sql); an ack ends it
-- 'cancelled' when its worker carried the revoke out (job_stopped, endings.sql), else as its
-- task ended it (job_ack and the acks in job_claim). Finished jobs are left alone. Returns one
-- row per job changed and one per task id left unchanged, with its newest job's state, so the
-- caller can say what happened to each.
WITH picked AS MATERIALIZED (
    -- FOR UPDATE, not SKIP LOCKED: a job being claimed or promoted right now is waited for and
    -- read again as it committed (READ COMMITTED), so it is flagged as running, not missed.
    -- Ordered by id, so that two revokes naming the same jobs lock them in the same order.
    -- task_id = ANY(...) is served by the unique publish index, which leads with task_id.
    SELECT id, task_id, queue, task, state, last_error
    FROM {schema}.jobs
    WHERE task_id = ANY(%(task_ids)s::text[])
      AND (state IN ('pending', 'scheduled') OR (state = 'running' AND revoked_at IS NULL))
    ORDER BY id
    FOR UPDATE
), changed AS (
    UPDATE {schema}.jobs AS j
    SET state = CASE WHEN p.state = 'running' THEN 'running' ELSE 'cancelled' END,
        revoked_at = now(),
        last_error = %(reason)s::text
                     || CASE WHEN p.state = 'running' THEN ' while running' ELSE '' END,
        updated_at = now()
    FROM picked AS p
    WHERE j.id = p.id
    RETURNING j.id, j.task_id, p.state AS was
), audited AS (
    -- what the revoke replaced: the state and the last error of the job
    INSERT INTO {schema}.audit (actor, action, target, detail)
    SELECT %(actor)s, 'job.revoke', p.id::text,
           %(detail)s::jsonb || jsonb_build_object(
               'task_id', p.task_id, 'queue', p.queue, 'task', p.task, 'was', p.state,
               'last_error', p.last_error)
    FROM picked AS p JOIN changed AS c USING (id)
    RETURNING 1
), told AS (
    -- the broadcast_insert of sql/routing.sql, written only when some worker's mailbox is bound
    -- (nobody would read it otherwise); the NOTIFY goes out at commit, with the cancellations
    INSERT INTO {schema}.broadcasts (id, exchange, routing_key, body, content_type,
                                     content_encoding, headers, properties)
    SELECT %(b_id)s::uuid, %(b_exchange)s::text, %(b_routing_key)s::text, %(b_body)s::bytea,
           %(b_content_type)s::text, %(b_content_encoding)s::text, %(b_headers)s::jsonb,
           %(b_properties)s::jsonb
    WHERE %(b_id)s::uuid IS NOT NULL
      AND EXISTS (SELECT 1 FROM {schema}.bindings WHERE exchange = %(b_exchange)s::text)
    -- in RETURNING: a data-modifying CTE always runs to completion, read or not
    RETURNING pg_notify(%(channel)s, 'b ' || id::text || ' ' || exchange)
)
SELECT c.task_id, c.id, c.was, true FROM changed AS c
UNION ALL
-- the ids that changed nothing, each with its newest job as this statement's snapshot saw it
SELECT w.task_id, s.id, s.state, false
FROM unnest(%(task_ids)s::text[]) AS w(task_id)
LEFT JOIN LATERAL (
    SELECT id, CASE WHEN state = 'running' AND revoked_at IS NOT NULL THEN 'revoked'
                    ELSE state END AS state
    FROM {schema}.jobs WHERE task_id = w.task_id
    ORDER BY id DESC LIMIT 1
) AS s ON true
WHERE NOT EXISTS (SELECT 1 FROM changed AS c WHERE c.task_id = w.task_id);

-- name: job_scheduled_list
-- The earliest scheduled jobs of these queues, at most %(limit)s: `celery inspect scheduled`.
-- One range of jobs_scheduled_idx (queue, run_at) per queue, each cut at the limit, so the cost
-- is the limit, never the number of jobs waiting (a queue may hold 100,000). A body longer than
-- %(body_max)s bytes is not read (octet_length does not fetch a TOASTed value): the message's
-- argsrepr/kwargsrepr headers stand in for its arguments, and the reply stays small.
SELECT j.task_id, j.task, j.run_at, j.priority, j.exchange, j.routing_key, j.attempts,
       j.content_type, j.content_encoding, j.body, j.argsrepr, j.kwargsrepr
FROM unnest(%(queues)s::text[]) AS q(name)
CROSS JOIN LATERAL (
    SELECT id, task_id, task, run_at, priority, exchange, routing_key, attempts, content_type,
           content_encoding,
           CASE WHEN octet_length(body) <= %(body_max)s THEN body END AS body,
           headers ->> 'argsrepr' AS argsrepr, headers ->> 'kwargsrepr' AS kwargsrepr
    FROM {schema}.jobs
    WHERE state = 'scheduled' AND queue = q.name
    ORDER BY run_at
    LIMIT %(limit)s
) AS j
ORDER BY j.run_at, j.id
LIMIT %(limit)s;
