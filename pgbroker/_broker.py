"""Which pgbroker broker a Celery app uses: its connection string and its settings.

Everything that reaches the broker's database from outside a kombu connection (enqueue, beat,
the task-failure hook) asks here. No I/O: kombu only parses the app's ``broker_url`` and
``broker_transport_options``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kombu.transport import resolve_transport

from . import _db
from .errors import ConfigurationError
from .settings import Settings
from .transport import Transport

__all__ = ["Broker", "broker_of", "find", "settings_of"]


@dataclass(frozen=True)
class Broker:
    """A pgbroker broker: the libpq connection string and the settings of its options."""

    conninfo: str
    settings: Settings


def _client(app: Any, required: bool) -> Any:
    """``app``'s kombu connection for writing if its broker is pgbroker's; else None, or a
    ConfigurationError if ``required``."""
    try:
        conn = app.connection_for_write()  # no I/O: kombu only parses the URL
        transport_cls = resolve_transport(conn.transport_cls)
    except Exception as exc:  # e.g. the client library of another broker
        raise ConfigurationError(f"pgbroker.enqueue cannot tell the broker of Celery app "
                                 f"{app.main!r}: {type(exc).__name__}: {exc}") from exc
    if isinstance(transport_cls, type) and issubclass(transport_cls, Transport):
        return conn
    if required:
        raise ConfigurationError(
            f"pgbroker.enqueue writes to pgbroker's jobs table, but Celery app {app.main!r} uses "
            f"the {conn.transport_cls!r} broker: set broker_url = 'pgbroker://user@host/db'")
    return None


def settings_of(app: Any) -> Settings:
    """The settings of ``app``'s pgbroker broker (its ``broker_transport_options``).

    Raises:
        ConfigurationError: the app's broker is not pgbroker.
    """
    return Settings.from_options(_client(app, True).transport_options)


def broker_of(app: Any) -> Broker:
    """``app``'s pgbroker broker.

    Raises:
        ConfigurationError: the app's broker is not pgbroker.
    """
    return _broker(_client(app, True))


def find(app: Any) -> Broker | None:
    """``app``'s pgbroker broker, or None if its broker is another.

    Raises:
        ConfigurationError: kombu cannot tell the app's broker.
    """
    conn = _client(app, False)
    return None if conn is None else _broker(conn)


def _broker(conn: Any) -> Broker:
    settings = Settings.from_options(conn.transport_options)
    # the URL's parsing is the transport's own (a libpq URL after "pgbroker+", the password
    # kept out of what kombu prints)
    return Broker(_db.kombu_conninfo(conn), settings)
