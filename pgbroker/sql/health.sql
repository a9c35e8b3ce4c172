-- pgbroker.health's statements: is a worker alive, is a queue served, is beat firing
-- (`pgbroker health`). Read-only; every age is by the database clock, as the sweeper counts it.

-- name: health_consumers
-- Consumers by id, host, pid or queue (a NULL parameter matches all), newest heartbeat first,
-- with what the sweeper's job_rescue tests: the heartbeat's age against the consumer's own lease
-- (%(lease)s for a row of an older pgbroker, which has none), and whether the session still
-- holds its advisory lock (a consumer whose connection died is gone at once, heartbeat or not).
-- Remote-control clients (celery inspect, status) consume nothing but their reply queue and
-- come and go in a second: they are not workers, so they are left out.
SELECT c.id, c.host, c.pid, c.queues, c.started_at,
       extract(epoch FROM now() - c.heartbeat_at)::float8 AS heartbeat_age,
       coalesce(c.lease_timeout, %(lease)s::float8) AS lease_timeout,
       c.lock_key IS NULL OR EXISTS (
           SELECT 1 FROM pg_locks AS l
           WHERE l.locktype = 'advisory' AND l.granted
             AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
             AND l.classid = %(lock_class)s::oid AND l.objid = c.lock_key::oid
             AND l.objsubid = 2) AS connected
FROM {schema}.consumers AS c
WHERE (%(id)s::uuid IS NULL OR c.id = %(id)s::uuid)
  AND (%(host)s::text IS NULL OR c.host = %(host)s::text)
  AND (%(pid)s::integer IS NULL OR c.pid = %(pid)s::integer)
  AND (%(queue)s::text IS NULL OR %(queue)s::text = ANY (c.queues))
  AND EXISTS (SELECT 1 FROM unnest(c.queues) AS q(name) WHERE q.name NOT LIKE '%%.reply.%%pidbox')
ORDER BY c.heartbeat_at DESC;

-- name: health_queue
-- One queue: whether it is known (a row in queues, or jobs waiting in it), paused, and how long
-- its oldest due job has waited. The pending rows of the queue are read from jobs_claim_idx:
-- the cost is the queue's backlog, never the table.
SELECT EXISTS (SELECT 1 FROM {schema}.queues WHERE name = %(queue)s)
           OR EXISTS (SELECT 1 FROM {schema}.jobs
                      WHERE state IN ('pending', 'scheduled') AND queue = %(queue)s) AS known,
       coalesce((SELECT paused FROM {schema}.queues WHERE name = %(queue)s), false) AS paused,
       (SELECT extract(epoch FROM now() - min(run_at))::float8 FROM {schema}.jobs
        WHERE state = 'pending' AND queue = %(queue)s) AS oldest_pending_age;

-- name: health_beat
-- The entries beat fires (enabled and still configured), with their grid, since when they are
-- owed runs (created_at: nothing is owed before), their last completed run as beat_status
-- reads it (the live last job, else the stored time), and the database clock.
SELECT e.name, e.schedule, e.created_at, s.last_completed_at, e.last_job_state, now() AS now
FROM {schema}.beat_schedule AS e
JOIN {schema}.beat_status AS s ON s.entry = e.name
WHERE e.enabled AND e.removed_at IS NULL
ORDER BY e.name;

-- name: health_beat_entry
-- Whether an entry exists at all, and if so why it is not checked (disabled, removed).
SELECT enabled, removed_at IS NOT NULL AS removed FROM {schema}.beat_schedule WHERE name = %(name)s;
