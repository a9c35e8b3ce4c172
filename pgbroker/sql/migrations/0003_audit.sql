-- 0003 audit: who did what to which job or queue, and when (issue 7: CLI and admin actions).
--
-- Every operator action (retry or discard of a dead job, cancel, purge, pause, resume) writes its
-- row in the same statement as the action itself, so an action without its audit row (or the
-- reverse) cannot be committed. `detail` keeps what the action destroyed or replaced: the last
-- error and traceback of a retried dead job, the metadata of a discarded one.
--
-- Operational caveats: creates a new table only; no lock on `jobs`. The table grows with operator
-- activity (one row per job for dead retry/discard, one per purge): prune it by `at` if needed.

CREATE TABLE {schema}.audit (
    id      bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at      timestamptz NOT NULL DEFAULT now(),
    actor   text        NOT NULL,          -- OS user (CLI) or logged-in user (admin page)
    action  text        NOT NULL,          -- 'dead.retry', 'dead.discard', 'job.cancel', ...
    target  text,                          -- a job id or a queue name
    detail  jsonb       NOT NULL DEFAULT '{}'
);

-- The admin page lists the newest rows first.
CREATE INDEX audit_at_idx ON {schema}.audit (at DESC);

-- The history of one job or queue ("who retried this, and what was its error then?").
CREATE INDEX audit_target_idx ON {schema}.audit (target, at DESC) WHERE target IS NOT NULL;
