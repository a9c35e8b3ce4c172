"""Beat's schedule as rows: an entry validated and saved, and the operator's :class:`Schedules`.

:func:`entry_config` checks one entry (from the ``beat_schedule`` config or an operator) and
serialises it as its row's columns; :func:`save_entry` inserts or updates that row inside the
caller's transaction. The beat :class:`~pgbroker.beat.Scheduler` applies its config with them at
start-up; :class:`Schedules` -- the operator's side, beside :class:`pgbroker.ops.Operations`, for
the CLI's ``pgbroker schedule ...`` and the admin page -- lists, adds, changes, enables, disables
and deletes entries at run time, each action audited.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from datetime import datetime
from typing import Any

import psycopg
from kombu.utils.json import dumps as kombu_dumps
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from ._model.schedule import MISFIRE_POLICIES, OVERLAP_POLICIES, Grid, grid_from_spec, grid_of
from ._pg import driver as _db
from ._pg.catalogue import Queries
from ._produce.build import check_options  # enqueue's own option checks, run at start-up
from .errors import ConfigurationError, OperationError
from .settings import Settings

__all__ = ["ENQUEUE_OPTIONS", "EntryConfig", "Schedules", "entry_config", "save_entry"]

logger = logging.getLogger(__name__)

#: What a database error in an operator's action is called.
_WHAT = "pgbroker schedule"

#: The entry options passed on to :func:`pgbroker.enqueue` (``misfire``/``overlap`` are beat's).
ENQUEUE_OPTIONS = frozenset({"queue", "priority", "expires", "headers", "max_attempts",
                             "countdown"})


# -- entries: validated, as rows -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class EntryConfig:
    """One entry, validated and serialised as its row's columns."""

    name: str
    task: str
    args: str      # kombu JSON
    kwargs: str
    options: str
    grid: Grid
    misfire: str
    overlap: str

    def params(self, source: str, next_occurrence: datetime, enabled: bool = True
               ) -> dict[str, Any]:
        return {"name": self.name, "task": self.task, "args": self.args, "kwargs": self.kwargs,
                "options": self.options, "schedule": Jsonb(self.grid.spec),
                "misfire": self.misfire, "overlap": self.overlap, "source": source,
                "enabled": enabled, "next_occurrence": next_occurrence}

    def same_as(self, row: Mapping[str, Any]) -> bool:
        """True when the stored row already says exactly this (nothing to update)."""
        return (row["task"] == self.task and row["misfire"] == self.misfire
                and row["overlap"] == self.overlap and row["schedule"] == self.grid.spec
                and all(json.loads(row[k]) == json.loads(getattr(self, k))
                        for k in ("args", "kwargs", "options")))


def entry_config(name: str, task: str, schedule: Any, args: Any = (), kwargs: Any = None,
                 options: Mapping[str, Any] | None = None, tz: str = "UTC") -> EntryConfig:
    """Validate one entry; :class:`ConfigurationError` says what is wrong with which entry."""
    try:
        if not isinstance(name, str) or not name or len(name) > 200:
            raise ConfigurationError("the entry name must be a non-empty string of at most "
                                     "200 characters")
        if not isinstance(task, str) or not task:
            raise ConfigurationError(f"task must be a task name, not {task!r}")
        args = [] if args is None else args
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(args, (list, tuple)):
            raise ConfigurationError(f"args must be a list or tuple, not {type(args).__name__}")
        if not isinstance(kwargs, Mapping):
            raise ConfigurationError(f"kwargs must be a mapping, not {type(kwargs).__name__}")
        opts = dict(options or {})
        misfire = opts.pop("misfire", "latest")
        overlap = opts.pop("overlap", "skip")
        if misfire not in MISFIRE_POLICIES:
            raise ConfigurationError(f"misfire must be one of {', '.join(MISFIRE_POLICIES)}, "
                                     f"not {misfire!r}")
        if overlap not in OVERLAP_POLICIES:
            raise ConfigurationError(f"overlap must be one of {', '.join(OVERLAP_POLICIES)}, "
                                     f"not {overlap!r}")
        unknown = set(opts) - ENQUEUE_OPTIONS
        if unknown:
            raise ConfigurationError(
                f"option(s) {sorted(unknown)} are not supported by pgbroker's beat (supported: "
                f"{', '.join(sorted(ENQUEUE_OPTIONS | {'misfire', 'overlap'}))}; route with "
                "task_routes or 'queue')")
        check_options(opts)
        attempts = opts.get("max_attempts")
        if attempts is not None and (not isinstance(attempts, int) or isinstance(attempts, bool)
                                     or attempts < 1):
            raise ConfigurationError(f"max_attempts must be a positive integer, not {attempts!r}")
        grid = grid_of(schedule, tz)
        try:
            args_text, kwargs_text, options_text = [
                kombu_dumps(v) for v in (list(args), dict(kwargs), opts)]
        except TypeError as exc:
            raise ConfigurationError(f"args, kwargs and options must be JSON-serialisable (they "
                                     f"are stored in PostgreSQL): {exc}") from exc
    except ValueError as exc:  # ConfigurationError and enqueue's MessageError are ValueErrors
        raise ConfigurationError(f"beat entry {name!r}: {exc}") from exc
    return EntryConfig(name, task, args_text, kwargs_text, options_text, grid=grid,
                       misfire=misfire, overlap=overlap)


def save_entry(conn: psycopg.Connection[Any], q: Queries, cfg: EntryConfig,
               row: Mapping[str, Any] | None, source: str, now: datetime,
               enabled: bool = True, *, what: str) -> str:
    """Insert or update one entry inside the caller's transaction (``row``: the locked row, if
    any). Returns ``added``, ``changed`` or ``unchanged``; ``what`` names a database error."""
    if row is None:
        q.execute(conn, "beat_entry_insert", cfg.params(source, cfg.grid.next_after(now), enabled),
                  what=what)
        return "added"
    if cfg.same_as(row) and row["source"] == source and row["removed_at"] is None:
        return "unchanged"
    next_occurrence = row["next_occurrence"]
    if row["schedule"] != cfg.grid.spec:
        # a new grid: continue from the last occurrence fired (history kept), never before it
        next_occurrence = cfg.grid.next_after(row["last_occurrence"] or now)
    q.execute(conn, "beat_entry_configure", cfg.params(source, next_occurrence), what=what)
    return "changed"


# -- the operator's side -------------------------------------------------------------------------

class Schedules:
    """List, add, change, enable, disable and delete entries at run time, audited.

    Beats pick the changes up at their next tick. Entries from the ``beat_schedule`` config can
    be enabled and disabled here (that survives restarts) but are changed in the config.
    Mistakes raise :class:`pgbroker.errors.OperationError`; nothing has changed then.
    """

    def __init__(self, conn: psycopg.Connection[Any], schema: str = "pgbroker", *,
                 actor: str, via: str):
        self.conn = conn
        self.schema = Settings(schema=schema).schema  # validates the name
        self.q = Queries(self.schema)
        self.actor = actor
        self.via = via

    def list(self) -> list[dict[str, Any]]:
        """Every entry with its state and heartbeat (``schedule``: a readable description)."""
        rows = self.q.dicts(self.conn, "beat_list")
        for row in rows:
            try:
                row["schedule"] = grid_from_spec(row["schedule"]).describe()
            except ConfigurationError as exc:
                row["schedule"] = f"invalid: {exc}"
        return rows

    def set_enabled(self, name: str, enabled: bool) -> bool:
        """Enable or disable an entry; False when it already was. A re-enabled entry whose
        occurrences passed meanwhile follows its misfire policy (``latest``: fires once)."""
        with self._action() as row_of:
            row_of(name)
            changed = bool(self.q.rowcount(self.conn, "beat_entry_set_enabled",
                                           {"name": name, "enabled": enabled}, what=_WHAT))
            self._audit("schedule.enable" if enabled else "schedule.disable", name,
                        {"changed": changed})
        if changed:
            logger.info("pgbroker: %s %s schedule entry %r", self.actor,
                        "enabled" if enabled else "disabled", name)
        return changed

    def run_now(self, name: str) -> datetime:
        """Have the beats fire an enabled entry at their next tick (within ``max_interval``),
        as an occurrence of now; returns that time. The entry's next occurrence on its grid
        stays what it was (run now adds a run, it skips none), and its policies apply: with
        ``overlap`` ``skip`` it is dropped while the previous run is unfinished. With no beat
        running, nothing fires until one starts."""
        with self._action() as row_of:
            row_of(name)
            row: tuple[datetime] | None = self.q.one(self.conn, "beat_entry_run_now",
                                                     {"name": name}, what=_WHAT)
            if row is None:
                raise OperationError(f"schedule entry {name!r} is disabled or no longer in the "
                                     "config: enable it first")
            self._audit("schedule.run_now", name, {"at": row[0].isoformat()})
        logger.info("pgbroker: %s asked for a run of schedule entry %r now", self.actor, name)
        return row[0]

    def add(self, name: str, task: str, schedule: Any, args: Any = (), kwargs: Any = None,
            options: Mapping[str, Any] | None = None, *, tz: str = "UTC", enabled: bool = True,
            replace: bool = False) -> str:
        """Add an entry (``replace``: or change an entry added at run time, keeping its
        history); returns ``added``, ``changed`` or ``unchanged``."""
        try:
            cfg = entry_config(name, task, schedule, args, kwargs, options, tz)
        except ConfigurationError as exc:
            raise OperationError(str(exc)) from exc
        with self._action() as row_of:
            row = row_of(name, missing_ok=True)
            if row is not None and row["source"] == "config" and row["removed_at"] is None:
                raise OperationError(f"schedule entry {name!r} comes from the beat_schedule "
                                     "config: change it there (beat applies it when it "
                                     "starts); enable and disable work on it here")
            if row is not None and not replace:
                raise OperationError(f"schedule entry {name!r} exists: add --replace to change "
                                     "it (its history is kept)")
            now = self.q.one(self.conn, "beat_clock", what=_WHAT)[0]
            outcome = save_entry(self.conn, self.q, cfg, row, "runtime", now, enabled,
                                 what=_WHAT)
            if outcome != "unchanged":
                self._audit(f"schedule.{'add' if outcome == 'added' else 'change'}", name, {
                    "task": task, "schedule": cfg.grid.describe(), "args": json.loads(cfg.args),
                    "kwargs": json.loads(cfg.kwargs), "options": json.loads(cfg.options),
                    "misfire": cfg.misfire, "overlap": cfg.overlap})
        return outcome

    def delete(self, name: str) -> None:
        """Delete an entry added at run time, or a config entry no longer in the config."""
        with self._action() as row_of:
            row = row_of(name)
            assert row is not None  # row_of raised otherwise
            if row["source"] == "config" and row["removed_at"] is None:
                raise OperationError(f"schedule entry {name!r} comes from the beat_schedule "
                                     "config: remove it there (it is then kept, never fired, "
                                     "until deleted here), or disable it")
            gone = self.q.one(self.conn, "beat_entry_delete", {"name": name},
                              row_factory=dict_row, what=_WHAT)
            self._audit("schedule.delete", name, {k: v for k, v in gone.items() if k != "name"})
        logger.info("pgbroker: %s deleted schedule entry %r", self.actor, name)

    @contextlib.contextmanager
    def _action(self) -> Iterator[Callable[..., Any]]:
        """One transaction: lock the entry, change it, write the audit row."""
        def row_of(name: str, missing_ok: bool = False) -> dict[str, Any] | None:
            row: dict[str, Any] | None = self.q.one(self.conn, "beat_entry_get", {"name": name},
                                                    row_factory=dict_row, what=_WHAT)
            if row is None and not missing_ok:
                known = [r[0] for r in self.q.all(self.conn, "beat_names", what=_WHAT)]
                hint = f"known: {', '.join(known[:20])}" if known else "there is none"
                raise OperationError(f"no schedule entry {name!r} ({hint})")
            return row

        with _db.translate_errors(_WHAT), self.conn.transaction():
            yield row_of

    def _audit(self, action: str, name: str, detail: dict[str, Any]) -> None:
        self.q.execute(self.conn, "audit_insert", {
            "actor": self.actor, "action": action, "target": f"schedule:{name}",
            "detail": Jsonb({"via": self.via, **detail},
                            dumps=lambda obj: json.dumps(obj, default=str))}, what=_WHAT)
