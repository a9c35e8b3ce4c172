-- 0002 results: the tables of the Celery result backend (pgbroker.backend.DatabaseBackend).
--
-- Results live in tables of their own, never in the jobs row: a result outlives its job (or is
-- kept for less time), the jobs table stays narrow, and the backend also serves applications
-- whose broker is not pgbroker.
-- Operational caveats: none; creates new objects only.

-- One row per task id: the state Celery stored last.
CREATE TABLE {schema}.results (
    task_id      text        PRIMARY KEY,
    status       text        NOT NULL,              -- Celery state: PENDING ... SUCCESS, or custom
    payload      bytea       NOT NULL,              -- the meta exactly as Celery encoded it (any
                                                    -- serializer, maybe compressed): what
                                                    -- AsyncResult reads back
    content_type text        NOT NULL,
    result       jsonb,                             -- queryable copy of the result (or of the
                                                    -- exception); NULL unless JSON-representable
    traceback    text,
    date_done    timestamptz,
    -- result_extended fields (NULL unless result_extended = True)
    name         text,
    args         jsonb,
    kwargs       jsonb,
    worker       text,
    retries      integer,
    queue        text,
    group_id     text,
    parent_id    text,
    expires_at   timestamptz,                       -- NULL: kept until forgotten
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT results_status_check CHECK (status <> '')
);

-- result_expires clean-up (backend.cleanup(), beat's celery.backend_cleanup): oldest first, in
-- small batches. Partial: rows kept forever never enter it.
CREATE INDEX results_expires_idx ON {schema}.results (expires_at) WHERE expires_at IS NOT NULL;

-- Results of a group saved with GroupResult.save() (and every chord header): the tuple of
-- member ids, encoded like a result.
CREATE TABLE {schema}.result_groups (
    group_id     text        PRIMARY KEY,
    payload      bytea       NOT NULL,
    content_type text        NOT NULL,
    expires_at   timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX result_groups_expires_idx ON {schema}.result_groups (expires_at)
    WHERE expires_at IS NOT NULL;

-- One row per chord: the atomic counter that replaces celery.chord_unlock polling. The header
-- task that brings `done` to `size + extra` claims the callback (claimed_by) and dispatches it;
-- dispatched_at then stays as a marker so that a late duplicate of a header task is ignored.
CREATE TABLE {schema}.result_chords (
    group_id      text        PRIMARY KEY,
    size          integer,                          -- header size; NULL until known
    extra         integer     NOT NULL DEFAULT 0,   -- tasks added with Task.add_to_chord()
    done          integer     NOT NULL DEFAULT 0,   -- header tasks counted (each one once)
    claimed_by    uuid,
    claimed_at    timestamptz,
    dispatched_at timestamptz,
    expires_at    timestamptz,
    created_at    timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT result_chords_counts_check CHECK (done >= 0 AND extra >= 0 AND size >= 0)
);
CREATE INDEX result_chords_expires_idx ON {schema}.result_chords (expires_at)
    WHERE expires_at IS NOT NULL;

-- The header tasks already counted, so that a task run twice (acks_late redelivery after a lost
-- worker) counts once. Keyed by index too: a reused frozen signature repeats its task id.
-- Deleted with their chord row (no foreign key: a part may be counted before its chord row is
-- written, in the same statement).
CREATE TABLE {schema}.result_chord_parts (
    group_id     text        NOT NULL,
    task_id      text        NOT NULL,
    group_index  integer     NOT NULL DEFAULT -1,
    PRIMARY KEY (group_id, task_id, group_index)
);
