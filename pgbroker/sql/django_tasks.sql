-- What the django.tasks backend (pgbroker/contrib/django/_tasks_backend.py) reads: a task's
-- latest job and its result. {schema} is the quoted schema name; every value is a bound
-- parameter. Tables: migrations 0001 (jobs) and 0002 (results).

-- name: job_get_for_django_task
-- The newest job of Celery task id %(task_id)s (a retry publishes a new message with the same
-- id: the newest is the one that runs now or ran last), with the result row of that task id.
SELECT j.state, j.body, j.content_type, j.content_encoding, j.attempts, j.created_at,
       j.locked_at, j.locked_by, j.updated_at, j.last_error, j.last_traceback,
       r.status AS result_status, r.result
FROM {schema}.jobs AS j
LEFT JOIN {schema}.results AS r ON r.task_id = j.task_id
WHERE j.task_id = %(task_id)s
ORDER BY j.id DESC
LIMIT 1
