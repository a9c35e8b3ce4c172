"""Transport options -> one frozen, validated :class:`Settings` object.

Every option has a named default here; an unknown option is an error that names the closest
known one, so a typo in ``broker_transport_options`` never passes silently. Options of other
transports (Redis's ``visibility_timeout``, ``polling_interval``...) are mapped or warned about by
:mod:`pgbroker._model.foreign_options`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any

from ._model.foreign_options import translate
from ._model.rate_limits import RateLimit, parse_rate_limits
from .errors import ConfigurationError

__all__ = ["Settings"]

# fullmatch: "$" alone also matches before a final newline, and "name\n" would pass
_SCHEMA_RE = re.compile(r"[a-z_][a-z0-9_]{0,47}")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Validated pgbroker options (``broker_transport_options`` in Celery)."""

    #: Schema holding pgbroker's tables; separate schemas isolate applications sharing a database.
    schema: str = "pgbroker"
    #: Apply pending migrations on first connect (under an advisory lock).
    auto_migrate: bool = True
    #: Deliveries a message may have before it goes ``dead`` (a per-message header overrides it).
    max_attempts: int = 5
    #: Seconds finished (completed/expired/cancelled) rows are kept; 0 deletes on ack.
    retention: float = 86400.0
    #: Seconds without a heartbeat after which a consumer is gone and its running jobs rescued.
    lease_timeout: float = 20.0
    #: Seconds between a consumer's heartbeats.
    heartbeat_interval: float = 5.0
    #: Seconds between sweeps (orphan rescue, expiry, promotion, pruning) in each consumer.
    sweep_interval: float = 5.0
    #: Seconds between claims when no notification arrives: the fallback for lost NOTIFYs.
    poll_interval: float = 5.0
    #: Upper bound of one claim's batch when the prefetch count is unlimited.
    claim_batch_max: int = 100
    #: Rows deleted per pruning statement.
    prune_batch_size: int = 1000
    #: Use session advisory locks to detect dead consumers at once (turn off behind PgBouncer
    #: transaction pooling, where heartbeats alone are the guarantee).
    use_advisory_locks: bool = True
    #: Largest message body accepted at publish, in bytes (RabbitMQ's default is 16 MiB).
    max_message_size: int = 16 * 1024 * 1024
    #: Largest headers and properties accepted at publish, together, in bytes of their JSON
    #: (RabbitMQ's frame_max: a header frame larger than 128 KiB fails there).
    max_header_size: int = 128 * 1024
    #: The connections go through a transaction-pooling PgBouncer (or another pooler that hands
    #: a server session to a client for one transaction only): no named prepared statements and
    #: no session settings (every commit waits for the WAL flush, acks too), and no advisory locks
    #: (heartbeats are the guarantee). Producers find out by themselves at the first statement
    #: the pooler breaks; say it here to skip that one failed statement.
    transaction_pooling: bool = False
    #: Seconds to wait for a connection to the database.
    connect_timeout: float = 10.0
    #: Wait for the WAL flush when publishing (PostgreSQL's synchronous_commit). Off is an opt-in
    #: fast mode: a *database* crash can then lose the publishes of its last ~0.6 s.
    durable_publish: bool = True
    #: Wait for the WAL flush when claiming, acking and requeueing. Off by default, and safe:
    #: a lost claim or ack only brings the row back to pending/running after a database crash,
    #: so the job is redelivered (at-least-once), never lost.
    durable_acks: bool = False
    #: Task names that must be sent with an idempotency key.
    require_idempotency_key: frozenset[str] = frozenset()
    #: Deliveries of one task name in a row that lose their worker (killed, out of memory,
    #: unreachable) before that task name is paused (not claimed until resumed); 0: never.
    pause_task_after: int = 5
    #: Cluster-wide rate limits, ``{task name: "10/s"}`` (Celery's rate syntax; pgbroker's
    #: claims of the task by every consumer together). None: leave the database's as they are.
    rate_limits: tuple[RateLimit, ...] | None = None
    #: Seconds VACUUM's horizon may be held (a long transaction, a held snapshot, a replication
    #: slot) before a worker's sweeper logs a WARNING naming who holds it; 0: never.
    xmin_warn_after: float = 300.0

    def __post_init__(self) -> None:
        if not isinstance(self.schema, str) or not _SCHEMA_RE.fullmatch(self.schema):
            raise ConfigurationError(
                f"schema {self.schema!r} is not a valid pgbroker schema name: use lower-case "
                "letters, digits and underscores, at most 48 characters, not starting with a digit"
            )
        for name in ("auto_migrate", "use_advisory_locks", "durable_publish", "durable_acks",
                     "transaction_pooling"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"{name} must be true or false, not "
                                         f"{getattr(self, name)!r}")
        for name in ("max_attempts", "claim_batch_max", "prune_batch_size", "max_message_size",
                     "max_header_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(f"{name} must be a positive integer, not {value!r}")
        if not isinstance(self.pause_task_after, int) or isinstance(self.pause_task_after, bool) \
                or self.pause_task_after < 0:
            raise ConfigurationError(f"pause_task_after must be an integer >= 0 (0: never pause), "
                                     f"not {self.pause_task_after!r}")
        for name in ("retention", "lease_timeout", "heartbeat_interval", "sweep_interval",
                     "poll_interval", "connect_timeout", "xmin_warn_after"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                raise ConfigurationError(f"{name} must be a number of seconds >= 0, not {value!r}")
        if self.rate_limits is not None and not (isinstance(self.rate_limits, tuple) and all(
                isinstance(limit, RateLimit) for limit in self.rate_limits)):
            object.__setattr__(self, "rate_limits", parse_rate_limits(self.rate_limits))
        if self.heartbeat_interval <= 0 or self.lease_timeout < 2 * self.heartbeat_interval:
            raise ConfigurationError(
                f"lease_timeout ({self.lease_timeout}) must be at least twice heartbeat_interval "
                f"({self.heartbeat_interval}), or a living consumer could lose its jobs"
            )

    @property
    def channel(self) -> str:
        """The LISTEN/NOTIFY channel of this schema."""
        return f"{self.schema}.jobs"

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None = None) -> Settings:
        """Build settings from kombu transport options, refusing unknown ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = translate(options or {}, known)  # other transports' options: mapped or warned
        if "require_idempotency_key" in values:
            values["require_idempotency_key"] = _names(values["require_idempotency_key"])
        if values.get("rate_limits") is not None:
            values["rate_limits"] = parse_rate_limits(values["rate_limits"])
        return cls(**values)


def _names(value: str | Iterable[str]) -> frozenset[str]:
    if isinstance(value, str):
        value = [value]
    return frozenset(value)
