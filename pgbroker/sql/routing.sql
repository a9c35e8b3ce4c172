-- Exchanges, bindings and broadcasts (remote control, worker events). Loaded with queries.sql.

-- name: exchange_declare
-- Inserted only when absent (a plain read first), so another session's lock on the row never
-- holds up a producer's declaration (as queue_declare).
INSERT INTO {schema}.exchanges (name, type, durable, auto_delete, arguments)
SELECT %(name)s, %(type)s, %(durable)s, %(auto_delete)s, %(arguments)s
WHERE NOT EXISTS (SELECT 1 FROM {schema}.exchanges WHERE name = %(name)s)
ON CONFLICT (name) DO NOTHING;

-- name: exchange_type
SELECT type FROM {schema}.exchanges WHERE name = %(name)s;

-- name: exchange_delete
WITH unbound AS (DELETE FROM {schema}.bindings WHERE exchange = %(name)s)
DELETE FROM {schema}.exchanges WHERE name = %(name)s;

-- name: binding_declare
-- The queue row must exist (foreign key); declaring it here too makes the order of a client's
-- declarations irrelevant.
-- Each row is inserted only when absent (plain reads first), so another session's lock on an
-- existing queue or binding row never holds up a declaration (as queue_declare). The foreign
-- key's check takes a KEY SHARE lock on the queue row, which a lock of FOR NO KEY UPDATE
-- strength (any UPDATE of queues) does not conflict with.
WITH queue AS (
    INSERT INTO {schema}.queues (name)
    SELECT %(queue)s WHERE NOT EXISTS (SELECT 1 FROM {schema}.queues WHERE name = %(queue)s)
    ON CONFLICT (name) DO NOTHING
)
INSERT INTO {schema}.bindings (exchange, routing_key, queue)
SELECT %(exchange)s, %(routing_key)s, %(queue)s
WHERE NOT EXISTS (SELECT 1 FROM {schema}.bindings
                  WHERE exchange = %(exchange)s AND routing_key = %(routing_key)s
                    AND queue = %(queue)s)
ON CONFLICT DO NOTHING;

-- name: binding_delete
DELETE FROM {schema}.bindings
WHERE exchange = %(exchange)s AND routing_key = %(routing_key)s AND queue = %(queue)s;

-- name: binding_list
SELECT routing_key, queue FROM {schema}.bindings WHERE exchange = %(exchange)s;

-- name: broadcast_insert
-- One row for all the consumers, and a NOTIFY that names only the row and its exchange (so a
-- process with no queue bound to that exchange need not read it). ``queues``: the queues it is
-- for (NULL: every bound queue whose binding matches, as for worker events).
WITH inserted AS (
    INSERT INTO {schema}.broadcasts (id, exchange, routing_key, body, content_type,
                                     content_encoding, headers, properties, queues)
    VALUES (%(id)s, %(exchange)s, %(routing_key)s, %(body)s, %(content_type)s,
            %(content_encoding)s, %(headers)s, %(properties)s, %(queues)s)
    RETURNING id, exchange
)
SELECT pg_notify(%(channel)s, 'b ' || id::text || ' ' || exchange) FROM inserted;

-- name: job_fanout
-- A message to a fanout exchange, as AMQP delivers it: a job in every bound queue that was not
-- declared auto-delete (or exclusive), where it waits until consumed, with one NOTIFY per
-- queue; and one broadcast row for the auto-delete ones (Celery's mailboxes, Broadcast and
-- event queues, which exist only while consumed), read by the consumers listening now. The
-- bindings are read in this statement, never from a cache: a queue bound a moment ago gets it.
-- Each job's id keeps the time part of the publish's UUIDv7 (made in Python) and takes random
-- bits of its own. Returns a row per NOTIFY (skipped NULL), and the queues whose job the
-- unique keys skipped (see job_insert).
WITH bound AS MATERIALIZED (
    SELECT DISTINCT b.queue, coalesce(NOT q.auto_delete, false) AS stored,
           (q.arguments->>'x-message-ttl')::float8 AS ttl_ms
    FROM {schema}.bindings AS b JOIN {schema}.queues AS q ON q.name = b.queue
    WHERE b.exchange = %(exchange)s
), inserted AS (
    INSERT INTO {schema}.jobs (id, queue, task, task_id, retries, exchange, routing_key, body,
                               content_type, content_encoding, headers, properties, state,
                               priority, max_attempts, run_at, expires_at, idempotency_key,
                               message_digest, task_paused)
    SELECT encode(overlay(uuid_send(%(id)s::uuid)
                          PLACING substring(uuid_send(gen_random_uuid()) FROM 9) FROM 9),
                  'hex')::uuid,
           bound.queue, %(task)s, %(task_id)s, %(retries)s, %(exchange)s, %(routing_key)s,
           %(body)s, %(content_type)s, %(content_encoding)s, %(headers)s, %(properties)s,
           CASE WHEN %(run_at)s::timestamptz > now() THEN 'scheduled' ELSE 'pending' END,
           %(priority)s, %(max_attempts)s, COALESCE(%(run_at)s::timestamptz, now()),
           -- the queue's x-message-ttl, if declared, bounds the message's own expiry
           least(%(expires_at)s::timestamptz,
                 now() + make_interval(secs => bound.ttl_ms / 1000)),
           %(idempotency_key)s, %(message_digest)s,
           -- a job of a paused task name waits out of the claim's way (as in job_insert)
           coalesce(%(task)s::text = ANY (ARRAY(SELECT tp.task FROM {schema}.task_pauses AS tp)),
                    false)
    FROM bound WHERE bound.stored
      -- (a message whose job has finished: as in job_insert)
      AND cardinality({schema}.jobs_finished_ids(
              ARRAY[NULL::uuid], ARRAY[%(task_id)s::text], ARRAY[bound.queue],
              ARRAY[%(message_digest)s::bytea])) = 0
    ON CONFLICT DO NOTHING
    RETURNING queue, run_at, priority
), broadcast AS (
    INSERT INTO {schema}.broadcasts (id, exchange, routing_key, body, content_type,
                                     content_encoding, headers, properties, queues)
    SELECT %(id)s, %(exchange)s, %(routing_key)s, %(body)s, %(content_type)s,
           %(content_encoding)s, %(headers)s, %(properties)s, array_agg(bound.queue)
    FROM bound WHERE NOT bound.stored
    HAVING count(*) > 0
    RETURNING id, exchange
), notified AS (
    -- (the job's place in the claim's order, as in job_insert)
    SELECT pg_notify(%(channel)s, {schema}.jobs_wake_payload(extract(epoch FROM run_at - now()),
                                                             priority, run_at, queue))
    FROM inserted
    UNION ALL
    SELECT pg_notify(%(channel)s, 'b ' || id::text || ' ' || exchange) FROM broadcast
)
SELECT NULL::text AS skipped FROM notified
UNION ALL
SELECT bound.queue FROM bound
WHERE bound.stored AND NOT EXISTS (SELECT 1 FROM inserted WHERE inserted.queue = bound.queue);

-- name: broadcast_get
-- Not after its time to live, though not yet pruned: a process forgets the broadcasts it
-- delivered after twice that (a replayed NOTIFY of an older one must find nothing).
SELECT exchange, routing_key, body, content_type, content_encoding, headers, properties, queues
FROM {schema}.broadcasts
WHERE id = %(id)s AND created_at > now() - make_interval(secs => %(ttl)s);

-- name: fanout_queues
-- The queues bound to a fanout exchange, and whether a message to it is a job there (see
-- job_fanout): for a publish inside pgbroker.transaction(), whose jobs are written by the
-- caller's transaction.
SELECT DISTINCT b.queue, coalesce(NOT q.auto_delete, false)
FROM {schema}.bindings AS b JOIN {schema}.queues AS q ON q.name = b.queue
WHERE b.exchange = %(exchange)s;

-- name: broadcast_prune
-- Broadcast rows older than %(ttl)s seconds (measured from %(now)s, the sweeper's clock, as in
-- job_rescue; NULL is now()).
DELETE FROM {schema}.broadcasts
WHERE id IN (SELECT id FROM {schema}.broadcasts
             WHERE created_at < coalesce(%(now)s::timestamptz, now())
                                - make_interval(secs => %(ttl)s)
             ORDER BY created_at LIMIT %(limit)s
             FOR UPDATE SKIP LOCKED);

-- name: queue_expire
-- Queues declared with x-expires (reply and event queues, worker mailboxes) that nobody has
-- consumed or declared for that long are deleted, with their bindings (cascade) and the
-- messages nobody will read. Dead letters stay. A queue row another session holds locked is
-- skipped (SKIP LOCKED); a locked message or binding of one makes the statement give up after
-- the maintenance lock_timeout (pgbroker._pg.store), until the next sweep. %(now)s: the sweeper's
-- clock (NULL is now()).
WITH idle AS MATERIALIZED (
    SELECT q.name FROM {schema}.queues AS q
    WHERE q.arguments ? 'x-expires'
      AND q.last_used_at < coalesce(%(now)s::timestamptz, now())
                           - make_interval(secs => (q.arguments->>'x-expires')::float8 / 1000)
      AND NOT EXISTS (SELECT 1 FROM {schema}.consumers AS c WHERE q.name = ANY (c.queues))
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), messages AS (
    DELETE FROM {schema}.jobs WHERE queue IN (SELECT name FROM idle) AND state <> 'dead'
)
DELETE FROM {schema}.queues WHERE name IN (SELECT name FROM idle);
