-- The result backend's statements (pgbroker.backend). Loaded with queries.sql.
--
-- Expiry: %(ttl)s is an interval from now, NULL meaning "never" (now() + NULL is NULL). A row
-- past its expiry is invisible to every read at once; backend.cleanup() removes it later, in
-- small batches. The database's clock decides, for writers and the clean-up alike.

-- name: result_get
SELECT payload FROM {schema}.results
WHERE task_id = %(task_id)s AND (expires_at IS NULL OR expires_at > now());

-- name: result_get_many
SELECT task_id, payload FROM {schema}.results
WHERE task_id = ANY(%(task_ids)s) AND (expires_at IS NULL OR expires_at > now());

-- name: result_job_dead
-- The task ids among %(task_ids)s that have no stored result and whose job ended dead, with the
-- job's reason (its success could not be stored, its worker was lost during every attempt):
-- their waiters are told FAILURE (pgbroker.errors.JobDead) instead of PENDING for ever. Only the
-- newest row of a task id counts (a retry publishes another row with the same id), read by
-- jobs_task_delivery_idx; a dead job an operator retries is pending again, and reads PENDING.
SELECT newest.task_id, coalesce(newest.last_error, 'its job is dead')
FROM (SELECT DISTINCT ON (j.task_id) j.task_id, j.state, j.last_error
      FROM {schema}.jobs AS j
      WHERE j.task_id = ANY(%(task_ids)s)
      ORDER BY j.task_id, j.retries DESC, j.id DESC) AS newest
WHERE newest.state = 'dead'
  AND NOT EXISTS (SELECT 1 FROM {schema}.results AS r WHERE r.task_id = newest.task_id);

-- name: result_set
-- Store a task's state. A stored SUCCESS is never overwritten (Celery's rule, so that a lost
-- or redelivered run cannot replace a result already delivered), decided here in one statement
-- where Celery's generic code reads first and writes after. The NOTIFY (payload: the task id)
-- wakes AsyncResult.get() waiters; it goes out on commit, and only when a row was written.
WITH stored AS (
    INSERT INTO {schema}.results AS r (
        task_id, status, payload, content_type, result, traceback, date_done, name, args,
        kwargs, worker, retries, queue, group_id, parent_id, expires_at)
    VALUES (
        %(task_id)s, %(status)s, %(payload)s, %(content_type)s, %(result)s::jsonb,
        %(traceback)s, %(date_done)s, %(name)s, %(args)s::jsonb, %(kwargs)s::jsonb, %(worker)s,
        %(retries)s, %(queue)s, %(group_id)s, %(parent_id)s,
        now() + %(ttl)s::interval)
    ON CONFLICT (task_id) DO UPDATE SET
        status = EXCLUDED.status, payload = EXCLUDED.payload,
        content_type = EXCLUDED.content_type, result = EXCLUDED.result,
        traceback = EXCLUDED.traceback, date_done = EXCLUDED.date_done, name = EXCLUDED.name,
        args = EXCLUDED.args, kwargs = EXCLUDED.kwargs, worker = EXCLUDED.worker,
        retries = EXCLUDED.retries, queue = EXCLUDED.queue, group_id = EXCLUDED.group_id,
        parent_id = EXCLUDED.parent_id, expires_at = EXCLUDED.expires_at, updated_at = now()
    WHERE r.status <> 'SUCCESS' OR r.expires_at <= now()
    RETURNING task_id
)
-- pg_notify refuses payloads of 8000 bytes and more: such ids are found by the waiters' poll.
SELECT pg_notify(%(channel)s, task_id) FROM stored WHERE octet_length(task_id) < 8000;

-- name: result_delete
DELETE FROM {schema}.results WHERE task_id = %(task_id)s;

-- name: result_expire
UPDATE {schema}.results
SET expires_at = now() + %(ttl)s::interval
WHERE task_id = %(task_id)s;

-- name: result_group_get
SELECT payload FROM {schema}.result_groups
WHERE group_id = %(group_id)s AND (expires_at IS NULL OR expires_at > now());

-- name: result_group_set
INSERT INTO {schema}.result_groups AS g (group_id, payload, content_type, expires_at)
VALUES (%(group_id)s, %(payload)s, %(content_type)s,
        now() + %(ttl)s::interval)
ON CONFLICT (group_id) DO UPDATE SET
    payload = EXCLUDED.payload, content_type = EXCLUDED.content_type,
    expires_at = EXCLUDED.expires_at;

-- name: result_group_delete
DELETE FROM {schema}.result_groups WHERE group_id = %(group_id)s;

-- name: result_group_expire
UPDATE {schema}.result_groups
SET expires_at = now() + %(ttl)s::interval
WHERE group_id = %(group_id)s;

-- name: result_chord_get
SELECT done FROM {schema}.result_chords
WHERE group_id = %(group_id)s AND (expires_at IS NULL OR expires_at > now());

-- name: result_chord_incr
-- The key/value backend's INCR on a chord counter, in one statement.
INSERT INTO {schema}.result_chords AS c (group_id, done) VALUES (%(group_id)s, 1)
ON CONFLICT (group_id) DO UPDATE SET done = c.done + 1
RETURNING done;

-- name: result_chord_expire
UPDATE {schema}.result_chords
SET expires_at = now() + %(ttl)s::interval
WHERE group_id = %(group_id)s;

-- name: result_chord_delete
-- Also what apply_chord runs before publishing a header: re-applying a frozen chord reuses its
-- group id, and the new run must not inherit the old run's counts or its "dispatched" marker.
WITH parts AS (
    DELETE FROM {schema}.result_chord_parts WHERE group_id = %(group_id)s
)
DELETE FROM {schema}.result_chords WHERE group_id = %(group_id)s;

-- name: result_chord_size_set
-- Celery calls this just before it publishes the last header task, so the part that completes
-- the count always finds the size (parts finished earlier may not).
INSERT INTO {schema}.result_chords AS c (group_id, size, expires_at)
VALUES (%(group_id)s, %(size)s,
        now() + %(ttl)s::interval)
ON CONFLICT (group_id) DO UPDATE SET size = EXCLUDED.size, expires_at = EXCLUDED.expires_at;

-- name: result_chord_add
-- Task.add_to_chord(): one more header task to wait for.
INSERT INTO {schema}.result_chords AS c (group_id, extra) VALUES (%(group_id)s, 1)
ON CONFLICT (group_id) DO UPDATE SET extra = c.extra + 1;

-- name: result_chord_part_return
-- A header task finished: count it (once), and claim the callback if it completes the chord.
-- Returns (done, total, claimed by this call, already dispatched).
WITH part AS (
    -- A second run of the same header task (acks_late redelivery) inserts nothing, so it does
    -- not count twice: a duplicate can neither fire the callback early nor push the count past
    -- the size.
    INSERT INTO {schema}.result_chord_parts (group_id, task_id, group_index)
    VALUES (%(group_id)s, %(task_id)s, %(group_index)s::integer)
    ON CONFLICT DO NOTHING
    RETURNING 1
), kept AS (
    -- The last part reads every header result: keep this one at least as long as the chord
    -- (never shorten it, never give an expiry to a result kept forever).
    UPDATE {schema}.results
    SET expires_at = greatest(expires_at, now() + %(keep)s::interval)
    WHERE task_id = %(task_id)s AND expires_at IS NOT NULL AND %(keep)s::interval IS NOT NULL
)
-- One upsert of the chord row: its row lock serialises the parts of one chord, and each part
-- adds to the count the one before it committed (ON CONFLICT DO UPDATE reads the latest row).
-- The claim goes to the call that completes the count, or to a later call (a redelivered
-- header task) once a claim is older than %(reclaim_after)s and still not dispatched:
-- its holder died between the claim and the publish.
INSERT INTO {schema}.result_chords AS c (group_id, size, done, claimed_by, claimed_at, expires_at)
VALUES (%(group_id)s, %(size)s::integer, (SELECT count(*) FROM part),
        CASE WHEN (SELECT count(*) FROM part) >= %(size)s::integer THEN %(token)s::uuid END,
        CASE WHEN (SELECT count(*) FROM part) >= %(size)s::integer THEN now() END,
        now() + %(ttl)s::interval)
ON CONFLICT (group_id) DO UPDATE SET
    size = COALESCE(c.size, EXCLUDED.size),
    done = c.done + EXCLUDED.done,
    expires_at = EXCLUDED.expires_at,
    claimed_by = CASE
        WHEN c.dispatched_at IS NULL
         AND c.done + EXCLUDED.done >= COALESCE(c.size, EXCLUDED.size) + c.extra
         AND (c.claimed_by IS NULL
              OR c.claimed_at < now() - %(reclaim_after)s::interval)
        THEN %(token)s::uuid ELSE c.claimed_by END,
    claimed_at = CASE
        WHEN c.dispatched_at IS NULL
         AND c.done + EXCLUDED.done >= COALESCE(c.size, EXCLUDED.size) + c.extra
         AND (c.claimed_by IS NULL
              OR c.claimed_at < now() - %(reclaim_after)s::interval)
        THEN now() ELSE c.claimed_at END
RETURNING done, size + extra, claimed_by IS NOT DISTINCT FROM %(token)s::uuid,
          dispatched_at IS NOT NULL;

-- name: result_chord_dispatched
-- The callback was published (or failed): mark the chord, if this caller still holds the claim.
-- The row stays until it expires, so that late duplicates of header tasks are recognised.
UPDATE {schema}.result_chords SET dispatched_at = now()
WHERE group_id = %(group_id)s AND claimed_by = %(token)s::uuid;

-- name: result_cleanup
-- Expired results, oldest first, one small batch per statement (short transactions, few
-- locks); rows being written right now are skipped, not waited for.
DELETE FROM {schema}.results
WHERE task_id IN (SELECT task_id FROM {schema}.results
                  WHERE expires_at <= COALESCE(%(now)s::timestamptz, now())
                  ORDER BY expires_at
                  LIMIT %(limit)s
                  FOR UPDATE SKIP LOCKED);

-- name: result_group_cleanup
DELETE FROM {schema}.result_groups
WHERE group_id IN (SELECT group_id FROM {schema}.result_groups
                   WHERE expires_at <= COALESCE(%(now)s::timestamptz, now())
                   ORDER BY expires_at
                   LIMIT %(limit)s
                   FOR UPDATE SKIP LOCKED);

-- name: result_chord_cleanup
WITH gone AS (
    -- expired chord counters, in one small batch
    DELETE FROM {schema}.result_chords
    WHERE group_id IN (SELECT group_id FROM {schema}.result_chords
                       WHERE expires_at <= COALESCE(%(now)s::timestamptz, now())
                       ORDER BY expires_at
                       LIMIT %(limit)s
                       FOR UPDATE SKIP LOCKED)
    RETURNING group_id
), parts AS (
    -- and the parts they counted (there is no foreign key to cascade)
    DELETE FROM {schema}.result_chord_parts AS p USING gone WHERE p.group_id = gone.group_id
)
SELECT count(*) FROM gone;
