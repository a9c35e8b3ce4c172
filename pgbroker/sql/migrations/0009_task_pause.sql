-- 0009 task pause: a task name whose deliveries keep losing their worker pauses itself; a task
-- may complete its own delivery in its own transaction (pgbroker.complete).
--
-- 1. task_losses keeps, per task name, the streak of its deliveries in a row that lost their
--    worker (the sweeper rescued them, or Celery gave them back or failed them after their pool
--    process died). A delivery of the task that completes ends the streak (the ack deletes the
--    row). A streak of `pause_after` (transport option pause_task_after, default 5) pauses the
--    task: task_pauses.
-- 2. task_pauses: a paused task name is not claimed (job_claim); its jobs wait, pending, until it
--    is resumed (`pgbroker task resume NAME`, the admin page, Operations.resume_task). Every
--    pause and resume writes an audit row in the same statement.
-- 3. jobs.completed_attempt: the attempt whose task marked its own delivery done inside its own
--    transaction (pgbroker.complete); the worker's ack and failure hook then change nothing.
--
-- Operational caveats: creates two small tables; ADD COLUMN without a default changes only the
-- catalog, but waits for an ACCESS EXCLUSIVE lock on jobs (behind any long transaction reading
-- it). A paused task's pending jobs stay in the claim index: a claim walks past them (cheap for
-- hundreds, measurable for hundreds of thousands at the head of a queue).

CREATE TABLE {schema}.task_losses (
    task      text        PRIMARY KEY,
    streak    integer     NOT NULL CHECK (streak > 0),
    job_ids   uuid[]      NOT NULL DEFAULT '{}',   -- the streak's newest jobs (at most 20)
    last_at   timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE {schema}.task_pauses (
    task       text        PRIMARY KEY,
    paused_at  timestamptz NOT NULL DEFAULT now(),
    paused_by  text        NOT NULL,                -- 'pgbroker' when it paused itself
    reason     text        NOT NULL,
    job_ids    uuid[]      NOT NULL DEFAULT '{}',   -- the jobs that caused it
    CONSTRAINT task_pauses_task_check CHECK (task <> '')
);

ALTER TABLE {schema}.jobs ADD COLUMN IF NOT EXISTS completed_attempt integer;
