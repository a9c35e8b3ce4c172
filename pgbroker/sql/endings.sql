-- How a delivery ended, in the two cases only its worker can tell (pgbroker/_celery/endings.py, from
-- Celery's signals; columns: migration 0018). Each matches the delivery by (id, attempt), as
-- job_fail does: a late report of an older delivery of a job redelivered since changes nothing.
-- {schema} is the quoted schema name; every value is a bound parameter.

-- name: job_stopped
-- Celery carried out a revoke on this delivery (task_revoked, in the worker's main process): it
-- discarded it before the task started, or terminated the pool process running it. Only this
-- makes a job end 'cancelled' at its ack (job_ack, the acks folded into job_claim): a revoke the
-- pool could not carry out leaves the job as its task ended it. Celery acks just before it says
-- so, and that ack may be written first: a row it ended already is made 'cancelled' here.
-- %(note)s says how (discarded, terminated, expired); it follows the revoke's own note.
UPDATE {schema}.jobs
SET cancelled_attempt = attempts,
    state = CASE WHEN state = 'running' THEN 'running' ELSE 'cancelled' END,
    last_error = concat_ws('; ', CASE WHEN revoked_at IS NOT NULL THEN last_error END,
                           %(note)s::text),
    updated_at = now()
WHERE id = %(id)s AND attempts = %(attempt)s AND state IN ('running', 'completed', 'dead');

-- name: job_retried
-- The task of this delivery sent a Celery retry (task_retry, in the process that ran it, before
-- the ack): the next try is a new job of the same task id with retries + 1. This row still ends
-- 'completed' (Celery acks it); it is counted and shown as retried, with the retry's reason.
UPDATE {schema}.jobs
SET retried_attempt = attempts, last_error = %(note)s, updated_at = now()
WHERE id = %(id)s AND attempts = %(attempt)s AND state IN ('running', 'completed');
