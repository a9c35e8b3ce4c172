-- pgbroker's queries: named blocks, loaded once by pgbroker/_pg/store.py.
-- {schema} is the quoted schema name; every value is a bound parameter.
-- The sweeper's statements measure their horizons (lease, expiry, due time, retention) from
-- %(now)s, the time its pass acts at (Sweeper.run_once(now=...)); NULL is the database's now().
-- What they write (updated_at) always keeps the real clock.

-- name: job_insert
-- One message. The NOTIFY goes out in the same transaction, so it is delivered only on commit,
-- and only when a row was really inserted. Its payload is a wake-up, never the message:
-- "<seconds until due> <queue>". A duplicate -- the same (task, idempotency_key), the same
-- (task, dedupe_key) while a copy holds its slot (jobs_dedupe_idx), or the same message
-- (task_id, queue, message_digest: a producer's own retry of one publish) -- inserts nothing,
-- wakes nobody and returns no row; the caller then runs job_enqueued_ids, which counts it and
-- names the job it duplicates.
WITH keys AS MATERIALIZED (
    -- the job keys of the headers (checked at publish: pgbroker._model.keys)
    SELECT %(headers)s::jsonb ->> 'dedupe_key' AS dedupe_key,
           coalesce((%(headers)s::jsonb ->> 'dedupe_active')::boolean, false) AS dedupe_active,
           %(headers)s::jsonb ->> 'concurrency_key' AS concurrency_key,
           (%(headers)s::jsonb ->> 'concurrency_limit')::int AS concurrency_limit
), inserted AS (
    INSERT INTO {schema}.jobs (id, queue, task, task_id, retries, exchange, routing_key, body,
                               content_type, content_encoding, headers, properties, state,
                               priority, max_attempts, run_at, expires_at, idempotency_key,
                               message_digest, dedupe_key, dedupe_active, concurrency_key,
                               concurrency_limit, task_paused)
    SELECT %(id)s, %(queue)s, %(task)s, %(task_id)s, %(retries)s, %(exchange)s, %(routing_key)s,
           %(body)s, %(content_type)s, %(content_encoding)s, %(headers)s, %(properties)s,
           CASE WHEN %(run_at)s::timestamptz > now() THEN 'scheduled' ELSE 'pending' END,
           %(priority)s, %(max_attempts)s, COALESCE(%(run_at)s::timestamptz, now()),
           -- the queue's x-message-ttl, if declared, bounds the message's own expiry
           least(%(expires_at)s::timestamptz,
                 (SELECT now() + make_interval(secs => (q.arguments->>'x-message-ttl')::float8
                                                      / 1000)
                  FROM {schema}.queues AS q WHERE q.name = %(queue)s)),
           %(idempotency_key)s, %(message_digest)s,
           -- (a Celery retry takes the slot over from its own copy, or is queued without it
           -- when another copy holds it: the trigger jobs_dedupe_handover, 0012)
           k.dedupe_key, k.dedupe_key IS NOT NULL AND k.dedupe_active, k.concurrency_key,
           CASE WHEN k.concurrency_key IS NOT NULL THEN coalesce(k.concurrency_limit, 1) END,
           -- a job of a paused task name waits out of the claim's way (0011_task_pause_index.sql)
           coalesce(%(task)s::text = ANY (ARRAY(SELECT tp.task FROM {schema}.task_pauses AS tp)),
                    false)
    FROM keys AS k
    -- a message whose job has finished (jobs_done: no unique index spans the partitions,
    -- 0020_finished_partition.sql); jobs_live's unique indexes skip the rest
    WHERE cardinality({schema}.jobs_finished_ids(
              ARRAY[%(id)s::uuid], ARRAY[%(task_id)s::text], ARRAY[%(queue)s::text],
              ARRAY[%(message_digest)s::bytea])) = 0
    ON CONFLICT DO NOTHING
    RETURNING queue, run_at, priority
)
-- (the payload names the job's place in the claim's order: 0014_claim_cursor.sql)
SELECT pg_notify(%(channel)s, {schema}.jobs_wake_payload(extract(epoch FROM run_at - now()),
                                                         priority, run_at, queue))
FROM inserted;

-- name: job_insert_dead
-- A message no queue is bound for, published without mandatory: AMQP drops it, and the producer
-- hears nothing. Nothing published may vanish here, so it is kept as a dead letter of the queue
-- 'pgbroker.unroutable' (transport.UNROUTABLE) that says why, where an operator sees it; no
-- NOTIFY, nobody is to run it. (No idempotency key: it must not swallow a later publish that
-- finds its queue.) A duplicate inserts nothing, as in job_insert.
INSERT INTO {schema}.jobs (id, queue, task, task_id, retries, exchange, routing_key, body,
                           content_type, content_encoding, headers, properties, state, priority,
                           max_attempts, expires_at, message_digest, last_error)
SELECT %(id)s, %(queue)s, %(task)s, %(task_id)s, %(retries)s, %(exchange)s, %(routing_key)s,
        %(body)s, %(content_type)s, %(content_encoding)s, %(headers)s, %(properties)s, 'dead',
        %(priority)s, %(max_attempts)s, %(expires_at)s, %(message_digest)s, %(error)s
-- (the same message in either partition: jobs_done's index on it is not unique, 0020)
WHERE cardinality({schema}.jobs_finished_ids(
          ARRAY[%(id)s::uuid], ARRAY[%(task_id)s::text], ARRAY[%(queue)s::text],
          ARRAY[%(message_digest)s::bytea], true)) = 0
ON CONFLICT DO NOTHING;

-- name: job_insert_many
-- Many messages in one statement (UNNEST of column arrays): one round trip per batch, and one
-- NOTIFY per queue rather than per message (NOTIFY takes a global lock at commit). Returns a
-- NULL per NOTIFY and the id made for each message that was a duplicate (see job_insert): the
-- caller runs job_enqueued_ids for those.
WITH m AS (
    SELECT *
    FROM unnest(%(id)b::uuid[], %(queue)b::text[], %(task)b::text[], %(task_id)b::text[],
                %(retries)b::int[], %(exchange)b::text[], %(routing_key)b::text[],
                %(body)b::bytea[], %(content_type)b::text[], %(content_encoding)b::text[],
                %(headers)b::jsonb[], %(properties)b::jsonb[], %(priority)b::smallint[],
                %(max_attempts)b::int[], %(run_at)b::timestamptz[], %(expires_at)b::timestamptz[],
                %(idempotency_key)b::text[], %(message_digest)b::bytea[])
         AS m(id, queue, task, task_id, retries, exchange, routing_key, body, content_type,
              content_encoding, headers, properties, priority, max_attempts, run_at,
              expires_at, idempotency_key, message_digest)
), inserted AS (
    -- (the job keys as in job_insert, a retry's hand-over included)
    INSERT INTO {schema}.jobs (id, queue, task, task_id, retries, exchange, routing_key, body,
                               content_type, content_encoding, headers, properties, state,
                               priority, max_attempts, run_at, expires_at, idempotency_key,
                               message_digest, dedupe_key, dedupe_active, concurrency_key,
                               concurrency_limit, task_paused)
    SELECT id, queue, task, task_id, retries, exchange, routing_key, body,
           content_type, content_encoding, headers, properties,
           CASE WHEN run_at > now() THEN 'scheduled' ELSE 'pending' END,
           priority, max_attempts, COALESCE(run_at, now()),
           -- the queue's x-message-ttl, if declared, bounds the message's own expiry
           least(expires_at, (SELECT now() + make_interval(
                                  secs => (q.arguments->>'x-message-ttl')::float8 / 1000)
                              FROM {schema}.queues AS q WHERE q.name = m.queue)),
           idempotency_key, message_digest, headers ->> 'dedupe_key',
           headers ->> 'dedupe_key' IS NOT NULL
               AND coalesce((headers ->> 'dedupe_active')::boolean, false),
           headers ->> 'concurrency_key',
           CASE WHEN headers ->> 'concurrency_key' IS NOT NULL
                THEN coalesce((headers ->> 'concurrency_limit')::int, 1) END,
           -- a job of a paused task name waits out of the claim's way (as in job_insert)
           coalesce(task = ANY (ARRAY(SELECT tp.task FROM {schema}.task_pauses AS tp)), false)
    FROM m
    -- (a message whose job has finished: as in job_insert; one call for the batch)
    WHERE m.id <> ALL ((SELECT {schema}.jobs_finished_ids(%(id)b::uuid[], %(task_id)b::text[],
                                                           %(queue)b::text[],
                                                           %(message_digest)b::bytea[]))::uuid[])
    ON CONFLICT DO NOTHING
    RETURNING id, queue, run_at, priority
), notified AS (
    -- the lowest place in the claim's order of each queue's new jobs: the highest priority and
    -- the earliest run_at (a bound below every one of them: 0014_claim_cursor.sql)
    SELECT pg_notify(%(channel)s, {schema}.jobs_wake_payload(
               extract(epoch FROM min(run_at) - now()), max(priority), min(run_at), queue))
    FROM inserted GROUP BY queue
)
SELECT NULL::uuid AS skipped FROM notified
UNION ALL
SELECT m.id FROM m WHERE NOT EXISTS (SELECT 1 FROM inserted AS i WHERE i.id = m.id);

-- name: job_claim
-- Acknowledge the consumer's finished deliveries and take up to 'limit' due jobs of one queue,
-- in one statement: one round trip and one commit per event-loop turn instead of two.
-- A gated queue -- one that has held a job with a concurrency key, or any queue while a rate
-- limit exists (gated_queues, filled by triggers: 0010_job_keys.sql) -- is claimed by job_claim_gated instead:
-- here it yields no job, only a marker row (id NULL) that tells the consumer so
-- (pgbroker._consume.claim_policy.ClaimPolicy); its acks are made all the same. The gate is read in this
-- statement's snapshot, as its candidates are: a keyed job it could see, it sees gated.
WITH candidates AS MATERIALIZED (
    -- MATERIALIZED: an optimisation fence, so the planner cannot fold this into the UPDATE and
    -- lock (or claim) more rows than the LIMIT. SKIP LOCKED: concurrent consumers take different
    -- rows instead of queueing behind each other. The partial index jobs_claim_idx serves the
    -- WHERE and the ORDER BY, so the cost is the batch, not the table.
    SELECT id
    FROM {schema}.jobs
    -- (queue, task_paused) lead jobs_claim_idx: a paused task's waiting jobs (task_paused,
    -- 0011_task_pause_index.sql) are never walked past, however many there are
    WHERE state = 'pending' AND queue = %(queue)s AND NOT task_paused
      -- a paused queue is not claimed (one primary-key probe, evaluated once per statement)
      AND NOT EXISTS (SELECT 1 FROM {schema}.queues AS p WHERE p.name = %(queue)s AND p.paused)
      -- a paused task name is not claimed either. Its jobs are out of the walk (task_paused);
      -- this filter stops the few that are not: put back pending after the pause (a rescued or
      -- requeued delivery) or inserted by a transaction that began before it. The paused names
      -- are read once per statement (an InitPlan: task_pauses has a few rows, usually none)
      -- and tested as a filter, so the claim stays an ordered walk of jobs_claim_idx.
      -- coalesce(): NULL (plain kombu) is never paused, and an expression has no statistics --
      -- on task's own, a queue of one task name made "task <> (a name)" look like it matches
      -- nothing, and the claim was planned as a bitmap scan and a sort of the whole backlog (as
      -- was a NOT EXISTS)
      AND coalesce(task, '') <> ALL (ARRAY(SELECT tp.task FROM {schema}.task_pauses AS tp))
      -- nor a gated one: its row in gated_queues, or '' (no queue's name: a rate limit
      -- exists). A scan of that small table (no index: see 0010_job_keys.sql), evaluated once
      -- per statement, as the marker's below (a CTE read by both measured slower). The key
      -- test is belt and braces.
      AND NOT EXISTS (SELECT 1 FROM {schema}.gated_queues AS g
                      WHERE g.name = ANY (ARRAY[%(queue)s, '']))
      AND concurrency_key IS NULL
      -- an expired message is never delivered (the sweeper marks it 'expired'), and must not
      -- use up the LIMIT either
      AND (expires_at IS NULL OR expires_at > now())
      -- The walk starts after the consumer's cursor, an index condition: the entries behind it
      -- -- the rows claimed before, whose dead versions VACUUM may not be allowed to remove --
      -- are never read again (0014_claim_cursor.sql; pgbroker._consume.claim_policy.ClaimPolicy). The head
      -- of the queue is (-256, '0001-01-01', the nil uuid).
      AND (-priority, run_at, id) > (%(after_priority)s::smallint, %(after_run_at)s::timestamptz,
                                     %(after_id)s::uuid)
    ORDER BY -priority, run_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), updated AS (
    -- The claimed candidates and the acked deliveries in one UPDATE: PostgreSQL prepares a
    -- modified table's CHECK constraints and index predicates once per UPDATE it executes, so
    -- one UPDATE instead of two is measurably cheaper (docs/benchmarks.md).
    -- = ANY(...), not a join: with statistics that still see an empty table (a drained queue
    -- before the next ANALYZE), a cached join plan walked all of jobs_pkey (9-15 ms per claim).
    UPDATE {schema}.jobs AS j
    -- A row updated here is 'pending' only if it is a candidate (locked above, so unchanged);
    -- an acked one is 'running' (and ends as job_ack says).
    SET state = CASE WHEN j.state = 'pending' THEN 'running'
                     WHEN j.cancelled_attempt = j.attempts THEN 'cancelled'
                     WHEN j.failed_attempt = j.attempts THEN 'dead' ELSE 'completed' END,
        -- an attempt is spent at claim: a job that kills its worker has used it up, so a
        -- poison job cannot loop
        attempts = CASE WHEN j.state = 'pending' THEN j.attempts + 1 ELSE j.attempts END,
        -- the claim's time stays at the ack: the admin page's run times (claim -> ack)
        locked_at = CASE WHEN j.state = 'pending' THEN now() ELSE j.locked_at END,
        locked_by = CASE WHEN j.state = 'pending' THEN %(consumer)s ELSE j.locked_by END,
        updated_at = now()
    FROM (SELECT ARRAY(SELECT id FROM candidates) AS ids) AS c
    WHERE j.id = ANY(c.ids || %(ids)s::uuid[])
      -- (jobs_live alone: a pending candidate or a running delivery, 0020)
      AND j.state IN ('pending', 'running')
      AND (j.id = ANY(c.ids)
           -- an ack: the same rule as job_ack (only that delivery, only while it runs)
           OR (j.state = 'running'
               AND j.attempts = (%(attempts)s::int[])[array_position(%(ids)s::uuid[], j.id)]))
    RETURNING j.id, j.queue, j.attempts, j.priority, j.run_at, j.exchange, j.routing_key, j.body,
              j.content_type, j.content_encoding, j.headers, j.properties, j.state, j.task,
              j.last_error
), streak_ended AS (
    -- a delivery that completed ends its task's streak of lost deliveries (tasks.sql)
    DELETE FROM {schema}.task_losses
    WHERE task IN (SELECT task FROM updated WHERE state = 'completed')
)
-- the claimed rows, and the acked ones that ended dead (for pgbroker.signals.job_dead)
SELECT id, queue, attempts, priority, run_at, exchange, routing_key, body,
       content_type, content_encoding, headers, properties, state, task, last_error
FROM updated
WHERE state IN ('running', 'dead')
UNION ALL
-- the marker: this queue is gated
SELECT NULL, %(queue)s, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
       NULL
WHERE EXISTS (SELECT 1 FROM {schema}.gated_queues AS g WHERE g.name = ANY (ARRAY[%(queue)s, '']));


-- name: job_claim_gated
-- Acknowledge the consumer's finished deliveries and take up to 'limit' due jobs of one queue,
-- in one statement: one round trip and one commit per event-loop turn instead of two.
-- The claim of a gated queue (see job_claim, which claims the others).
-- A job with a concurrency key is claimed only into a free slot of its key, a job of a
-- rate-limited task only within its task's free starts (the others deferred, 'scheduled' until a
-- start frees): jobs_gate decides, called only when such a candidate is met; the rest flow past
-- them (0010_job_keys.sql).
WITH acking AS MATERIALIZED (
    -- The keyed deliveries this statement acks, per key: their slots are free by its end (the
    -- release trigger), so the candidates' filter counts them free already. Read only when a
    -- keyed candidate is met: nothing for unkeyed queues. (A primary-key probe per ack, LIMIT 1
    -- keeping it one, the state tested outside: planned as a join, or with the state inside,
    -- statistics that see an empty table walked a whole index; tests/bench/test_query_plans.py.)
    SELECT j.key, count(*) AS n
    FROM unnest(%(ids)s::uuid[], %(attempts)s::int[]) AS d(id, attempt)
    CROSS JOIN LATERAL (SELECT r.concurrency_key AS key, r.state, r.attempts
                        FROM {schema}.jobs AS r WHERE r.id = d.id LIMIT 1) AS j
    WHERE j.state = 'running' AND j.attempts = d.attempt AND j.key IS NOT NULL
    GROUP BY j.key
), candidates AS MATERIALIZED (
    -- MATERIALIZED: an optimisation fence, so the planner cannot fold this into the UPDATE and
    -- lock (or claim) more rows than the LIMIT. SKIP LOCKED: concurrent consumers take different
    -- rows instead of queueing behind each other. The partial index jobs_claim_idx serves the
    -- WHERE and the ORDER BY, so the cost is the batch, not the table.
    SELECT id, task, concurrency_key
    FROM {schema}.jobs
    WHERE state = 'pending' AND queue = %(queue)s AND NOT task_paused  -- (as in job_claim)
      -- a paused queue is not claimed (one primary-key probe, evaluated once per statement)
      AND NOT EXISTS (SELECT 1 FROM {schema}.queues AS p WHERE p.name = %(queue)s AND p.paused)
      -- a paused task name is not claimed either (as in job_claim)
      AND coalesce(task, '') <> ALL (ARRAY(SELECT tp.task FROM {schema}.task_pauses AS tp))
      -- an expired message is never delivered (the sweeper marks it 'expired'), and must not
      -- use up the LIMIT either
      AND (expires_at IS NULL OR expires_at > now())
      -- a keyed job whose key has no free slot waits, passed over, without using up the LIMIT
      -- (a primary-key probe, for keyed rows only)
      AND (concurrency_key IS NULL
           OR NOT EXISTS (SELECT 1 FROM {schema}.concurrency_keys AS k
                          WHERE k.key = jobs.concurrency_key
                            AND k.running - coalesce((SELECT a.n FROM acking AS a
                                                      WHERE a.key = k.key), 0)
                                >= jobs.concurrency_limit))
    -- (jobs_claim_idx's order; always from the head: a keyed job passed over waits behind
    -- every cursor, so a gated queue keeps none)
    ORDER BY -priority, run_at, id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), gated AS MATERIALIZED (
    -- the candidates a key or a rate limit may hold back (usually none)
    SELECT ARRAY(SELECT c.id FROM candidates AS c
                 WHERE c.concurrency_key IS NOT NULL
                    OR c.task IN (SELECT r.task FROM {schema}.rate_limits AS r)) AS ids
), gate AS MATERIALIZED (
    -- which of them to claim (defer_at NULL), which to defer; the others stay pending
    SELECT g.gate_id, g.defer_at
    FROM gated, {schema}.jobs_gate(gated.ids, %(ids)s::uuid[], %(attempts)s::int[]) AS g
    WHERE cardinality(gated.ids) > 0
), chosen AS MATERIALIZED (
    SELECT id FROM candidates WHERE id <> ALL ((SELECT ids FROM gated)::uuid[])
    UNION ALL
    SELECT gate_id FROM gate WHERE defer_at IS NULL
), more AS MATERIALIZED (
    -- Candidates held back left room in the batch: fill it with free jobs past them. A short
    -- batch tells the consumer the queue is empty (it then waits for a NOTIFY), so without
    -- this the jobs behind waiting keyed ones would wait too. (LIMIT 0, no scan, when no
    -- candidate was gated.)
    SELECT id FROM {schema}.jobs
    WHERE state = 'pending' AND queue = %(queue)s AND NOT task_paused AND concurrency_key IS NULL
      AND NOT EXISTS (SELECT 1 FROM {schema}.queues AS p WHERE p.name = %(queue)s AND p.paused)
      AND coalesce(task, '') <> ALL (ARRAY(SELECT tp.task FROM {schema}.task_pauses AS tp))
      AND (expires_at IS NULL OR expires_at > now())
      AND id NOT IN (SELECT id FROM candidates)
      AND NOT EXISTS (SELECT 1 FROM {schema}.rate_limits AS r WHERE r.task = jobs.task)
    ORDER BY -priority, run_at, id
    LIMIT (SELECT CASE WHEN cardinality((SELECT ids FROM gated)) > 0 THEN %(limit)s - count(*)
                       ELSE 0 END
           FROM chosen)
    FOR UPDATE SKIP LOCKED
), updated AS (
    -- The claimed candidates and the acked deliveries in one UPDATE: PostgreSQL prepares a
    -- modified table's CHECK constraints and index predicates once per UPDATE it executes, so
    -- one UPDATE instead of two is measurably cheaper (docs/benchmarks.md).
    -- = ANY(...), not a join: with statistics that still see an empty table (a drained queue
    -- before the next ANALYZE), a cached join plan walked all of jobs_pkey (9-15 ms per claim).
    UPDATE {schema}.jobs AS j
    -- A row updated here is 'pending' only if it is a candidate (locked above, so unchanged);
    -- an acked one is 'running' (and ends as job_ack says).
    -- (A deferred candidate goes back to 'scheduled', due when its task may start again.)
    SET state = CASE WHEN j.id = ANY(c.deferred) THEN 'scheduled'
                     WHEN j.state = 'pending' THEN 'running'
                     WHEN j.cancelled_attempt = j.attempts THEN 'cancelled'
                     WHEN j.failed_attempt = j.attempts THEN 'dead' ELSE 'completed' END,
        -- an attempt is spent at claim: a job that kills its worker has used it up, so a
        -- poison job cannot loop
        attempts = CASE WHEN j.id = ANY(c.ids) THEN j.attempts + 1 ELSE j.attempts END,
        -- the claim's time stays at the ack: the admin page's run times (claim -> ack)
        locked_at = CASE WHEN j.id = ANY(c.ids) THEN now() ELSE j.locked_at END,
        locked_by = CASE WHEN j.id = ANY(c.ids) THEN %(consumer)s ELSE j.locked_by END,
        run_at = CASE WHEN j.id = ANY(c.deferred)
                      THEN c.defer_at[array_position(c.deferred, j.id)] ELSE j.run_at END,
        updated_at = now()
    FROM (SELECT ARRAY(SELECT id FROM chosen UNION ALL SELECT id FROM more) AS ids,
                 ARRAY(SELECT gate_id FROM gate WHERE defer_at IS NOT NULL) AS deferred,
                 ARRAY(SELECT defer_at FROM gate WHERE defer_at IS NOT NULL) AS defer_at) AS c
    WHERE j.id = ANY(c.ids || c.deferred || %(ids)s::uuid[])
      AND (j.id = ANY(c.ids) OR j.id = ANY(c.deferred)
           -- an ack: the same rule as job_ack (only that delivery, only while it runs)
           OR (j.state = 'running'
               AND j.attempts = (%(attempts)s::int[])[array_position(%(ids)s::uuid[], j.id)]))
    RETURNING j.id, j.queue, j.attempts, j.priority, j.run_at, j.exchange, j.routing_key, j.body,
              j.content_type, j.content_encoding, j.headers, j.properties, j.state, j.task,
              j.last_error
), streak_ended AS (
    -- a delivery that completed ends its task's streak of lost deliveries (tasks.sql)
    DELETE FROM {schema}.task_losses
    WHERE task IN (SELECT task FROM updated WHERE state = 'completed')
)
-- the claimed rows (not the deferred), and the acked ones that ended dead (as in job_claim)
SELECT id, queue, attempts, priority, run_at, exchange, routing_key, body,
       content_type, content_encoding, headers, properties, state, task, last_error
FROM updated
WHERE state IN ('running', 'dead');

-- name: job_ack
-- Completion of deliveries, each identified by (id, attempt): a late ack of an older delivery of
-- a job that was redelivered meanwhile matches no row and changes nothing. Celery acks a task
-- that raised (task_acks_on_failure_or_timeout): the failure hook recorded that attempt in
-- failed_attempt, so it ends 'dead' with its error -- a dead letter, not a silent 'completed'.
-- A job revoked while it was claimed (job_revoke) ends 'cancelled' only if its worker carried the
-- revoke out -- discarded it, or terminated it (job_stopped, sql/endings.sql) --, else as its
-- task ended it: a pool that cannot terminate (threads) runs it to its end.
-- Never waits for a row another session has locked (an open transaction in psql, say): such a
-- delivery is returned as not done, and the consumer tries it again later; the others are acked
-- now. (The claim folds acks into one statement without this; see Store.claim.)
WITH due AS MATERIALIZED (
    -- the deliveries still to ack, read without locking (a locked row is read as committed): a
    -- primary-key probe each (LIMIT 1 keeps it one, the state tested outside it). Planned as a
    -- join with the state inside, this walked jobs_running_idx whole, the dead entries a held
    -- snapshot keeps there included: 7 ms and 10,769 blocks an ack after 5 minutes of one at
    -- 250 jobs/s (docs/benchmarks.md, issue 26)
    SELECT j.id, j.attempts
    FROM unnest(%(ids)s::uuid[], %(attempts)s::int[]) AS d(id, attempt)
    CROSS JOIN LATERAL (SELECT r.id, r.attempts, r.state FROM {schema}.jobs AS r
                        WHERE r.id = d.id AND r.state IN ('scheduled', 'pending', 'running')
                        LIMIT 1) AS j
    WHERE j.state = 'running' AND j.attempts = d.attempt
), taken AS MATERIALIZED (
    -- Locked by primary key, the state tested again under the lock (a row settled meanwhile is
    -- left alone). coalesce(): a bare `state = 'running'` lets the planner AND jobs_running_idx
    -- into the look-up, all its dead entries with it (52,001 read for one ack, as in due).
    SELECT j.id FROM {schema}.jobs AS j
    WHERE j.id = ANY (ARRAY(SELECT id FROM due)) AND coalesce(j.state, '') = 'running'
      AND j.state IN ('scheduled', 'pending', 'running')  -- jobs_live (0020)
    FOR UPDATE SKIP LOCKED
), acked AS (
    -- = ANY(...), not a join with taken: planned as a join, the generic plan a worker's
    -- connection caches read all of jobs_live for every ack once a held snapshot kept its dead
    -- versions (2.9 ms and 3,296 buffers an ack under four readers: docs/benchmarks.md)
    UPDATE {schema}.jobs AS j
    -- (locked_at, the claim's time, stays: the admin page's run times are claim -> ack)
    SET state = CASE WHEN j.cancelled_attempt = j.attempts THEN 'cancelled'
                     WHEN j.failed_attempt = j.attempts THEN 'dead' ELSE 'completed' END,
        updated_at = now()
    WHERE j.id = ANY (ARRAY(SELECT id FROM taken))
      AND j.state IN ('scheduled', 'pending', 'running')
    RETURNING j.id, j.state, j.task, j.last_error
), streak_ended AS (
    -- a delivery that completed ends its task's streak of lost deliveries (tasks.sql)
    DELETE FROM {schema}.task_losses
    WHERE task IN (SELECT task FROM acked WHERE state = 'completed')
)
-- every delivery found to ack, and whether it was (false: its row is locked, try again); its
-- state now, task and error (one that ended dead: pgbroker.signals.job_dead)
SELECT d.id, d.attempts, a.id IS NOT NULL, a.state, a.task, a.last_error
FROM due AS d LEFT JOIN acked AS a ON a.id = d.id;

-- name: job_ack_delete
-- Retention 0: an acked delivery is deleted at once -- unless its task failed (kept, 'dead') or
-- it was revoked (kept until the next prune, ended as job_ack would end it: its worker's report
-- that it stopped it, job_stopped, may come after this ack). Locked rows as in job_ack.
WITH due AS MATERIALIZED (
    -- (primary-key probes, as in job_ack)
    SELECT j.id, j.attempts
    FROM unnest(%(ids)s::uuid[], %(attempts)s::int[]) AS d(id, attempt)
    CROSS JOIN LATERAL (SELECT r.id, r.attempts, r.state FROM {schema}.jobs AS r
                        WHERE r.id = d.id AND r.state IN ('scheduled', 'pending', 'running')
                        LIMIT 1) AS j
    WHERE j.state = 'running' AND j.attempts = d.attempt
), taken AS MATERIALIZED (
    SELECT j.id, j.failed_attempt IS DISTINCT FROM j.attempts AND j.revoked_at IS NULL AS done
    FROM {schema}.jobs AS j
    WHERE j.id = ANY (ARRAY(SELECT id FROM due)) AND coalesce(j.state, '') = 'running'
      AND j.state IN ('scheduled', 'pending', 'running')  -- jobs_live (0020)
    FOR UPDATE SKIP LOCKED
), deleted AS (
    -- (= ANY(...), not a join: as in job_ack)
    DELETE FROM {schema}.jobs AS j
    WHERE j.id = ANY (ARRAY(SELECT id FROM taken WHERE done))
      AND j.state IN ('scheduled', 'pending', 'running')
    RETURNING j.id, 'completed'::text AS state, j.task, j.last_error
), kept AS (
    UPDATE {schema}.jobs AS j
    SET state = CASE WHEN j.cancelled_attempt = j.attempts THEN 'cancelled'
                     WHEN j.failed_attempt = j.attempts THEN 'dead' ELSE 'completed' END,
        updated_at = now()
    WHERE j.id = ANY (ARRAY(SELECT id FROM taken WHERE NOT done))
      AND j.state IN ('scheduled', 'pending', 'running')
    RETURNING j.id, j.state, j.task, j.last_error
), streak_ended AS (
    -- a delivery that completed ends its task's streak of lost deliveries (tasks.sql)
    DELETE FROM {schema}.task_losses WHERE task IN (SELECT task FROM deleted)
)
SELECT d.id, d.attempts, a.id IS NOT NULL, a.state, a.task, a.last_error
FROM due AS d
LEFT JOIN (SELECT * FROM deleted UNION ALL SELECT * FROM kept) AS a ON a.id = d.id;

-- name: job_fail
-- The task of this delivery raised (recorded from the worker process that ran it, before the
-- ack): its error and traceback, and which attempt failed. Not a delivery its task completed
-- itself in its own transaction (job_complete): what it committed stands.
WITH found AS MATERIALIZED (
    -- (waits for a lock on the row: the ack must not pass it)
    SELECT id, state FROM {schema}.jobs
    -- (and a delivery Celery already rejected: the reason replaces the generic one)
    WHERE id = %(id)s AND attempts = %(attempt)s AND state IN ('running', 'completed', 'dead')
      AND completed_attempt IS DISTINCT FROM attempts
    FOR UPDATE
), failed AS (
    UPDATE {schema}.jobs AS j
    SET last_error = %(error)s, last_traceback = %(traceback)s, failed_attempt = j.attempts,
        -- acked on receipt (acks_late off), the row is already 'completed': it failed after all
        state = CASE WHEN j.state = 'completed' THEN 'dead' ELSE j.state END,
        updated_at = now()
    FROM found WHERE j.id = found.id
    RETURNING j.task, j.last_error, j.attempts, found.state = 'completed' AS died
)
-- died: it ended dead here (pgbroker.signals.job_dead)
SELECT task, last_error, attempts, died FROM failed;

-- name: job_requeue
-- A delivery given back (reject with requeue, shutdown with prefetched messages, recover): the
-- same row goes back to 'pending' -- never a re-insert, which an idempotency key would swallow.
-- Out of attempts, it goes 'dead' instead of looping; revoked while claimed, 'cancelled'. Locked
-- rows as in job_ack.
WITH due AS MATERIALIZED (
    -- (primary-key probes, as in job_ack)
    SELECT j.id, j.attempts
    FROM unnest(%(ids)s::uuid[], %(attempts)s::int[]) AS d(id, attempt)
    CROSS JOIN LATERAL (SELECT r.id, r.attempts, r.state FROM {schema}.jobs AS r
                        WHERE r.id = d.id AND r.state IN ('scheduled', 'pending', 'running')
                        LIMIT 1) AS j
    WHERE j.state = 'running' AND j.attempts = d.attempt
), taken AS MATERIALIZED (
    SELECT j.id FROM {schema}.jobs AS j
    WHERE j.id = ANY (ARRAY(SELECT id FROM due)) AND coalesce(j.state, '') = 'running'
      AND j.state IN ('scheduled', 'pending', 'running')  -- jobs_live (0020)
    FOR UPDATE SKIP LOCKED
), requeued AS (
    UPDATE {schema}.jobs
    SET state = CASE WHEN jobs.revoked_at IS NOT NULL THEN 'cancelled'
                     WHEN jobs.attempts >= jobs.max_attempts THEN 'dead' ELSE 'pending' END,
        last_error = CASE WHEN jobs.revoked_at IS NOT NULL THEN jobs.last_error
                          WHEN jobs.attempts >= jobs.max_attempts
                          THEN format('max attempts (%%s) reached; last: %%s', jobs.max_attempts,
                                      coalesce(%(error)s::text, 'requeued by the consumer'))
                          ELSE coalesce(%(error)s::text, jobs.last_error) END,
        locked_at = NULL, locked_by = NULL, updated_at = now()
    -- (= ANY(...), not a join: as in job_ack)
    WHERE jobs.id = ANY (ARRAY(SELECT id FROM taken))
      AND jobs.state IN ('scheduled', 'pending', 'running')
    RETURNING jobs.id, jobs.queue, jobs.state, jobs.task, jobs.last_error, jobs.priority,
              jobs.run_at
), woken AS (
    -- (back behind the consumers' cursors: the payload says where, 0014_claim_cursor.sql)
    SELECT pg_notify(%(channel)s, {schema}.jobs_wake_payload(0, max(priority), min(run_at), queue))
    FROM requeued WHERE state = 'pending' GROUP BY queue
)
SELECT d.id, d.attempts, r.id IS NOT NULL, r.state, r.task, r.last_error
FROM due AS d LEFT JOIN requeued AS r ON r.id = d.id
WHERE (SELECT count(*) FROM woken) >= 0;  -- (evaluates the NOTIFYs)

-- name: job_bury
-- A delivery that must not run again (reject without requeue, undecodable): 'dead', with why --
-- the task's own error when this attempt raised, else the transport's reason. Revoked while
-- claimed: 'cancelled', with the same reason (a revoked job is never a dead letter to retry).
-- Locked rows as in job_ack.
WITH due AS MATERIALIZED (
    -- (coalesce(): a primary-key probe, as in job_ack)
    SELECT j.id, j.attempts FROM {schema}.jobs AS j
    WHERE j.id = %(id)s AND j.attempts = %(attempt)s AND coalesce(j.state, '') = 'running'
      AND j.state IN ('scheduled', 'pending', 'running')  -- jobs_live (0020)
), taken AS MATERIALIZED (
    SELECT j.id FROM {schema}.jobs AS j
    WHERE j.id = ANY (ARRAY(SELECT id FROM due)) AND coalesce(j.state, '') = 'running'
      AND j.state IN ('scheduled', 'pending', 'running')  -- jobs_live (0020)
    FOR UPDATE SKIP LOCKED
), buried AS (
    UPDATE {schema}.jobs AS j
    SET state = CASE WHEN j.revoked_at IS NOT NULL THEN 'cancelled' ELSE 'dead' END,
        last_error = CASE WHEN j.failed_attempt = j.attempts THEN j.last_error
                          ELSE %(error)s END,
        locked_at = NULL, locked_by = NULL, updated_at = now()
    -- (= ANY(...), not a join: as in job_ack)
    WHERE j.id = ANY (ARRAY(SELECT id FROM taken))
      AND j.state IN ('scheduled', 'pending', 'running')
    RETURNING j.id, j.state, j.task, j.last_error
)
SELECT d.id, d.attempts, b.id IS NOT NULL, b.state, b.task, b.last_error
FROM due AS d LEFT JOIN buried AS b ON b.id = d.id;

-- name: job_promote
-- Scheduled jobs that are due become claimable. Several consumers may run this at once: SKIP
-- LOCKED and the state test make it idempotent. Wakes the consumers of the promoted queues.
-- A consumer's promotions start where its last one ended (%(after)s, an index condition, as the
-- claim's cursor: 0014_claim_cursor.sql): the rows it promoted before, whose 'scheduled'
-- versions a held snapshot keeps in jobs_scheduled_idx, are not walked again. It says where the
-- next one may start (reached): its own time when it took all that was due, else the last
-- run_at it took. A row that becomes due behind that place (a transaction that committed late)
-- names its run_at in its NOTIFY; the sweeper's job_promote_all walks every queue from the start.
WITH due AS MATERIALIZED (
    SELECT id FROM {schema}.jobs
    WHERE state = 'scheduled' AND queue = ANY(%(queues)s) AND run_at <= now()
      AND run_at >= %(after)s::timestamptz
    ORDER BY queue, run_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), promoted AS (
    UPDATE {schema}.jobs AS j SET state = 'pending', updated_at = now()
    FROM due WHERE j.id = due.id AND j.state = 'scheduled'
    RETURNING j.queue, j.priority, j.run_at
), woken AS (
    -- (due since run_at: behind the consumers' cursors, the payload says where)
    SELECT pg_notify(%(channel)s, {schema}.jobs_wake_payload(0, max(priority), min(run_at), queue))
    FROM promoted GROUP BY queue
)
SELECT (SELECT count(*) FROM promoted), (SELECT count(*) FROM woken),
       CASE WHEN (SELECT count(*) FROM due) < %(limit)s THEN now()
            ELSE (SELECT max(run_at) FROM promoted) END AS reached;

-- name: job_promote_all
-- The sweeper's promotion, for every queue (plain kombu consumers have no timers). It also
-- gives the claim back the jobs still marked task_paused whose task name is not paused any more
-- (0011_task_pause_index.sql): a transaction that began before a resume can insert them after
-- it. Counted with the promoted ones.
WITH RECURSIVE marked(task) AS (
    -- the task names of the marked jobs, one probe of jobs_task_paused_idx each (a loose index
    -- scan: the index holds every waiting job of a paused task, and usually nothing)
    -- (in jobs_live, 0020: a finished job's mark matters to no claim)
    (SELECT task FROM {schema}.jobs
     WHERE task_paused AND state IN ('scheduled', 'pending', 'running') ORDER BY task LIMIT 1)
    UNION ALL
    SELECT (SELECT j.task FROM {schema}.jobs AS j
            WHERE j.task_paused AND j.state IN ('scheduled', 'pending', 'running')
              AND j.task > m.task
            ORDER BY j.task LIMIT 1)
    FROM marked AS m WHERE m.task IS NOT NULL
), stale AS MATERIALIZED (
    SELECT id FROM {schema}.jobs
    WHERE task_paused AND state IN ('scheduled', 'pending', 'running')
      AND task IN (SELECT m.task FROM marked AS m WHERE m.task IS NOT NULL
                   AND NOT EXISTS (SELECT 1 FROM {schema}.task_pauses AS tp
                                   WHERE tp.task = m.task))
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), released AS (
    UPDATE {schema}.jobs AS j SET task_paused = false
    FROM stale
    WHERE j.id = stale.id AND j.task_paused AND j.state IN ('scheduled', 'pending', 'running')
    RETURNING j.queue, j.state
), due AS MATERIALIZED (
    SELECT id FROM {schema}.jobs
    WHERE state = 'scheduled' AND run_at <= coalesce(%(now)s::timestamptz, now())
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), promoted AS (
    UPDATE {schema}.jobs AS j SET state = 'pending', updated_at = now()
    FROM due WHERE j.id = due.id AND j.state = 'scheduled'
    RETURNING j.queue, j.priority, j.run_at
), woken AS (
    -- the promoted rows' place in the claim's order (0014_claim_cursor.sql); the released ones
    -- (rare) wake their consumers without one: a claim from the head
    SELECT pg_notify(%(channel)s, {schema}.jobs_wake_payload(0, max(priority), min(run_at), queue))
    FROM promoted GROUP BY queue
    UNION ALL
    SELECT pg_notify(%(channel)s, '0 ' || queue)
    FROM (SELECT DISTINCT queue FROM released WHERE state = 'pending') AS q
)
SELECT (SELECT count(*) FROM promoted) + (SELECT count(*) FROM released),
       (SELECT count(*) FROM woken);

-- name: job_next_due
-- Seconds until the earliest scheduled job of these queues is due (NULL: none). Measured by the
-- database clock, the only clock pgbroker trusts. From the consumer's promotion cursor on (see
-- job_promote): what is behind it was promoted, or is named by a NOTIFY.
SELECT extract(epoch FROM min(run_at) - now())::float8
FROM {schema}.jobs
WHERE state = 'scheduled' AND queue = ANY(%(queues)s) AND run_at >= %(after)s::timestamptz;

-- name: job_expire
-- Pending or scheduled messages past their expiry are never delivered: marked 'expired', so they
-- stay visible for the retention window instead of vanishing.
WITH gone AS MATERIALIZED (
    SELECT id FROM {schema}.jobs
    WHERE state IN ('pending', 'scheduled') AND expires_at IS NOT NULL
      AND expires_at <= coalesce(%(now)s::timestamptz, now())
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.jobs AS j
SET state = 'expired', last_error = 'expired before delivery', updated_at = now()
FROM gone WHERE j.id = gone.id AND j.state IN ('pending', 'scheduled');

-- name: job_rescue
-- Running jobs whose consumer is gone go back to 'pending' (or 'dead' when out of attempts;
-- 'cancelled' when revoked while claimed, so a revoked prefetched job never runs elsewhere).
-- A consumer is gone when its row is missing, its heartbeat is older than its lease (its own
-- lease_timeout, stored at registration; %(lease)s, the sweeper's, for a row of an older
-- pgbroker that has none), or (with
-- advisory locks) the lock its session held is no longer held: its connection died. A lock is
-- looked for only on the server instance the consumer registered on (server_started): after a
-- restart or a failover every consumer is reconnecting, and only its heartbeat can tell.
WITH gone AS MATERIALIZED (
    -- FOR UPDATE SKIP LOCKED: a consumer whose row another session holds locked is never
    -- declared gone meanwhile -- its heartbeat waits for that lock, and is the first to get it
    -- when it goes (the sweeper does not queue for it).
    SELECT c.id FROM {schema}.consumers AS c
    WHERE c.heartbeat_at < coalesce(%(now)s::timestamptz, now())
                           - make_interval(secs => coalesce(c.lease_timeout, %(lease)s))
       OR (c.lock_key IS NOT NULL AND c.server_started = pg_postmaster_start_time()
           AND NOT EXISTS (
              SELECT 1 FROM pg_locks AS l
              WHERE l.locktype = 'advisory' AND l.granted
                AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                AND l.classid = %(lock_class)s::oid AND l.objid = c.lock_key::oid
                AND l.objsubid = 2))
    FOR UPDATE SKIP LOCKED
), orphans AS MATERIALIZED (
    -- FOR UPDATE SKIP LOCKED with the state test: a job being acked right now is skipped, and
    -- one that completed between the read and the write is re-checked and left alone.
    SELECT j.id, j.attempts, j.locked_by FROM {schema}.jobs AS j
    WHERE j.state = 'running'
      AND (j.locked_by IN (SELECT id FROM gone)
           OR NOT EXISTS (SELECT 1 FROM {schema}.consumers AS c WHERE c.id = j.locked_by))
    LIMIT %(limit)s
    FOR UPDATE OF j SKIP LOCKED
), rescued AS (
    UPDATE {schema}.jobs AS j
    SET state = CASE WHEN j.revoked_at IS NOT NULL THEN 'cancelled'
                     WHEN j.attempts >= j.max_attempts THEN 'dead' ELSE 'pending' END,
        last_error = CASE WHEN j.revoked_at IS NOT NULL THEN j.last_error
                          WHEN j.attempts >= j.max_attempts
                          THEN format('max attempts (%%s) reached: its consumer was lost '
                                      '(worker killed or unreachable) during every attempt',
                                      j.max_attempts)
                          ELSE 'consumer lost while running; redelivered' END,
        locked_at = NULL, locked_by = NULL, updated_at = now()
    FROM orphans AS o
    -- conditional on the very delivery that was found orphaned
    WHERE j.id = o.id AND j.state = 'running' AND j.attempts = o.attempts
      AND j.locked_by IS NOT DISTINCT FROM o.locked_by
    RETURNING j.id, j.queue, j.state, j.task, j.attempts, j.last_error, j.priority, j.run_at,
              o.locked_by AS owner
), forgotten AS (
    DELETE FROM {schema}.consumers WHERE id IN (SELECT id FROM gone)
    RETURNING id
), woken AS (
    -- (back behind the consumers' cursors: the payload says where, 0014_claim_cursor.sql)
    SELECT pg_notify(%(channel)s, {schema}.jobs_wake_payload(0, max(priority), min(run_at), queue))
    FROM rescued WHERE state = 'pending' GROUP BY queue
)
SELECT (SELECT count(*) FROM rescued WHERE state = 'pending'),
       (SELECT count(*) FROM rescued WHERE state = 'dead'),
       (SELECT count(*) FROM forgotten),
       (SELECT count(*) FROM woken),
       -- the deliveries that lost their worker (tasks.sql: task_loss_record), and those of
       -- them that ended dead (pgbroker.signals.job_dead)
       ARRAY(SELECT id FROM rescued WHERE state <> 'cancelled' ORDER BY id),
       ARRAY(SELECT attempts FROM rescued WHERE state <> 'cancelled' ORDER BY id),
       (SELECT coalesce(jsonb_agg(jsonb_build_object('id', id, 'task', task, 'attempts', attempts,
                                                     'reason', last_error)), '[]'::jsonb)
        FROM rescued WHERE state = 'dead'),
       -- the host of each one's worker, NULL where it was told to stop or is unknown: a loss
       -- that points to no task (0019_loss_evidence.sql). (This query sees the consumers rows
       -- as they were before `forgotten` deleted them.)
       ARRAY(SELECT CASE WHEN c.stopping_at IS NULL THEN c.host END
             FROM rescued AS r LEFT JOIN {schema}.consumers AS c ON c.id = r.owner
             WHERE r.state <> 'cancelled' ORDER BY r.id);

-- name: job_prune
-- Finished rows past the retention window, oldest first, one small batch per statement so that
-- pruning never holds many locks or a long transaction.
-- SKIP LOCKED: a row another session holds locked is pruned by a later pass.
DELETE FROM {schema}.jobs
WHERE id IN (SELECT id FROM {schema}.jobs
             WHERE state IN ('completed', 'cancelled', 'expired')
               AND updated_at < coalesce(%(now)s::timestamptz, now())
                                - make_interval(secs => %(retention)s)
             ORDER BY updated_at
             LIMIT %(limit)s
             FOR UPDATE SKIP LOCKED);

-- name: queue_declare
-- The first declaration decides the queue's flags, as in AMQP (a row a binding created first,
-- or an older pgbroker, has none yet: they are filled in). A declared queue is in use (x-expires
-- counts from then). Never waits for another session's lock on an existing queue row (a pause
-- in an open transaction): every producer declares its queue before its first publish, which
-- must not wait; a locked row keeps its last_used_at and flags until the next declaration.
WITH touched AS (
    UPDATE {schema}.queues AS q
    SET last_used_at = now(), durable = coalesce(q.durable, %(durable)s),
        auto_delete = coalesce(q.auto_delete, %(auto_delete)s)
    WHERE q.name IN (SELECT name FROM {schema}.queues WHERE name = %(name)s
                     FOR NO KEY UPDATE SKIP LOCKED)
)
INSERT INTO {schema}.queues (name, arguments, durable, auto_delete)
SELECT %(name)s, %(arguments)s, %(durable)s, %(auto_delete)s
-- the plain read sees a locked row as committed: no insert, so no wait on the unique index
WHERE NOT EXISTS (SELECT 1 FROM {schema}.queues WHERE name = %(name)s)
ON CONFLICT (name) DO NOTHING;

-- name: queue_exists
SELECT EXISTS (SELECT 1 FROM {schema}.queues WHERE name = %(name)s)
    OR EXISTS (SELECT 1 FROM {schema}.jobs WHERE queue = %(name)s AND state = 'pending');

-- name: queue_size
-- Messages ready or waiting: what kombu's queue_declare reports as message_count.
SELECT count(*) FROM {schema}.jobs WHERE queue = %(name)s AND state IN ('pending', 'scheduled');

-- name: queue_purge
WITH purged AS (
    DELETE FROM {schema}.jobs WHERE queue = %(name)s AND state IN ('pending', 'scheduled')
    RETURNING 1
)
SELECT count(*) FROM purged;

-- name: queue_delete
WITH purged AS (
    DELETE FROM {schema}.jobs WHERE queue = %(name)s AND state IN ('pending', 'scheduled')
)
DELETE FROM {schema}.queues WHERE name = %(name)s;

-- name: consumer_register
-- Again after a reconnect: the lock (maybe another key) and the server instance are this
-- session's now (job_rescue). The consumer's own lease_timeout goes with it: every judge of its
-- heartbeat reads it there, not its own setting (0016_consumer_lease.sql); the heartbeat keeps it.
INSERT INTO {schema}.consumers (id, host, pid, queues, lock_key, server_started, lease_timeout)
VALUES (%(id)s, %(host)s, %(pid)s, %(queues)s, %(lock_key)s, pg_postmaster_start_time(),
        %(lease)s)
ON CONFLICT (id) DO UPDATE SET queues = EXCLUDED.queues, heartbeat_at = now(),
    lock_key = EXCLUDED.lock_key, server_started = EXCLUDED.server_started,
    lease_timeout = EXCLUDED.lease_timeout;

-- name: consumer_heartbeat
-- The lease. It writes the consumer's own row only, and never waits for another session's lock
-- on a queue row (a pause, an open transaction in psql): a living consumer must never look lost.
-- (A lock on its own row makes it wait, but then no sweeper declares it gone: job_rescue.)
WITH touched AS (
    -- consumed queues are in use: they never expire (x-expires) under a living consumer; a
    -- locked one is touched at the next beat (it cannot expire while consumed anyway)
    UPDATE {schema}.queues SET last_used_at = now()
    WHERE name IN (SELECT name FROM {schema}.queues WHERE name = ANY(%(queues)s)
                   FOR NO KEY UPDATE SKIP LOCKED)
)
UPDATE {schema}.consumers
SET heartbeat_at = now(), queues = %(queues)s,
    -- its settling statements that keep failing on a living connection (0017): since when
    -- (%(failing_for)s seconds ago by the worker's count, kept from the first beat that said
    -- so) and the last error; NULL once they are written again
    settle_failing_since = CASE WHEN %(failing_for)s::float8 IS NOT NULL
                                THEN coalesce(settle_failing_since,
                                              now() - make_interval(secs => %(failing_for)s))
                           END,
    settle_error = %(settle_error)s
WHERE id = %(id)s;

-- name: consumer_unregister
DELETE FROM {schema}.consumers WHERE id = %(id)s;

-- name: jobs_autovacuum
-- Whether autovacuum looks after the jobs to run (jobs_live, 0020): the server's settings and
-- the table's own.
SELECT current_setting('autovacuum')::boolean AND current_setting('track_counts')::boolean
       AND coalesce((SELECT option_value::boolean FROM pg_options_to_table(c.reloptions)
                     WHERE option_name = 'autovacuum_enabled'), true)
FROM pg_class AS c
WHERE c.oid = '{schema}.jobs_live'::regclass;

-- name: publish_duplicates_fold
-- The counter of duplicate publishes gets a row per statement that found some (job_enqueued_ids
-- appends, never updates): fold the rows of each queue that has several into one, so the
-- totals stay exact and the table one row per queue. SKIP LOCKED: several sweepers fold
-- different rows, each into a row of its own, and the next pass folds those.
WITH candidates AS MATERIALIZED (
    SELECT id FROM {schema}.publish_duplicates
    WHERE queue IN (SELECT queue FROM {schema}.publish_duplicates
                    GROUP BY queue HAVING count(*) > 1)
    ORDER BY id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), folded AS (
    DELETE FROM {schema}.publish_duplicates AS d USING candidates AS c WHERE d.id = c.id
    RETURNING d.queue, d.duplicates, d.at
), merged AS (
    INSERT INTO {schema}.publish_duplicates (queue, duplicates, at)
    SELECT queue, sum(duplicates), max(at) FROM folded GROUP BY queue
)
SELECT count(*) FROM folded;
