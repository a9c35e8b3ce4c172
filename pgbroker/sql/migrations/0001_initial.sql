-- 0001 initial: the jobs table, the queues and consumers registry.
--
-- {schema} is replaced by the configured schema name (quoted identifier) before this runs.
-- Operational caveats: none; creates new objects only. Runs in one transaction under the
-- migration advisory lock, so several processes starting at once apply it exactly once.

CREATE TABLE {schema}.jobs (
    id               uuid        PRIMARY KEY,              -- UUIDv7, made in Python
    queue            text        NOT NULL,
    task             text,                                 -- Celery task name; NULL for plain kombu
    task_id          text,                                 -- Celery task id (headers.id)
    retries          integer     NOT NULL DEFAULT 0,       -- Celery headers.retries
    exchange         text        NOT NULL DEFAULT '',
    routing_key      text        NOT NULL DEFAULT '',
    body             bytea       NOT NULL,
    content_type     text,
    content_encoding text,
    headers          jsonb       NOT NULL DEFAULT '{}',
    properties       jsonb       NOT NULL DEFAULT '{}',
    state            text        NOT NULL DEFAULT 'pending',   -- see the state machine in docs/design.md
    priority         smallint    NOT NULL DEFAULT 0,       -- AMQP direction: higher runs first
    attempts         integer     NOT NULL DEFAULT 0,       -- deliveries so far (+1 at claim)
    max_attempts     integer     NOT NULL DEFAULT 5,
    run_at           timestamptz NOT NULL DEFAULT now(),
    expires_at       timestamptz,
    locked_at        timestamptz,
    locked_by        uuid,                                 -- consumers.id
    last_error       text,                                 -- why the last attempt failed
    last_traceback   text,
    failed_attempt   integer,                              -- the attempt whose task raised
    idempotency_key  text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT jobs_state_check
        CHECK (state IN ('scheduled', 'pending', 'running', 'completed', 'dead', 'cancelled', 'expired')),
    CONSTRAINT jobs_attempts_check CHECK (attempts >= 0 AND attempts <= max_attempts),
    CONSTRAINT jobs_max_attempts_check CHECK (max_attempts >= 1),
    CONSTRAINT jobs_priority_check CHECK (priority BETWEEN 0 AND 255),
    CONSTRAINT jobs_running_locked_check CHECK (state <> 'running' OR locked_by IS NOT NULL)
);

-- The claim: due pending jobs of a queue in priority order. Partial, so its size is the
-- backlog, not the table (completed rows kept for the retention window never enter it).
CREATE INDEX jobs_claim_idx ON {schema}.jobs (queue, priority DESC, run_at, id)
    WHERE state = 'pending';

-- Delayed jobs (eta/countdown, retries with backoff) wait as 'scheduled' in their own index and are
-- promoted to 'pending' when due. Keeping them out of jobs_claim_idx means a claim never walks
-- past future rows to fill its LIMIT, however many are waiting.
CREATE INDEX jobs_scheduled_idx ON {schema}.jobs (queue, run_at) WHERE state = 'scheduled';

-- The sweep: running jobs by owner, to find those of consumers that are gone.
CREATE INDEX jobs_running_idx ON {schema}.jobs (locked_by) WHERE state = 'running';

-- Expiry of pending jobs that were never delivered in time.
CREATE INDEX jobs_expires_idx ON {schema}.jobs (expires_at)
    WHERE state IN ('pending', 'scheduled') AND expires_at IS NOT NULL;

-- Retention pruning of finished rows, oldest first, in small batches.
CREATE INDEX jobs_finished_idx ON {schema}.jobs (updated_at)
    WHERE state IN ('completed', 'cancelled', 'expired');

-- Idempotency (contract 3): one job per (task, key). NULL keys never conflict.
CREATE UNIQUE INDEX jobs_idempotency_key_idx ON {schema}.jobs (task, idempotency_key)
    WHERE idempotency_key IS NOT NULL;

-- A producer's own publish retry (connection lost after the INSERT committed) must not make a
-- second copy. Celery's retry() publishes the same task id with retries + 1, so it is not blocked.
-- The queue is part of the key because one message routed to two queues is two jobs. Led by
-- task_id, it also serves look-ups by Celery task id (revoke, the admin page, beat), so no second
-- index on task_id has to be maintained by every claim and ack.
CREATE UNIQUE INDEX jobs_task_delivery_idx ON {schema}.jobs (task_id, retries, queue)
    WHERE task_id IS NOT NULL;

-- Dead letters, newest first.
CREATE INDEX jobs_dead_idx ON {schema}.jobs (queue, updated_at DESC) WHERE state = 'dead';

-- Jobs churn: vacuum the table more eagerly than the default 20 % of dead tuples.
ALTER TABLE {schema}.jobs SET (autovacuum_vacuum_scale_factor = 0.02,
                               autovacuum_analyze_scale_factor = 0.02,
                               fillfactor = 90);

-- Queues known to the broker: declared by consumers and producers. Paused queues are not claimed.
CREATE TABLE {schema}.queues (
    name          text        PRIMARY KEY,
    paused        boolean     NOT NULL DEFAULT false,
    arguments     jsonb       NOT NULL DEFAULT '{}',     -- x-expires, x-message-ttl, ...
    created_at    timestamptz NOT NULL DEFAULT now(),
    last_used_at  timestamptz NOT NULL DEFAULT now()
);

-- Exchanges and bindings live here, not only in each process's memory, so that every process
-- routes alike: a worker replying to `celery inspect` must find the client's reply queue.
CREATE TABLE {schema}.exchanges (
    name          text        PRIMARY KEY,
    type          text        NOT NULL CHECK (type IN ('direct', 'topic', 'fanout')),
    durable       boolean     NOT NULL DEFAULT true,
    auto_delete   boolean     NOT NULL DEFAULT false,
    arguments     jsonb       NOT NULL DEFAULT '{}',
    created_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE {schema}.bindings (
    exchange      text        NOT NULL,
    routing_key   text        NOT NULL,
    queue         text        NOT NULL REFERENCES {schema}.queues (name) ON DELETE CASCADE,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (exchange, routing_key, queue)
);
CREATE INDEX bindings_queue_idx ON {schema}.bindings (queue);

-- Fanout messages (remote control) and transient topic messages (worker events) go to whoever
-- is consuming a bound queue right now, like RabbitMQ's auto-delete queues. The message is
-- written here once and a NOTIFY carries only its id: notifications are readable by any role,
-- and pg_notify stops at 8000 bytes. Rows are pruned after a minute by the sweeper.
CREATE TABLE {schema}.broadcasts (
    id               uuid        PRIMARY KEY,
    exchange         text        NOT NULL,
    routing_key      text        NOT NULL DEFAULT '',
    body             bytea       NOT NULL,
    content_type     text,
    content_encoding text,
    headers          jsonb       NOT NULL DEFAULT '{}',
    properties       jsonb       NOT NULL DEFAULT '{}',
    created_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX broadcasts_created_idx ON {schema}.broadcasts (created_at);

-- Consumers alive now. Each holds a session advisory lock (lock_key) while its connection lives
-- and heartbeats; the sweeper rescues the running jobs of those whose lock is gone or whose
-- heartbeat is older than the lease timeout.
CREATE TABLE {schema}.consumers (
    id            uuid        PRIMARY KEY,
    host          text        NOT NULL,
    pid           integer     NOT NULL,
    queues        text[]      NOT NULL DEFAULT '{}',
    lock_key      integer,                                -- NULL when advisory locks are off
    started_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now()
);
