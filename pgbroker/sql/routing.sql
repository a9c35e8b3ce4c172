-- Exchanges, bindings and broadcasts (remote control, worker events). Loaded with queries.sql.

-- name: exchange_declare
INSERT INTO {schema}.exchanges (name, type, durable, auto_delete, arguments)
VALUES (%(name)s, %(type)s, %(durable)s, %(auto_delete)s, %(arguments)s)
ON CONFLICT (name) DO NOTHING;

-- name: exchange_type
SELECT type FROM {schema}.exchanges WHERE name = %(name)s;

-- name: exchange_delete
WITH unbound AS (DELETE FROM {schema}.bindings WHERE exchange = %(name)s)
DELETE FROM {schema}.exchanges WHERE name = %(name)s;

-- name: binding_declare
-- The queue row must exist (foreign key); declaring it here too makes the order of a client's
-- declarations irrelevant.
WITH queue AS (
    INSERT INTO {schema}.queues (name) VALUES (%(queue)s) ON CONFLICT (name) DO NOTHING
)
INSERT INTO {schema}.bindings (exchange, routing_key, queue)
VALUES (%(exchange)s, %(routing_key)s, %(queue)s)
ON CONFLICT DO NOTHING;

-- name: binding_delete
DELETE FROM {schema}.bindings
WHERE exchange = %(exchange)s AND routing_key = %(routing_key)s AND queue = %(queue)s;

-- name: binding_list
SELECT routing_key, queue FROM {schema}.bindings WHERE exchange = %(exchange)s;

-- name: broadcast_insert
-- One row for all the consumers, and a NOTIFY that names only the row and its exchange (so a
-- process with no queue bound to that exchange need not read it).
WITH inserted AS (
    INSERT INTO {schema}.broadcasts (id, exchange, routing_key, body, content_type,
                                     content_encoding, headers, properties)
    VALUES (%(id)s, %(exchange)s, %(routing_key)s, %(body)s, %(content_type)s,
            %(content_encoding)s, %(headers)s, %(properties)s)
    RETURNING id, exchange
)
SELECT pg_notify(%(channel)s, 'b ' || id::text || ' ' || exchange) FROM inserted;

-- name: broadcast_get
SELECT exchange, routing_key, body, content_type, content_encoding, headers, properties
FROM {schema}.broadcasts WHERE id = %(id)s;

-- name: broadcast_prune
DELETE FROM {schema}.broadcasts
WHERE id IN (SELECT id FROM {schema}.broadcasts
             WHERE created_at < now() - make_interval(secs => %(ttl)s)
             ORDER BY created_at LIMIT %(limit)s);

-- name: queue_expire
-- Queues declared with x-expires (reply and event queues, worker mailboxes) that nobody has
-- consumed or declared for that long are deleted, with their bindings (cascade) and the
-- messages nobody will read. Dead letters stay.
WITH idle AS MATERIALIZED (
    SELECT q.name FROM {schema}.queues AS q
    WHERE q.arguments ? 'x-expires'
      AND q.last_used_at < now() - make_interval(secs => (q.arguments->>'x-expires')::float8 / 1000)
      AND NOT EXISTS (SELECT 1 FROM {schema}.consumers AS c WHERE q.name = ANY (c.queues))
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), messages AS (
    DELETE FROM {schema}.jobs WHERE queue IN (SELECT name FROM idle) AND state <> 'dead'
)
DELETE FROM {schema}.queues WHERE name IN (SELECT name FROM idle);
