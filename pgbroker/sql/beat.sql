-- pgbroker.beat's statements: the periodic schedule in {schema}.beat_schedule (migration 0004).
-- Times are computed in Python (crontab and solar grids) and passed in; `%(now)s` is the tick's
-- clock (the database's clock_timestamp() unless a test injects one).

-- name: beat_sync_lock
-- Beats starting together apply their beat_schedule config one after the other (the last one
-- wins), so two of them never insert the same entry or undo each other's half-done sync.
SELECT pg_advisory_xact_lock(hashtext(%(key)s));

-- name: beat_entry_all
-- Every entry, as the config sync compares it (locked until the sync commits).
SELECT name, task, args::text, kwargs::text, options::text, schedule, misfire, overlap, source,
       removed_at, next_occurrence, last_occurrence
FROM {schema}.beat_schedule
ORDER BY name
FOR UPDATE;

-- name: beat_entry_insert
-- A new entry; its first occurrence is the first grid point after it was added.
INSERT INTO {schema}.beat_schedule (name, task, args, kwargs, options, schedule, enabled, misfire,
                                    overlap, source, next_occurrence)
VALUES (%(name)s, %(task)s, %(args)s::jsonb, %(kwargs)s::jsonb, %(options)s::jsonb, %(schedule)s,
        %(enabled)s, %(misfire)s, %(overlap)s, %(source)s, %(next_occurrence)s)
ON CONFLICT (name) DO NOTHING
RETURNING name;

-- name: beat_entry_configure
-- A changed entry keeps its history (runs, last occurrence, last job, enabled); a config entry
-- that is back in the config fires again.
UPDATE {schema}.beat_schedule
SET task = %(task)s, args = %(args)s::jsonb, kwargs = %(kwargs)s::jsonb,
    options = %(options)s::jsonb, schedule = %(schedule)s, misfire = %(misfire)s,
    overlap = %(overlap)s, source = %(source)s, removed_at = NULL,
    next_occurrence = %(next_occurrence)s, updated_at = now()
WHERE name = %(name)s
RETURNING name;

-- name: beat_entry_remove
-- Config entries that left the config: kept with their history but never fired (removed_at
-- set), until they come back or an operator deletes them.
UPDATE {schema}.beat_schedule
SET removed_at = now(), updated_at = now()
WHERE source = 'config' AND removed_at IS NULL AND NOT (name = ANY(%(keep)s::text[]))
RETURNING name;

-- name: beat_clock
-- The database's clock: every beat, on any host, agrees on it.
SELECT clock_timestamp();

-- name: beat_session
-- A beat frozen inside a firing (SIGSTOP, a hung host) must not keep its entry locked for long:
-- the other beats skip locked entries. A firing itself takes milliseconds.
SET idle_in_transaction_session_timeout = '30s';

-- name: beat_due
-- One tick's reading: its clock, the entries due by it, and the next occurrence still to come
-- (how long beat may sleep). Both read beat_schedule_due_idx.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, clock_timestamp()) AS now
)
SELECT clock.now,
       array(SELECT e.name FROM {schema}.beat_schedule AS e
             WHERE e.enabled AND e.removed_at IS NULL AND e.next_occurrence <= clock.now
             ORDER BY e.next_occurrence, e.name),
       (SELECT min(e.next_occurrence) FROM {schema}.beat_schedule AS e
        WHERE e.enabled AND e.removed_at IS NULL AND e.next_occurrence > clock.now)
FROM clock;

-- name: beat_entry_lock
-- Take one due entry for this tick, or nothing: SKIP LOCKED, because a beat holding the lock is
-- firing it right now; the due test is repeated under the lock, because another beat may have
-- advanced it since beat_due read it (READ COMMITTED reads the newest committed row here).
-- With it, the fate of the entry's previous job, by its newest delivery (a Celery retry is a
-- new row): still to finish (the overlap policy), or when it completed (the heartbeat).
SELECT e.task, e.args::text, e.kwargs::text, e.options::text, e.schedule, e.misfire, e.overlap,
       e.next_occurrence,
       CASE WHEN p.state IN ('pending', 'scheduled', 'running') THEN 'pending'
            WHEN p.state IS NOT NULL THEN p.state
            -- the row is gone: deleted on ack (retention 0) or pruned, so most likely completed
            WHEN e.last_job_state = 'pending' THEN 'gone'
       END AS previous_state,
       CASE WHEN p.state = 'completed' THEN p.updated_at
            WHEN p.state IS NULL AND e.last_job_state = 'pending' THEN now()
       END AS previous_completed_at
FROM {schema}.beat_schedule AS e
LEFT JOIN LATERAL {schema}.beat_last_delivery(e.last_task_id) AS p ON true
WHERE e.name = %(name)s AND e.enabled AND e.removed_at IS NULL
  AND e.next_occurrence <= %(now)s
FOR UPDATE OF e SKIP LOCKED;

-- name: beat_entry_advance
-- Move a locked entry to its next occurrence. `fired` is the occurrence whose job was enqueued in
-- this transaction (NULL: none was, the occurrence was dropped by a policy or failed with
-- `error`). The previous job's completion is recorded before last_task_id moves on.
UPDATE {schema}.beat_schedule
SET next_occurrence = %(next_occurrence)s,
    last_occurrence = coalesce(%(fired)s, last_occurrence),
    total_runs = total_runs + (%(fired)s::timestamptz IS NOT NULL)::int,
    last_job_id = CASE WHEN %(fired)s::timestamptz IS NULL THEN last_job_id ELSE %(job_id)s END,
    last_task_id = CASE WHEN %(fired)s::timestamptz IS NULL THEN last_task_id
                        ELSE (SELECT j.task_id FROM {schema}.jobs AS j WHERE j.id = %(job_id)s)
                   END,
    last_job_state = CASE WHEN %(fired)s::timestamptz IS NOT NULL THEN 'pending'
                          ELSE coalesce(%(previous_state)s, last_job_state) END,
    last_completed_at = greatest(last_completed_at, %(previous_completed_at)s),
    last_error = %(error)s,
    updated_at = now()
WHERE name = %(name)s AND next_occurrence = %(expected)s
RETURNING name;

-- name: beat_refresh
-- Record the completion of last jobs that finished since beat last looked, so that the heartbeat
-- survives the pruning of their rows (a weekly entry's job is pruned long before the next
-- occurrence replaces it). Only entries whose last job beat still thinks unfinished are read.
WITH waiting AS (
    -- SKIP LOCKED: an entry locked by a beat firing it is recorded by that beat
    SELECT e.name, e.last_task_id
    FROM {schema}.beat_schedule AS e
    WHERE e.last_job_state = 'pending'
    FOR UPDATE SKIP LOCKED
), seen AS (
    -- the newest delivery of each last job (NULL: its row is gone)
    SELECT w.name, p.state, p.updated_at
    FROM waiting AS w
    LEFT JOIN LATERAL {schema}.beat_last_delivery(w.last_task_id) AS p ON true
)
UPDATE {schema}.beat_schedule AS e
SET last_job_state = coalesce(s.state, 'gone'),
    last_completed_at = CASE WHEN s.state = 'completed' THEN greatest(e.last_completed_at,
                                                                       s.updated_at)
                             WHEN s.state IS NULL THEN greatest(e.last_completed_at, now())
                             ELSE e.last_completed_at END
FROM seen AS s
WHERE e.name = s.name
  AND (s.state IS NULL OR s.state NOT IN ('pending', 'scheduled', 'running'))
RETURNING e.name;

-- ---------------------------------------------------------------------------------------------
-- The operator's side (`pgbroker schedule ...`); each action's audit row is written by
-- ops.sql's audit_insert in the same transaction.
-- ---------------------------------------------------------------------------------------------

-- name: beat_list
-- Every entry with its heartbeat (beat_status) and its last job's state now (its newest
-- delivery; what beat recorded once the row is gone), by name.
SELECT e.name, e.task, e.schedule, e.enabled, e.removed_at, e.source, e.misfire, e.overlap,
       e.args, e.kwargs, e.options, e.next_occurrence, e.last_occurrence, e.total_runs,
       e.last_job_id, coalesce(d.state, e.last_job_state) AS last_job_state,
       s.last_completed_at, s.age_seconds, e.last_error, e.created_at, e.updated_at
FROM {schema}.beat_schedule AS e
JOIN {schema}.beat_status AS s ON s.entry = e.name
LEFT JOIN LATERAL {schema}.beat_last_delivery(e.last_task_id) AS d ON true
ORDER BY e.name;

-- name: beat_entry_get
-- One entry, as the config sync compares it, locked for the operator's action in the same
-- transaction.
SELECT name, task, args::text, kwargs::text, options::text, schedule, misfire, overlap, source,
       removed_at, next_occurrence, last_occurrence
FROM {schema}.beat_schedule
WHERE name = %(name)s
FOR UPDATE;

-- name: beat_names
SELECT name FROM {schema}.beat_schedule ORDER BY name;

-- name: beat_entry_set_enabled
-- Enable or disable an entry. Beats read the flag at every tick: no restart needed.
UPDATE {schema}.beat_schedule
SET enabled = %(enabled)s, updated_at = now()
WHERE name = %(name)s AND enabled IS DISTINCT FROM %(enabled)s
RETURNING name;

-- name: beat_entry_run_now
-- Fire an enabled entry at the beats' next tick: its next occurrence becomes now. The one after
-- is the grid's next point after now, which is the occurrence it had (it was the first grid
-- point after the last one fired): a run is added, none is skipped. An entry already due (held
-- by its overlap policy) keeps its time.
UPDATE {schema}.beat_schedule
SET next_occurrence = least(next_occurrence, now()), updated_at = now()
WHERE name = %(name)s AND enabled AND removed_at IS NULL
RETURNING next_occurrence;

-- name: beat_entry_delete
DELETE FROM {schema}.beat_schedule
WHERE name = %(name)s
RETURNING name, task, schedule::text, total_runs, last_occurrence;
