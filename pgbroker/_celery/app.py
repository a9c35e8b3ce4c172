"""Which pgbroker broker a Celery app uses: its connection string and its settings.

Everything that reaches the broker's database from outside a kombu connection (enqueue, beat,
the task-failure hook, the command line's ``-A``) asks here: the one answer. No I/O: kombu only
parses the app's ``broker_url`` and ``broker_transport_options``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kombu.transport import TRANSPORT_ALIASES, resolve_transport

from .._pg import driver as _db
from ..errors import ConfigurationError
from ..settings import Settings
from ..transport import Transport

__all__ = ["Broker", "broker_of", "find", "settings_of"]


@dataclass(frozen=True)
class Broker:
    """A pgbroker broker: the libpq connection string, the URL to show (its password masked)
    and the settings of its options."""

    conninfo: str
    settings: Settings
    shown: str


def _client(app: Any, required: bool, name: str | None = None) -> Any:
    """``app``'s kombu connection for writing if its broker is pgbroker's; else None, or a
    ConfigurationError if ``required``. ``name``: the app as its user named it (``-A``)."""
    name = name or app.main
    try:
        conn = app.connection_for_write()  # no I/O: kombu only parses the URL
        transport, transport_cls = conn.transport_cls, resolve_transport(conn.transport_cls)
    except Exception as exc:
        transport = _other_broker(app)
        if transport is None:
            raise ConfigurationError(f"cannot tell the broker of the Celery app {name!r}: "
                                     f"{type(exc).__name__}: {exc}") from exc
        conn = transport_cls = None
    if isinstance(transport_cls, type) and issubclass(transport_cls, Transport):
        return conn
    if required:
        raise ConfigurationError(f"the Celery app {name!r} uses the {transport!r} broker, not "
                                 "pgbroker (broker_url = 'pgbroker://user@host/db')")
    return None


def _other_broker(app: Any) -> str | None:
    """The scheme of ``app``'s broker URL if kombu knows it as another broker's (whose client
    library may be missing: kombu then cannot even parse the URL), else None."""
    url = str(app.conf.broker_write_url or app.conf.broker_url or "amqp://")
    scheme = url.partition("://")[0].partition("+")[0]  # redis+socket:// -> redis
    target = TRANSPORT_ALIASES.get(scheme)
    return scheme if isinstance(target, str) and not target.startswith("pgbroker.") else None


def settings_of(app: Any) -> Settings:
    """The settings of ``app``'s pgbroker broker (its ``broker_transport_options``).

    Raises:
        ConfigurationError: the app's broker is not pgbroker.
    """
    return Settings.from_options(_client(app, True).transport_options)


def broker_of(app: Any, name: str | None = None) -> Broker:
    """``app``'s pgbroker broker (``name``: the app as its user named it, for the errors).

    Raises:
        ConfigurationError: the app's broker is not pgbroker.
    """
    return _broker(_client(app, True, name))


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
    return Broker(_db.kombu_conninfo(conn), settings, _db.libpq_url(conn.as_uri()))
