"""What the statements that settle deliveries report besides their rows: the jobs they made dead
(``pgbroker.signals.job_dead``) and the task names paused by lost deliveries (``task_paused``).

The statements (sql/queries.sql, sql/tasks.sql) return those rows; :class:`pgbroker._pg.store.Store`
and the event loop's :class:`pgbroker._consume.turn.LoopStatements` hand them here, in the process
that ran the statement, right after it committed.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from .. import signals

__all__ = ["claimed", "settled", "failed", "rescued", "paused"]


def claimed(rows: list[Any]) -> list[Any]:
    """The deliveries job_claim claimed (its ``JobRow``s in 'running'), highest priority first;
    ``job_dead`` for the acks folded into it that ended their job dead."""
    dead = [r for r in rows if r.state == "dead"]
    if dead:
        signals.send_job_dead((r.id, r.task, r.last_error, r.attempt) for r in dead)
        rows = [r for r in rows if r.state != "dead"]
    rows.sort(key=lambda r: (-r.priority, r.run_at, r.id))
    return rows


def settled(rows: Sequence[Sequence[Any]]) -> list[tuple[uuid.UUID, int]]:
    """The deliveries an ack, requeue or bury settled (rows: id, attempt, done, state, task,
    error); ``job_dead`` for each that ended dead."""
    done = [r for r in rows if r[2]]
    signals.send_job_dead((r[0], r[4], r[5], r[1]) for r in done if r[3] == "dead")
    return [(r[0], r[1]) for r in done]


def failed(job_id: uuid.UUID, rows: Iterable[Sequence[Any]]) -> None:
    """job_fail's rows (task, error, attempts, died): ``job_dead`` if it died there (acked on
    receipt, its row was completed already)."""
    signals.send_job_dead((job_id, task, reason, attempts)
                          for task, reason, attempts, died in rows if died)


def rescued(row: Sequence[Any]) -> list[tuple[uuid.UUID, int]]:
    """job_rescue's row: ``job_dead`` for the jobs it made dead; returns the deliveries that
    lost their worker (columns 4 and 5; column 7 says, for each, the host of its worker if that
    worker had been told nothing: Store.rescue)."""
    signals.send_job_dead((uuid.UUID(d["id"]), d["task"], d["reason"], d["attempts"])
                          for d in row[6])
    return list(zip(row[4], row[5]))


def paused(rows: Iterable[Sequence[Any]]) -> None:
    """task_loss_record's rows (task, reason, job ids): ``task_paused`` for each."""
    for task, reason, job_ids in rows:
        signals.send_task_paused(task, reason, job_ids, signals.SELF)
