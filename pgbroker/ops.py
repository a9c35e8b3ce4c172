"""The operator's actions and look-ups, shared by the CLI (``pgbroker``) and the admin page.

One implementation, two front-ends: :class:`Operations` runs the named queries of
``sql/ops.sql`` over a psycopg connection the caller owns (the CLI opens one, the admin page
borrows one from its pool per request); beat's schedule has its sibling,
:class:`pgbroker.schedules.Schedules`. Every action writes an audit row (who, what, when, and
what the action replaced or destroyed) in the same statement as the change itself.

Errors an operator can make (a malformed or unknown job id, an unknown queue, a job in the wrong
state) raise :class:`OperationError` with a message meant for them; nothing has changed then.

Long actions (retry or discard of every dead job, purge) run in batches of short transactions
and report progress after each: a huge backlog never holds one long transaction, and an
interrupted run keeps what its finished batches did (the audit rows say exactly what).
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from . import signals
from ._pg.catalogue import Queries
from .errors import OperationError
from .settings import Settings

__all__ = [
    "BULK_ACTIONS",
    "IDLE_QUEUE_SECONDS",
    "JOB_STATES",
    "SMALL_STATES",
    "Browsed",
    "JobFilter",
    "OperationError",
    "Operations",
    "Progress",
    "body_text",
    "is_poison",
    "os_user",
    "parse_job_id",
]

logger = logging.getLogger(__name__)

#: Every state a job can be in (the CHECK constraint of ``jobs.state``).
JOB_STATES = ("scheduled", "pending", "running", "completed", "dead", "cancelled", "expired")

#: The states that stay small in a healthy system, each with its partial index: a filter on one
#: of them reads that index whole; the others (finished rows) are read a window at a time.
SMALL_STATES = ("pending", "scheduled", "running", "dead")

#: Bulk actions and the states each one acts on (the rest of what a filter matches is left).
BULK_ACTIONS = {"retry": ("dead",), "discard": ("dead",), "cancel": ("pending", "scheduled")}

#: Rows per batch of the long actions.
DEFAULT_BATCH_SIZE = 1000

#: Default of ``pgbroker queues prune --idle``: a week without a declaration or a consumer.
IDLE_QUEUE_SECONDS = 7 * 86400.0

_UUID_MIN = uuid.UUID(int=0)
_UUID_MAX = uuid.UUID(int=(1 << 128) - 1)

#: ``progress(done, total)`` after each batch of a long action.
Progress = Callable[[int, int], None]


def parse_job_id(text: str) -> uuid.UUID:
    """A job id (a UUID) from the operator's text, or :class:`OperationError`."""
    try:
        return uuid.UUID(str(text).strip())
    except ValueError:
        raise OperationError(f"{text!r} is not a job id (a job id is a UUID, such as "
                             f"0190d3c4-5e6f-7a8b-9c0d-1e2f3a4b5c6d)") from None


#: The endings of a delivery that killed or lost its worker, as ``last_error`` words them once the
#: attempts are used up: the sweeper's (``job_rescue``: the whole worker died) and the transport's
#: requeue reason (Celery gave the message back after its pool process died, with
#: ``task_reject_on_worker_lost``; rows written before that reason existed say "requeued by the
#: consumer").
POISON_WORDS = ("consumer was lost", "pool process was lost", "requeued by the consumer")


def is_poison(last_error: str | None) -> bool:
    """True for a dead job that killed (or lost) its worker on every attempt: a poison job.

    The ``metrics_active`` query in ``sql/ops.sql`` counts the same test in SQL.
    """
    return bool(last_error and last_error.startswith("max attempts (")
                and any(words in last_error for words in POISON_WORDS))


def body_text(body: bytes | memoryview | None, content_type: str | None,
              limit: int = 65536) -> str:
    """A job's body for a human: pretty JSON, else text, else a hex dump; cut at ``limit``."""
    raw = bytes(body or b"")
    cut = len(raw) > limit
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = "<binary> " + raw[:limit // 2].hex(" ")
    else:
        if content_type and "json" in content_type and not cut:
            try:
                text = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
            except ValueError:
                pass
        text = text[:limit]
    return text + (f"\n... ({len(raw)} bytes in all)" if cut else "")


def id_at(t: datetime) -> uuid.UUID:
    """The lowest UUIDv7 made at ``t``: job ids at or after it were made at ``t`` or later (the
    first 48 bits of a UUIDv7 are its Unix time in milliseconds, by the producer's clock)."""
    return uuid.UUID(int=int(t.timestamp() * 1000) << 80)


def time_of(job_id: uuid.UUID) -> datetime | None:
    """When a UUIDv7 job id was made (None for another kind of UUID)."""
    if job_id.version != 7:
        return None
    return datetime.fromtimestamp((job_id.int >> 80) / 1000, timezone.utc)


@dataclass(frozen=True)
class JobFilter:
    """What the jobs browser and its bulk actions match (every field optional).

    ``created_from``/``created_to`` bound the job id (a UUIDv7: its creation time by the
    producer's clock), so a time range is a range scan of the primary key. ``text`` matches a raw
    body that contains it (bytes, exact) or Celery's ``argsrepr``/``kwargsrepr`` headers (any
    case): the task's arguments, without decoding every body.
    """

    queue: str | None = None
    task: str | None = None
    state: str | None = None
    created_from: datetime | None = None
    created_to: datetime | None = None
    text: str | None = None

    def __post_init__(self) -> None:
        if self.state is not None and self.state not in JOB_STATES:
            raise OperationError(f"unknown state {self.state!r}: use one of "
                                 f"{', '.join(JOB_STATES)}")
        if self.created_from and self.created_to and self.created_from >= self.created_to:
            raise OperationError("the time range is empty: 'from' must be before 'to'")

    def params(self, before: uuid.UUID | None = None) -> dict[str, Any]:
        """The statements' parameters; ``before``: only ids below it (the browser's cursor)."""
        upper = id_at(self.created_to) if self.created_to else _UUID_MAX
        if before is not None:
            upper = min(upper, before)
        like = None
        if self.text:
            like = "%" + self.text.replace("\\", "\\\\").replace("%", "\\%").replace(
                "_", "\\_") + "%"
        return {"queue": self.queue, "task": self.task, "state": self.state,
                "id_from": id_at(self.created_from) if self.created_from else _UUID_MIN,
                "id_to": upper, "text": self.text or None,
                "text_bytes": self.text.encode("utf-8") if self.text else None,
                "text_like": like}

    def describe(self) -> dict[str, str]:
        """The fields that are set, for an audit row and a confirmation page."""
        return {k: v.isoformat() if isinstance(v, datetime) else v
                for k, v in vars(self).items() if v}


@dataclass(frozen=True)
class Browsed:
    """One page of the jobs browser."""

    rows: list[dict[str, Any]]
    older: uuid.UUID | None       #: the cursor of the next (older) page; None: this is the last
    complete: bool                #: True: every match below the cursor is on this page or older
    searched_to: datetime | None  #: else: jobs created since then were searched


def os_user() -> str:
    """The operating-system user running this process: the CLI's audit actor."""
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001 - no login name (a container with an unnamed uid)
        return f"uid:{os.getuid()}"


@dataclass(frozen=True)
class _Resolved:
    changed: int
    audited: int


class Operations:
    """The actions and look-ups of one actor over one connection (autocommit mode)."""

    def __init__(self, conn: psycopg.Connection[Any], schema: str = "pgbroker", *,
                 actor: str, via: str):
        self.conn = conn
        self.settings = Settings(schema=schema)  # validates the name
        self.q = Queries(schema)
        self.actor = actor
        self.via = via

    # -- plumbing --------------------------------------------------------------------------------

    def _rows(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        return self.q.dicts(self.conn, name, params)

    def _one(self, name: str, params: dict[str, Any]) -> tuple[Any, ...]:
        row: tuple[Any, ...] | None = self.q.one(self.conn, name, params)
        assert row is not None, name
        return row

    def _base(self) -> dict[str, Any]:
        return {"actor": self.actor, "via": self.via, "channel": self.settings.channel}

    def _refuse(self, job_id: uuid.UUID, allowed: Sequence[str], verb: str) -> OperationError:
        """Why an action on one job changed nothing (called after it did)."""
        rows = self._rows("job_state", {"id": job_id})
        if not rows:
            return OperationError(f"no job with id {job_id}")
        state = rows[0]["state"]
        if state in allowed:  # SKIP LOCKED passed it over: someone else holds it right now
            return OperationError(f"job {job_id} is being changed by another transaction right "
                                  f"now; try again")
        return OperationError(f"job {job_id} is {state}: only {' or '.join(allowed)} jobs can "
                              f"be {verb}")

    def _require_queue(self, name: str) -> None:
        if not name or not self._one("queue_exists", {"name": name})[0]:
            known = [r["name"] for r in self._rows("metrics_queues", {})]
            hint = f" (known queues: {', '.join(known[:20])})" if known else " (none is known)"
            raise OperationError(f"unknown queue {name!r}{hint}")

    # -- look-ups --------------------------------------------------------------------------------

    def job(self, job_id: str | uuid.UUID) -> dict[str, Any]:
        """One job with everything stored about it; :class:`OperationError` if none."""
        jid = job_id if isinstance(job_id, uuid.UUID) else parse_job_id(job_id)
        rows = self._rows("job_show", {"id": jid})
        if not rows:
            raise OperationError(f"no job with id {jid}")
        return rows[0]

    def chain(self, task_id: str) -> list[dict[str, Any]]:
        """Every job of one Celery task id, oldest try first: each Celery retry is a new job
        with ``retries + 1``; ``retried`` marks a try that sent one (its row is completed)."""
        return self._rows("job_history", {"task_id": task_id})

    def lookup(self, text: str) -> list[dict[str, Any]]:
        """Jobs whose job id, Celery task id or idempotency key is ``text`` (newest first)."""
        text = text.strip()
        if not text:
            raise OperationError("nothing to look up: give a job id, task id or idempotency key")
        try:
            rows = self._rows("job_show", {"id": uuid.UUID(text)})
        except ValueError:
            rows = []
        return rows or self._rows("job_lookup", {"key": text})

    def jobs(self, queue: str | None = None, state: str | None = None, task: str | None = None,
             limit: int = 50) -> list[dict[str, Any]]:
        """The newest jobs, optionally filtered by queue, state and task name."""
        if state is not None and state not in JOB_STATES:
            raise OperationError(f"unknown state {state!r}: use one of {', '.join(JOB_STATES)}")
        if limit < 1:
            raise OperationError(f"limit must be at least 1, not {limit}")
        return self._rows("job_list", {"queue": queue, "state": state, "task": task,
                                       "limit": limit})

    def browse(self, match: JobFilter, before: uuid.UUID | None = None, limit: int = 50,
               scan: int = 20000) -> Browsed:
        """A page of the jobs that match, newest first, below the cursor ``before``.

        A filter on a small state (:data:`SMALL_STATES`) reads that state's partial index and is
        complete. Any other is looked for among the newest ``scan`` jobs below the cursor (a
        range of the primary key): a filter that matches little never reads the whole table, and
        :attr:`Browsed.searched_to` says how far back this page looked.
        """
        params = match.params(before)
        if match.state in SMALL_STATES:
            rows = self._rows("job_browse_state", {**params, "limit": limit + 1})
            return Browsed(rows[:limit], rows[limit - 1]["id"] if len(rows) > limit else None,
                           True, None)
        low, n = self._one("job_window", {**params, "scan": scan})
        if low is None:
            return Browsed([], None, True, None)
        rows = self._rows("job_browse_window", {**params, "id_from": low, "limit": limit + 1})
        if len(rows) > limit:
            return Browsed(rows[:limit], rows[limit - 1]["id"], False, None)
        if n < scan:  # the window reached the lower end of the range: nothing older
            return Browsed(rows, None, True, None)
        return Browsed(rows, low, False, time_of(low))

    def count_matching(self, match: JobFilter, states: Sequence[str]) -> dict[str, int]:
        """How many jobs of each of ``states`` (small states only) match, exactly."""
        if not set(states) <= set(SMALL_STATES):
            raise OperationError(f"only {', '.join(SMALL_STATES)} jobs can be counted here")
        if match.state is not None:
            states = [s for s in states if s == match.state]
        params = match.params()
        return {state: int(self._one("job_count_matching", {**params, "state": state})[0])
                for state in states}

    def bulk(self, action: str, match: JobFilter, *, batch_size: int = DEFAULT_BATCH_SIZE,
             progress: Progress | None = None) -> int:
        """Retry, discard or cancel every job that matches (:data:`BULK_ACTIONS` says which
        states each acts on), in batches; returns how many.

        One audit row for the action (the filter, how many matched when it began, how many it
        changed, batch by batch) and one per job as for a single action, pointing at it ("bulk").
        Only the jobs there when it began are acted on: those created (cancel) or dead (retry,
        discard) since are left alone.
        """
        if action not in BULK_ACTIONS:
            raise OperationError(f"unknown bulk action {action!r}: use one of "
                                 f"{', '.join(BULK_ACTIONS)}")
        if batch_size < 1:
            raise OperationError(f"batch size must be at least 1, not {batch_size}")
        before = self._db_now()
        found = sum(self.count_matching(match, BULK_ACTIONS[action]).values())
        bulk = self._one("audit_insert", {
            "actor": self.actor, "action": f"jobs.bulk_{action}", "target": None,
            "detail": Jsonb({"via": self.via, "filter": match.describe(), "found": found,
                             "done": 0})})[0]
        done = 0
        while True:
            if action == "cancel":
                n = int(self._one("job_cancel_matching", {
                    **self._base(), **match.params(), "limit": batch_size, "before": before,
                    "bulk": bulk})[0])
            else:
                n = self._resolve(action, None, match, batch_size, before, bulk).changed
            if n:
                self._one("audit_bulk_done", {"id": bulk, "done": n})
                done += n
                if progress is not None:
                    progress(done, max(found, done))
            if n < batch_size:
                break
        logger.info("pgbroker: %s bulk %s: %d job(s) matching %s", self.actor, action, done,
                    match.describe())
        return done

    def dead(self, queue: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        """Dead letters, most recent first, each with a ``poison`` flag."""
        rows = self._rows("dead_list", {"queue": queue, "limit": limit})
        for row in rows:
            row["poison"] = is_poison(row["last_error"])
        return rows

    def audit(self, target: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        """Audit rows, newest first (of one job or queue when ``target`` is given)."""
        return self._rows("audit_list", {"target": target, "limit": limit})

    # -- dead letters ----------------------------------------------------------------------------

    def _db_now(self) -> Any:
        return self._one("metrics_clock", {"lag": 0})[0]

    def _resolve(self, action: str, ids: list[uuid.UUID] | None, match: JobFilter,
                 limit: int, before: Any = None, bulk: int | None = None) -> _Resolved:
        row = self._one("dead_resolve", {**self._base(), **match.params(), "action": action,
                                         "ids": ids, "limit": limit, "before": before,
                                         "bulk": bulk})
        return _Resolved(int(row[0]), int(row[1]))

    def retry_dead(self, job_id: str | uuid.UUID) -> None:
        """Put one dead job back to ``pending`` (attempts reset to 0) and wake its queue."""
        self._one_dead("retry", job_id, "retried")

    def discard_dead(self, job_id: str | uuid.UUID) -> None:
        """Delete one dead job; its audit row keeps its queue, task, error and traceback."""
        self._one_dead("discard", job_id, "discarded")

    def _one_dead(self, action: str, job_id: str | uuid.UUID, verb: str) -> None:
        jid = job_id if isinstance(job_id, uuid.UUID) else parse_job_id(job_id)
        if not self._resolve(action, [jid], JobFilter(), 1).changed:
            raise self._refuse(jid, ("dead",), verb)
        logger.info("pgbroker: %s %s dead job %s", self.actor, verb, jid)

    def retry_all_dead(self, queue: str | None = None, *, batch_size: int = DEFAULT_BATCH_SIZE,
                       progress: Progress | None = None) -> int:
        """Retry every dead job (of ``queue``), in batches; returns how many."""
        return self._all_dead("retry", queue, batch_size, progress)

    def discard_all_dead(self, queue: str | None = None, *,
                         batch_size: int = DEFAULT_BATCH_SIZE,
                         progress: Progress | None = None) -> int:
        """Discard every dead job (of ``queue``), in batches; returns how many."""
        return self._all_dead("discard", queue, batch_size, progress)

    def _all_dead(self, action: str, queue: str | None, batch_size: int,
                  progress: Progress | None) -> int:
        if batch_size < 1:
            raise OperationError(f"batch size must be at least 1, not {batch_size}")
        before = self._db_now()
        total = int(self._one("dead_count", {"queue": queue})[0])
        if queue is not None and not total:
            self._require_queue(queue)  # nothing dead there: is it a typo? (a queue row may
            #                             be gone, expired, while its dead letters stay)
        done = 0
        while True:
            # Each batch is its own statement: it commits, and the next one finds what is left.
            n = self._resolve(action, None, JobFilter(queue=queue), batch_size, before).changed
            done += n
            if n:
                if progress is not None:
                    progress(done, max(total, done))
            if n < batch_size:
                break
        if done:
            logger.info("pgbroker: %s %s %d dead job(s)%s", self.actor,
                        "retried" if action == "retry" else "discarded", done,
                        f" of queue {queue!r}" if queue else "")
        return done

    # -- jobs and queues -------------------------------------------------------------------------

    def cancel(self, job_id: str | uuid.UUID) -> None:
        """Cancel a pending or scheduled job: it will never run."""
        jid = job_id if isinstance(job_id, uuid.UUID) else parse_job_id(job_id)
        if not self._one("job_cancel", {**self._base(), "id": jid})[0]:
            raise self._refuse(jid, ("pending", "scheduled"), "cancelled")
        logger.info("pgbroker: %s cancelled job %s", self.actor, jid)

    def purge(self, queue: str, *, batch_size: int = DEFAULT_BATCH_SIZE,
              progress: Progress | None = None) -> int:
        """Delete every pending and scheduled job of ``queue`` (running ones finish), in
        batches; returns how many. Its audit row counts the deletions batch by batch."""
        self._require_queue(queue)
        if batch_size < 1:
            raise OperationError(f"batch size must be at least 1, not {batch_size}")
        total = int(self._one("queue_size", {"name": queue})[0])
        audit_id = self._one("audit_insert", {
            "actor": self.actor, "action": "queue.purge", "target": queue,
            "detail": Jsonb({"via": self.via, "deleted": 0, "found": total})})[0]
        before = self._db_now()
        done = 0
        while True:
            n = int(self._one("queue_purge_batch", {"queue": queue, "limit": batch_size,
                                                    "audit_id": audit_id, "before": before})[0])
            done += n
            if n and progress is not None:
                progress(done, max(total, done))
            if n == 0:
                break
        logger.info("pgbroker: %s purged %d job(s) of queue %r", self.actor, done, queue)
        return done

    def pause(self, queue: str) -> bool:
        """Stop workers claiming from ``queue``; False if it was already paused."""
        return self._set_paused(queue, True)

    def resume(self, queue: str) -> bool:
        """Let workers claim from ``queue`` again (and wake them); False if it was not paused."""
        return self._set_paused(queue, False)

    def prune_queues(self, idle: float = 0.0, *, batch_size: int = 1000) -> tuple[int, int]:
        """Delete the queues nobody uses (see ``queue_prune``) unused for ``idle`` seconds,
        with their bindings, and the exchanges as old left without a binding; returns how
        many queues and exchanges. One audit row per batch that deleted something."""
        queues = exchanges = 0
        while True:
            q, e = self._one("queue_prune", {**self._base(), "idle": idle, "limit": batch_size})
            queues, exchanges = queues + q, exchanges + e
            if q < batch_size:
                break
        if queues or exchanges:
            logger.info("pgbroker: %s pruned %d unused queue(s) and %d exchange(s)", self.actor,
                        queues, exchanges)
        return queues, exchanges

    # -- task names (sql/tasks.sql) ---------------------------------------------------------------

    def paused_tasks(self) -> list[dict[str, Any]]:
        """The paused task names: why, by whom, since when, the jobs that caused it (``job_ids``)
        and how many of its jobs wait (``waiting``)."""
        return self._rows("task_pause_list", {})

    def loss_streaks(self) -> list[dict[str, Any]]:
        """Task names whose last deliveries killed their pool process (``streak``) or took
        down whole workers (``workers``, each once), not (yet) paused."""
        return self._rows("task_loss_list", {})

    def pause_task(self, task: str, reason: str = "") -> bool:
        """Stop every worker claiming jobs of task name ``task`` (its jobs wait, pending);
        False if it was paused already. Audited, with ``reason``."""
        return self._set_task_paused(task, True, reason or f"paused by {self.actor}")

    def resume_task(self, task: str, reason: str = "") -> bool:
        """Let workers claim task name ``task`` again (and wake them); False if it was not
        paused. Audited, with ``reason``; also ends its streak of lost deliveries."""
        return self._set_task_paused(task, False, reason or f"resumed by {self.actor}")

    def _set_task_paused(self, task: str, paused: bool, reason: str) -> bool:
        if not isinstance(task, str) or not task.strip():
            raise OperationError("give a task name (as Celery names it: module.function)")
        rows = self._rows("task_set_paused", {**self._base(), "task": task, "paused": paused,
                                              "reason": reason})
        if rows and paused:
            signals.send_task_paused(task, reason, [], self.actor)
        elif rows:
            signals.send_task_resumed(task, reason, self.actor)
        return bool(rows)

    def _set_paused(self, queue: str, paused: bool) -> bool:
        self._require_queue(queue)
        changed = bool(self._one("queue_set_paused", {**self._base(), "name": queue,
                                                      "paused": paused})[0])
        if changed:
            logger.info("pgbroker: %s %s queue %r", self.actor,
                        "paused" if paused else "resumed", queue)
        return changed
