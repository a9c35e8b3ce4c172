-- Per task name: the losses that point to it (0019_loss_evidence.sql), pausing and resuming a
-- task name (pgbroker/_pause.py, pgbroker.ops), and a task completing its own delivery in its own
-- transaction (pgbroker/_celery/complete.py). {schema} is the quoted schema name; every value is a bound
-- parameter. Tables: migrations 0009 and 0019.

-- name: task_loss_record
-- Deliveries (%(ids)s, %(attempts)s) that were lost, where the evidence points to their task
-- (0019_loss_evidence.sql). %(workers)s, one per delivery: NULL where the delivery killed its
-- pool process (Celery's WorkerLostError, seen in the worker's main process: requeued with
-- task_reject_on_worker_lost, or failed), else the host of the whole worker that went down
-- under it with no shutdown signal (the sweeper's rescues; a worker told to stop is never
-- reported). A pool process lengthens the task's streak; a whole worker joins the task's
-- workers, once however often it goes down. A delivery of the task that completes ends both
-- (job_ack, job_claim, job_complete). A streak, or a count of different workers, of
-- %(pause_after)s pauses the task, audited in the same statement, with the evidence as reason.
-- Returns the tasks paused by this statement, with the jobs of their streak.
WITH lost AS (
    -- (a delivery is counted once: the same (id, attempt) reported twice is one loss)
    SELECT j.task,
           count(DISTINCT (j.id, d.attempt)) FILTER (WHERE d.worker IS NULL) AS n,
           coalesce(array_agg(DISTINCT d.worker) FILTER (WHERE d.worker IS NOT NULL),
                    '{}') AS workers,
           array_agg(DISTINCT j.id) AS ids
    FROM {schema}.jobs AS j
    JOIN unnest(%(ids)s::uuid[], %(attempts)s::int[], %(workers)s::text[])
         AS d(id, attempt, worker) ON j.id = d.id
    WHERE j.task IS NOT NULL
    GROUP BY j.task
), streaks AS (
    -- an upsert: two processes reporting losses of one task at once add up, one after the other
    INSERT INTO {schema}.task_losses AS s (task, streak, workers, job_ids, last_at)
    SELECT task, n, workers, ids[greatest(cardinality(ids) - 19, 1):], now() FROM lost
    ON CONFLICT (task) DO UPDATE
    SET streak = s.streak + EXCLUDED.streak,
        -- each worker once, in the order they went down (at most 20)
        workers = (SELECT coalesce(array_agg(w ORDER BY n), '{}') FROM (
                       SELECT w, min(n) AS n FROM unnest(s.workers || EXCLUDED.workers)
                                                  WITH ORDINALITY AS u(w, n)
                       GROUP BY w ORDER BY min(n) LIMIT 20) AS first),
        -- the newest 20 jobs, each once
        job_ids = (SELECT array_agg(id) FROM (
                       SELECT id FROM unnest(s.job_ids || EXCLUDED.job_ids)
                                      WITH ORDINALITY AS u(id, n)
                       GROUP BY id ORDER BY max(n) DESC LIMIT 20) AS newest),
        last_at = now()
    RETURNING task, streak, workers, job_ids
), paused AS (
    INSERT INTO {schema}.task_pauses (task, paused_by, reason, job_ids)
    SELECT task, 'pgbroker',
           CASE WHEN streak >= %(pause_after)s
                THEN format('%%s deliveries in a row killed their pool process (Celery''s '
                            'WorkerLostError: killed, out of memory or exited): jobs %%s',
                            streak, array_to_string(job_ids, ', '))
                ELSE format('took down %%s different workers in a row (%%s: each lost as a '
                            'whole while running it, none told to stop): jobs %%s',
                            cardinality(workers), array_to_string(workers, ', '),
                            array_to_string(job_ids, ', ')) END,
           job_ids
    FROM streaks
    WHERE streak >= %(pause_after)s OR cardinality(workers) >= %(pause_after)s
    ON CONFLICT (task) DO NOTHING  -- paused already
    RETURNING task, reason, job_ids
), held AS (
    -- its waiting jobs leave the claim's way (jobs.task_paused: 0011_task_pause_index.sql)
    UPDATE {schema}.jobs SET task_paused = true
    WHERE task IN (SELECT task FROM paused) AND state IN ('pending', 'scheduled')
      AND NOT task_paused
), audited AS (
    -- The worker role of roles.sql.example may not write the audit table (it could forge an
    -- operator's actions): then the task_pauses row (by 'pgbroker', why, which jobs, when) is
    -- the pause's record, and the resume's audit row keeps it (task_set_paused).
    INSERT INTO {schema}.audit (actor, action, target, detail)
    SELECT 'pgbroker', 'task.pause', task,
           jsonb_build_object('via', %(via)s::text, 'reason', reason, 'job_ids', to_jsonb(job_ids),
                              'changed', true)
    FROM paused
    WHERE has_table_privilege('{schema}.audit', 'INSERT')
    RETURNING 1
)
SELECT task, reason, job_ids FROM paused
WHERE (SELECT count(*) FROM audited) >= 0;  -- (evaluates the audit rows)

-- name: task_set_paused
-- An operator pauses (%(paused)s) or resumes a task name, audited in the same statement (who,
-- why, whether it changed anything). A resume also ends the task's streak of losses, so its next
-- lost delivery starts counting from one again. Returns the row paused or resumed, if any.
-- The task's waiting jobs leave the claim's way on a pause and come back on a resume
-- (jobs.task_paused: 0011_task_pause_index.sql), each with its own priority, run_at and id, so
-- they are claimed in the order they had. Both run even when the pause or resume changes
-- nothing: pausing again takes the stragglers out too (jobs put back pending since).
WITH paused AS (
    INSERT INTO {schema}.task_pauses (task, paused_by, reason)
    SELECT %(task)s, %(actor)s, %(reason)s WHERE %(paused)s::boolean
    ON CONFLICT (task) DO NOTHING
    RETURNING task, reason, job_ids
), resumed AS (
    DELETE FROM {schema}.task_pauses
    WHERE task = %(task)s AND NOT %(paused)s::boolean
    RETURNING task, reason, job_ids, paused_by, paused_at
), held AS (
    -- (jobs_claim_idx and jobs_scheduled_idx find them: no index by task for these states)
    UPDATE {schema}.jobs SET task_paused = true
    WHERE %(paused)s::boolean AND task = %(task)s AND state IN ('pending', 'scheduled')
      AND NOT task_paused
), released AS (
    -- (jobs_task_paused_idx)
    UPDATE {schema}.jobs SET task_paused = false
    WHERE NOT %(paused)s::boolean AND task = %(task)s AND task_paused
), streak_ended AS (
    DELETE FROM {schema}.task_losses WHERE task = %(task)s AND NOT %(paused)s::boolean
), audited AS (
    INSERT INTO {schema}.audit (actor, action, target, detail)
    VALUES (%(actor)s, CASE WHEN %(paused)s::boolean THEN 'task.pause' ELSE 'task.resume' END,
            %(task)s,
            jsonb_build_object('via', %(via)s::text, 'reason', %(reason)s::text,
                               'changed', EXISTS (SELECT 1 FROM paused)
                                          OR EXISTS (SELECT 1 FROM resumed),
                               -- what a resume undid: who paused it, when, why, which jobs
                               'was', (SELECT jsonb_build_object('paused_by', paused_by,
                                                                 'paused_at', paused_at,
                                                                 'reason', reason,
                                                                 'job_ids', to_jsonb(job_ids))
                                       FROM resumed)))
    RETURNING 1
), woken AS (
    -- a resumed task's jobs wait in their queues: wake their consumers
    SELECT pg_notify(%(channel)s, '0 ' || queue)
    FROM (SELECT DISTINCT queue FROM {schema}.jobs
          WHERE state = 'pending' AND task = %(task)s AND EXISTS (SELECT 1 FROM resumed)) AS q
)
SELECT task, reason, job_ids FROM paused
UNION ALL
SELECT task, reason, job_ids FROM resumed
WHERE (SELECT count(*) FROM audited) + (SELECT count(*) FROM woken) >= 0;

-- name: task_pause_list
-- The paused task names, with why, by whom, the jobs that caused it, and how many of the task's
-- jobs wait meanwhile (one probe of jobs_claim_idx's state per task: few tasks are ever paused).
SELECT p.task, p.paused_at, p.paused_by, p.reason, p.job_ids,
       (SELECT count(*) FROM {schema}.jobs AS j
        WHERE j.state = 'pending' AND j.task = p.task) AS waiting
FROM {schema}.task_pauses AS p
ORDER BY p.paused_at DESC, p.task;

-- name: task_loss_list
-- The streaks of losses under way (not yet long enough to pause their task): deliveries in a
-- row that killed their pool process, and the different workers lost under the task.
SELECT task, streak, workers, job_ids, last_at FROM {schema}.task_losses
ORDER BY last_at DESC, task;

-- name: consumer_stopping
-- This worker process (%(host)s, %(pid)s) was told to stop (a warm, soft or cold shutdown): a
-- rescue of its jobs after this counts against no task (task_loss_record, job_rescue).
UPDATE {schema}.consumers SET stopping_at = now()
WHERE host = %(host)s AND pid = %(pid)s AND stopping_at IS NULL;

-- name: job_complete
-- The task of delivery (%(id)s, %(attempt)s) completes it inside its own transaction
-- (pgbroker.complete): the task's writes and this commit together, or neither does. Only while
-- that very delivery runs: one the sweeper took back meanwhile (and maybe redelivered) matches
-- nothing, and the caller must not commit. Its row stays locked until the caller's transaction
-- ends, so no ack, rescue or requeue can pass it meanwhile; after the commit the worker's own
-- ack (state = 'running' AND attempts = ...) and failure hook (completed_attempt) change
-- nothing. Revoked while claimed, it ends 'completed' all the same: its task ran to this commit
-- (revoked_at and the revoke's note say a revoke came).
WITH done AS (
    UPDATE {schema}.jobs
    SET state = 'completed',
        completed_attempt = attempts, updated_at = now()
    WHERE id = %(id)s AND attempts = %(attempt)s AND state = 'running'
    RETURNING task
), streak_ended AS (
    -- a delivery of the task completed: its streak of lost deliveries is over
    DELETE FROM {schema}.task_losses WHERE task IN (SELECT task FROM done)
)
SELECT count(*) FROM done;

-- name: job_delivery_state
-- Why job_complete matched nothing: the delivery's row as it is now.
SELECT state, attempts, completed_attempt FROM {schema}.jobs WHERE id = %(id)s;
