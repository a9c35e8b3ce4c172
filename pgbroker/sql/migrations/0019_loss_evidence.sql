-- 0019 loss evidence: a task name pauses itself only on the losses that point to it (issue 27,
-- item 3).
--
-- Until now every delivery that lost its worker lengthened its task's streak, the sweeper's
-- rescues of a whole worker included: six SIGKILLs of one worker (-c 2) paused the only task
-- type it ran ("8 deliveries in a row lost their worker"), and a rolling deploy whose grace
-- period ends before long tasks do, a node lost or a network cut look the same. A loss now
-- counts against a task only where the evidence points to it:
--
-- 1. consumers.stopping_at: when the worker was told to stop (SIGTERM, SIGINT or SIGQUIT: a
--    warm, soft or cold shutdown; Celery's worker_shutting_down, pgbroker._celery.startup). The
--    deliveries of a worker killed after that were lost to its deployment, not to a task: they
--    are redelivered as before and count against nothing.
-- 2. task_losses.streak counts the deliveries of the task in a row that killed their pool
--    process (Celery's WorkerLostError, seen in the worker's main process), and may now be 0.
-- 3. task_losses.workers: the different workers (host names) that went down as a whole, with a
--    delivery of the task running and no shutdown signal (the sweeper's rescues). The same
--    worker lost again adds nothing: a worker killed again and again (a node, a memory limit, a
--    restart loop) does not make its task guilty until the task takes down another one.
--    Either reaching pause_task_after pauses the task; its reason names the evidence.
--
-- Operational caveats: ADD COLUMN without a default changes only the catalog, but waits for an
-- ACCESS EXCLUSIVE lock on consumers (small; locked briefly by heartbeats) and task_losses
-- (tiny). The streaks under way are forgotten: they may hold whole-worker losses that no longer
-- count (a pause already made stays until it is resumed). Workers of an older pgbroker still
-- count every rescue against its task through the old statement until they are upgraded.

ALTER TABLE {schema}.consumers ADD COLUMN IF NOT EXISTS stopping_at timestamptz;

ALTER TABLE {schema}.task_losses
    ADD COLUMN IF NOT EXISTS workers text[] NOT NULL DEFAULT '{}',
    DROP CONSTRAINT IF EXISTS task_losses_streak_check,
    ADD CONSTRAINT task_losses_streak_check CHECK (streak >= 0);

DELETE FROM {schema}.task_losses;
