-- The operator's queries: metrics, job look-ups and the actions of the CLI and the admin page
-- (pgbroker/metrics.py, pgbroker/ops.py). {schema} is the quoted schema name; every value is a
-- bound parameter. Every action writes its audit row in the same statement as the change.

-- ---------------------------------------------------------------------------------------------
-- Metrics: cheap enough to run every 15 s on a table of millions of rows.
-- ---------------------------------------------------------------------------------------------

-- name: metrics_transaction
-- A scrape reads one consistent snapshot, and writes nothing.
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY;

-- name: metrics_plan
-- Within the scrape's transaction only: no sequential scan of the jobs table. When the backlog is
-- a tenth of the table, the planner can prefer reading the whole table (in parallel) to reading
-- the backlog's pages through its partial index -- measured: 122,000 pages instead of 13,000 with
-- 100,000 pending among 1,100,000 rows. A scrape every 15 s must cost the backlog, not the table.
-- (The small tables -- queues, consumers -- are still scanned whole: they have no other path.)
-- And no JIT: the cost penalty that turns seq scans off also pushes every plan past
-- jit_above_cost, and compiling would then cost more (~50 ms a query) than running.
SELECT set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true);

-- name: metrics_active
-- Exact counts of the states that stay small in a healthy system (pending, scheduled, running,
-- dead), per queue and task. One branch per state, each with its state as a constant, so that each
-- is served by its own partial index (jobs_claim_idx, jobs_scheduled_idx, jobs_running_idx,
-- jobs_dead_idx) and costs the size of that state, never the table: a single GROUP BY over
-- "state IN (...)" would read every completed row too.
SELECT 'pending' AS state, queue, task, count(*) AS n,
       -- requeued after a delivery: their next delivery is a redelivery
       count(*) FILTER (WHERE attempts > 0) AS redelivered,
       -- age of the oldest due job, by the database clock: is the worker keeping up?
       extract(epoch FROM now() - min(run_at))::float8 AS oldest_age,
       0::bigint AS poison
FROM {schema}.jobs WHERE state = 'pending' GROUP BY queue, task
UNION ALL
SELECT 'scheduled', queue, task, count(*), count(*) FILTER (WHERE attempts > 0), NULL, 0
FROM {schema}.jobs WHERE state = 'scheduled' GROUP BY queue, task
UNION ALL
SELECT 'running', queue, task, count(*), count(*) FILTER (WHERE attempts > 1), NULL, 0
FROM {schema}.jobs WHERE state = 'running' GROUP BY queue, task
UNION ALL
-- poison: out of attempts because every delivery killed or lost its worker -- the sweeper's
-- wording in job_rescue (the whole worker died) or the transport's requeue reason (Celery gave
-- the message back after its pool process died; older rows say "requeued by the consumer").
-- pgbroker.ops.is_poison (POISON_WORDS) is the same test in Python.
SELECT 'dead', queue, task, count(*), 0, NULL,
       count(*) FILTER (WHERE last_error LIKE 'max attempts (%%'
                          AND (last_error LIKE '%%consumer was lost%%'
                               OR last_error LIKE '%%pool process was lost%%'
                               OR last_error LIKE '%%requeued by the consumer%%'))
FROM {schema}.jobs WHERE state = 'dead' GROUP BY queue, task;

-- name: metrics_finished
-- Finished rows per minute of updated_at, queue, task and state, for updated_at in
-- (%(since)s, %(upto)s]: a range scan of jobs_finished_idx (updated_at), so a scrape reads only
-- the rows finished since the previous one (pgbroker.metrics keeps the per-minute counts of the
-- retention window in memory). A NULL %(since)s counts the whole window once, at the first scrape.
-- A completed try whose task sent a Celery retry counts as 'retried' (retried_attempt, set by
-- pgbroker._celery.endings before its ack; migration 0018): its task went on in a new job.
SELECT date_trunc('minute', updated_at) AS minute, queue, task,
       CASE WHEN retried_attempt = attempts AND state = 'completed' THEN 'retried'
            ELSE state END AS state,
       count(*) AS n
FROM {schema}.jobs
WHERE state IN ('completed', 'cancelled', 'expired')
  AND updated_at > coalesce(%(since)s::timestamptz, '-infinity')
  AND updated_at <= %(upto)s::timestamptz
GROUP BY 1, 2, 3, 4;

-- name: metrics_clock
-- The database clock, and the upper bound of this scrape's finished range: rows are stamped with
-- their transaction's start time, so a row stamped just now may not be committed yet; %(lag)s
-- seconds later it is (a finishing statement is one short transaction).
SELECT now(), now() - make_interval(secs => %(lag)s);

-- name: metrics_consumers
-- Consumers alive now (heartbeat within each one's own lease; %(lease)s for a row of an older
-- pgbroker, which has none), in total (queue NULL) and per queue.
WITH alive AS (
    SELECT queues FROM {schema}.consumers
    WHERE heartbeat_at > now() - make_interval(secs => coalesce(lease_timeout, %(lease)s))
)
SELECT NULL::text AS queue, count(*) FROM alive
UNION ALL
SELECT q.queue, count(*) FROM alive, unnest(alive.queues) AS q(queue) GROUP BY q.queue;

-- name: metrics_settle_failures
-- Consumers whose settling statements (acks, requeues, burials) fail on a living connection,
-- and for how long (0017): their jobs stay 'running' under them until they are written.
SELECT id::text, host, pid, extract(epoch FROM now() - settle_failing_since)::float8
FROM {schema}.consumers WHERE settle_failing_since IS NOT NULL;

-- name: metrics_queues
SELECT name, paused FROM {schema}.queues ORDER BY name;

-- name: metrics_duplicates
-- Publishes dropped as duplicates, per queue, since the schema exists (a few rows: the sweeper
-- folds them, publish_duplicates_fold).
SELECT queue, sum(duplicates) FROM {schema}.publish_duplicates GROUP BY queue;

-- name: metrics_beat_present
-- pgbroker.beat's status view (migration 0004) may be missing from an older schema.
SELECT to_regclass(%(view)s) IS NOT NULL;

-- name: metrics_beat
-- Per enabled beat entry, seconds since its last completed run (NULL: never completed), by the
-- database clock: the view beat_status of pgbroker.beat.
SELECT entry, age_seconds FROM {schema}.beat_status WHERE enabled ORDER BY entry;

-- ---------------------------------------------------------------------------------------------
-- Look-ups
-- ---------------------------------------------------------------------------------------------

-- name: job_show
SELECT id, queue, task, task_id, retries, state, priority, attempts, max_attempts, run_at,
       expires_at, locked_at, locked_by, revoked_at, last_error, last_traceback, idempotency_key,
       created_at, updated_at, exchange, routing_key, content_type, content_encoding, headers, properties,
       body
FROM {schema}.jobs WHERE id = %(id)s;

-- name: job_lookup
-- Jobs whose Celery task id or idempotency key is %(key)s (newest first). The idempotency index
-- is on (task, idempotency_key) and PostgreSQL 15 has no skip scan: the recursive CTE emulates one,
-- walking the index once per distinct task name, so a key is found without reading the table.
WITH RECURSIVE keyed_tasks AS (
    (SELECT task FROM {schema}.jobs
     WHERE idempotency_key IS NOT NULL AND task IS NOT NULL ORDER BY task LIMIT 1)
    UNION ALL
    SELECT (SELECT j.task FROM {schema}.jobs AS j
            WHERE j.idempotency_key IS NOT NULL AND j.task > t.task ORDER BY j.task LIMIT 1)
    FROM keyed_tasks AS t WHERE t.task IS NOT NULL
), found AS (
    SELECT j.id FROM keyed_tasks AS t
    JOIN {schema}.jobs AS j ON j.task = t.task AND j.idempotency_key = %(key)s
    UNION
    -- plain kombu messages have no task name; the index keeps their NULLs too
    SELECT id FROM {schema}.jobs WHERE task IS NULL AND idempotency_key = %(key)s
    UNION
    SELECT id FROM {schema}.jobs WHERE task_id = %(key)s
)
SELECT j.id, j.queue, j.task, j.state, j.attempts, j.max_attempts, j.run_at, j.updated_at,
       j.last_error
FROM {schema}.jobs AS j JOIN found USING (id)
ORDER BY j.id DESC LIMIT 50;

-- name: job_list
-- Newest first (ids are UUIDv7, so the primary key is in creation order), optionally filtered.
SELECT id, queue, task, state, attempts, max_attempts, run_at, updated_at, last_error
FROM {schema}.jobs
WHERE (%(queue)s::text IS NULL OR queue = %(queue)s)
  AND (%(state)s::text IS NULL OR state = %(state)s)
  AND (%(task)s::text IS NULL OR task = %(task)s)
ORDER BY id DESC
LIMIT %(limit)s;

-- name: dead_list
-- Dead letters, most recent death first (jobs_dead_idx). runs: the deliveries of the task across
-- Celery's retries -- self.retry() and autoretry publish each retry as a new row with the same
-- task id (and retries + 1), whose attempts start at 0 again -- summed over the rows still kept
-- (jobs_message_idx leads with task_id: one probe per dead letter). A plain kombu message (no
-- task id) ran as often as its attempts.
SELECT j.id, j.queue, j.task, j.task_id, j.retries, j.attempts, j.max_attempts, j.updated_at,
       j.last_error, j.last_traceback,
       coalesce((SELECT sum(r.attempts) FROM {schema}.jobs AS r
                 WHERE r.task_id = j.task_id AND r.queue = j.queue
                   AND r.retries <= j.retries), j.attempts)::int AS runs
FROM {schema}.jobs AS j
WHERE j.state = 'dead' AND (%(queue)s::text IS NULL OR j.queue = %(queue)s)
ORDER BY j.updated_at DESC
LIMIT %(limit)s;

-- name: dead_count
SELECT count(*) FROM {schema}.jobs
WHERE state = 'dead' AND (%(queue)s::text IS NULL OR queue = %(queue)s);

-- name: job_state
SELECT state FROM {schema}.jobs WHERE id = %(id)s;

-- name: audit_list
SELECT id, at, actor, action, target, detail FROM {schema}.audit
WHERE (%(target)s::text IS NULL OR target = %(target)s)
ORDER BY at DESC, id DESC
LIMIT %(limit)s;

-- ---------------------------------------------------------------------------------------------
-- Actions (pgbroker.ops): each one statement with its audit row.
-- ---------------------------------------------------------------------------------------------

-- name: dead_resolve
-- Retry (action 'retry') or discard (action 'discard') dead jobs: the ids given, or else up to
-- %(limit)s of the dead letters that match the filter (queue, and for the admin page's bulk
-- actions task, id range and text: see job_browse_state in admin.sql). One audit row per job
-- keeps what the job loses: its error, traceback and attempts (the history of its failures);
-- %(bulk)s is the id of the bulk action's own audit row, if any.
WITH picked AS MATERIALIZED (
    -- state = 'dead' as a constant: jobs_dead_idx serves it. FOR UPDATE SKIP LOCKED: two
    -- operators retrying at once never handle one job twice, and a batch never waits.
    SELECT id, queue, task, task_id, attempts, last_error, last_traceback
    FROM {schema}.jobs
    WHERE state = 'dead'
      AND (%(ids)s::uuid[] IS NULL OR id = ANY(%(ids)s::uuid[]))
      AND (%(queue)s::text IS NULL OR queue = %(queue)s)
      AND (%(task)s::text IS NULL OR task = %(task)s)
      AND id >= %(id_from)s AND id < %(id_to)s
      AND (%(text)s::text IS NULL OR position(%(text_bytes)s::bytea IN body) > 0
           OR headers ->> 'argsrepr' ILIKE %(text_like)s
           OR headers ->> 'kwargsrepr' ILIKE %(text_like)s)
      -- "all" means those dead when the operation began: a retried job that fails again at
      -- once is not retried again by the next batch (no loop with a fast worker)
      AND (%(before)s::timestamptz IS NULL OR updated_at <= %(before)s::timestamptz)
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), retried AS (
    -- back to 'pending' as if new: due now, attempts and the recorded failure reset (with
    -- failed_attempt kept, the next ack of attempt 1 would bury it again)
    UPDATE {schema}.jobs AS j
    SET state = 'pending', attempts = 0, failed_attempt = NULL, last_error = NULL,
        last_traceback = NULL, run_at = now(), locked_at = NULL, locked_by = NULL,
        -- a retried job takes its dedupe slot back if it is free; else it runs without it
        -- (another copy queued since; 0010_job_keys.sql)
        dedupe_key = CASE WHEN j.dedupe_key IS NOT NULL AND EXISTS (
                              SELECT 1 FROM {schema}.jobs AS h
                              WHERE h.task = j.task AND h.dedupe_key = j.dedupe_key
                                AND ((h.state IN ('pending', 'scheduled') AND h.attempts = 0)
                                     OR (h.dedupe_active
                                         AND h.state IN ('pending', 'scheduled', 'running'))))
                          THEN NULL ELSE j.dedupe_key END,
        -- a job of a paused task name waits out of the claim's way (0011_task_pause_index.sql)
        task_paused = coalesce(j.task = ANY (ARRAY(SELECT tp.task FROM {schema}.task_pauses AS tp)),
                               false),
        updated_at = now()
    FROM picked AS p
    WHERE j.id = p.id AND %(action)s::text = 'retry'
    RETURNING j.id, j.queue
), discarded AS (
    DELETE FROM {schema}.jobs AS j
    USING picked AS p
    WHERE j.id = p.id AND %(action)s::text = 'discard'
    RETURNING j.id
), audited AS (
    INSERT INTO {schema}.audit (actor, action, target, detail)
    SELECT %(actor)s, 'dead.' || %(action)s::text, p.id::text,
           jsonb_build_object('via', %(via)s::text, 'queue', p.queue, 'task', p.task,
                              'task_id', p.task_id, 'attempts', p.attempts,
                              'last_error', p.last_error, 'last_traceback', p.last_traceback)
           || CASE WHEN %(bulk)s::bigint IS NULL THEN '{}'::jsonb
                   ELSE jsonb_build_object('bulk', %(bulk)s::bigint) END
    FROM picked AS p
    WHERE p.id IN (SELECT id FROM retried UNION ALL SELECT id FROM discarded)
    RETURNING 1
), woken AS (
    -- the consumers of the retried queues claim at once (same payload as job_insert's)
    SELECT pg_notify(%(channel)s, '0 ' || queue) FROM (SELECT DISTINCT queue FROM retried) AS q
)
SELECT (SELECT count(*) FROM retried) + (SELECT count(*) FROM discarded),
       (SELECT count(*) FROM audited), (SELECT count(*) FROM woken);

-- name: job_cancel
-- A job that has not started is never run: 'cancelled' (kept for the retention window, then
-- pruned like completed rows). A running job cannot be taken back from its worker.
WITH cancelled AS (
    UPDATE {schema}.jobs
    SET state = 'cancelled', last_error = 'cancelled by ' || %(actor)s::text, updated_at = now()
    WHERE id = %(id)s AND state IN ('pending', 'scheduled')
    RETURNING id, queue, task, run_at
), audited AS (
    INSERT INTO {schema}.audit (actor, action, target, detail)
    SELECT %(actor)s, 'job.cancel', id::text,
           jsonb_build_object('via', %(via)s::text, 'queue', queue, 'task', task, 'run_at', run_at)
    FROM cancelled
    RETURNING 1
)
SELECT (SELECT count(*) FROM cancelled), (SELECT count(*) FROM audited);

-- name: audit_insert
INSERT INTO {schema}.audit (actor, action, target, detail)
VALUES (%(actor)s, %(action)s, %(target)s, %(detail)s)
RETURNING id;

-- name: queue_purge_batch
-- One batch of a purge (pending and scheduled jobs of a queue), counted into the purge's audit
-- row in the same statement: the row always says how many were really deleted, even when the
-- purge is interrupted between batches.
WITH due AS MATERIALIZED (
    -- one CTE per state with the state as a constant, so each uses its partial index
    -- (FOR UPDATE is not allowed under UNION). Only jobs created before the purge began: a
    -- producer publishing meanwhile cannot keep the purge going for ever.
    SELECT id FROM {schema}.jobs
    WHERE state = 'pending' AND queue = %(queue)s AND created_at <= %(before)s::timestamptz
    LIMIT %(limit)s FOR UPDATE SKIP LOCKED
), later AS MATERIALIZED (
    SELECT id FROM {schema}.jobs
    WHERE state = 'scheduled' AND queue = %(queue)s AND created_at <= %(before)s::timestamptz
    LIMIT %(limit)s FOR UPDATE SKIP LOCKED
), deleted AS (
    DELETE FROM {schema}.jobs AS j
    WHERE j.id IN (SELECT id FROM due UNION ALL SELECT id FROM later)
      AND j.state IN ('pending', 'scheduled')
    RETURNING 1
), counted AS (
    UPDATE {schema}.audit
    SET detail = jsonb_set(detail, '{deleted}',
                           to_jsonb(coalesce((detail ->> 'deleted')::bigint, 0)
                                    + (SELECT count(*) FROM deleted)))
    WHERE id = %(audit_id)s
    RETURNING 1
)
SELECT (SELECT count(*) FROM deleted), (SELECT count(*) FROM counted);

-- name: queue_set_paused
-- Pause or resume a queue (job_claim skips paused queues), audited; resuming wakes its consumers.
-- An upsert: a queue known only from its jobs gets its row now. Unchanged -> no row returned by
-- the upsert, and the audit row says changed = false.
WITH changed AS (
    INSERT INTO {schema}.queues (name, paused) VALUES (%(name)s, %(paused)s)
    ON CONFLICT (name) DO UPDATE SET paused = EXCLUDED.paused
        WHERE {schema}.queues.paused IS DISTINCT FROM EXCLUDED.paused
    RETURNING name
), audited AS (
    INSERT INTO {schema}.audit (actor, action, target, detail)
    VALUES (%(actor)s, CASE WHEN %(paused)s::boolean THEN 'queue.pause' ELSE 'queue.resume' END,
            %(name)s,
            jsonb_build_object('via', %(via)s::text, 'changed', (SELECT count(*) FROM changed) > 0))
    RETURNING 1
), woken AS (
    SELECT pg_notify(%(channel)s, '0 ' || name) FROM changed WHERE NOT %(paused)s::boolean
)
SELECT (SELECT count(*) FROM changed), (SELECT count(*) FROM audited),
       (SELECT count(*) FROM woken);

-- name: queue_prune
-- Queues nobody uses any more, unused for %(idle)s seconds: every name a producer or a client
-- ever declared keeps its row in queues (and exchanges, bindings) otherwise -- reply queues
-- without x-expires, a script's throw-away names. Not paused (the operator's flag stays), no
-- living consumer, no pending, scheduled or dead job (running and finished jobs need no queue
-- row). Deleted with their bindings (cascade), then the exchanges as old left with no binding;
-- a queue or exchange declared again is created again. Audited when something went.
WITH idle AS MATERIALIZED (
    SELECT q.name FROM {schema}.queues AS q
    WHERE NOT q.paused
      AND q.last_used_at < now() - make_interval(secs => %(idle)s)
      AND NOT EXISTS (SELECT 1 FROM {schema}.consumers AS c WHERE q.name = ANY (c.queues))
      -- a state as a constant each: one probe of its partial index
      AND NOT EXISTS (SELECT 1 FROM {schema}.jobs AS j
                      WHERE j.state = 'pending' AND j.queue = q.name)
      AND NOT EXISTS (SELECT 1 FROM {schema}.jobs AS j
                      WHERE j.state = 'scheduled' AND j.queue = q.name)
      AND NOT EXISTS (SELECT 1 FROM {schema}.jobs AS j
                      WHERE j.state = 'dead' AND j.queue = q.name)
    ORDER BY q.last_used_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), queues_gone AS (
    DELETE FROM {schema}.queues WHERE name IN (SELECT name FROM idle)
    RETURNING name
), exchanges_gone AS (
    -- (the cascade's deletions are not visible in this statement's snapshot: hence NOT IN)
    DELETE FROM {schema}.exchanges AS e
    WHERE e.created_at < now() - make_interval(secs => %(idle)s)
      AND NOT EXISTS (SELECT 1 FROM {schema}.bindings AS b
                      WHERE b.exchange = e.name
                        AND b.queue NOT IN (SELECT name FROM queues_gone))
    RETURNING name
), audited AS (
    INSERT INTO {schema}.audit (actor, action, target, detail)
    SELECT %(actor)s, 'queue.prune', NULL,
           jsonb_build_object('via', %(via)s::text, 'idle', %(idle)s::float8,
                              'queues', (SELECT count(*) FROM queues_gone),
                              'exchanges', (SELECT count(*) FROM exchanges_gone))
    WHERE EXISTS (SELECT 1 FROM queues_gone) OR EXISTS (SELECT 1 FROM exchanges_gone)
)
SELECT (SELECT count(*) FROM queues_gone), (SELECT count(*) FROM exchanges_gone);
