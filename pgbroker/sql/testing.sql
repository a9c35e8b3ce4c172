-- What pgbroker.testing reads and writes: the jobs a test enqueued, and the end of the ones it
-- ran in its own process. {schema} is the quoted schema name; every value is a bound parameter.
-- These run on the test's own connection, inside its transaction (Django's TestCase), so they
-- see jobs no other session can see yet.

-- name: job_list_for_test
-- The jobs of %(states)s (every state when NULL), of task %(task)s and queue %(queue)s when
-- given, oldest first; %(due)s: only those due now (run_at reached), highest priority first.
SELECT id, task, task_id, queue, state, body, content_type, content_encoding, headers,
       priority, attempts, max_attempts, run_at, idempotency_key, last_error
FROM {schema}.jobs
WHERE (%(states)s::text[] IS NULL OR state = ANY (%(states)s::text[]))
  AND (%(task)s::text IS NULL OR task = %(task)s::text)
  AND (%(queue)s::text IS NULL OR queue = %(queue)s::text)
  AND (NOT %(due)s OR run_at <= now())
ORDER BY CASE WHEN %(due)s THEN -priority ELSE 0 END, id

-- name: job_finish_for_test
-- A job the test ran in its own process: 'completed', or 'dead' with its error (%(error)s not
-- NULL). Only from a state that waits (a worker may have claimed it meanwhile: then nothing).
UPDATE {schema}.jobs
SET state = CASE WHEN %(error)s::text IS NULL THEN 'completed' ELSE 'dead' END,
    attempts = least(attempts + 1, max_attempts),
    last_error = %(error)s::text,
    updated_at = now()
WHERE id = %(id)s AND state IN ('pending', 'scheduled')

-- name: job_delete_for_test
-- Every job (Django's TransactionTestCase empties the tables of models only, and pgbroker's
-- are not models): a test starts with an empty queue.
DELETE FROM {schema}.jobs
