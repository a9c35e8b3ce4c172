-- The job keys' tables: rate limits (pgbroker._consume.rate_limits) and concurrency keys (read by job_claim).

-- name: rate_limits_set
-- The configured limits, as a consumer starts: the ones not given are removed, the others
-- inserted or changed (a row whose limit is unchanged is not written, so consumers starting
-- together do not queue behind each other's row locks; a changed one keeps its window).
WITH wanted AS (
    SELECT * FROM unnest(%(tasks)s::text[], %(max_starts)s::int[], %(periods)s::float8[],
                         %(rates)s::text[]) AS w(task, max_starts, period_s, rate)
), removed AS (
    DELETE FROM {schema}.rate_limits WHERE task NOT IN (SELECT task FROM wanted)
)
INSERT INTO {schema}.rate_limits AS r (task, max_starts, period_s, rate)
SELECT task, max_starts, period_s, rate FROM wanted
ON CONFLICT (task) DO UPDATE
SET max_starts = EXCLUDED.max_starts, period_s = EXCLUDED.period_s, rate = EXCLUDED.rate,
    updated_at = now()
WHERE (r.max_starts, r.period_s, r.rate)
      IS DISTINCT FROM (EXCLUDED.max_starts, EXCLUDED.period_s, EXCLUDED.rate);

-- name: concurrency_keys_prune
-- Keys with no job running for an hour: their rows go (keys like "source:<id>" would otherwise
-- pile up). SKIP LOCKED, and the delete re-checks 'running' on the newest version: a key a
-- claim takes meanwhile is kept; a claim finding its row gone takes no slot that turn and
-- creates it again the next.
WITH idle AS MATERIALIZED (
    SELECT key FROM {schema}.concurrency_keys
    WHERE running = 0
      AND updated_at < coalesce(%(now)s::timestamptz, now()) - interval '1 hour'
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM {schema}.concurrency_keys AS k USING idle
WHERE k.key = idle.key AND k.running = 0;
