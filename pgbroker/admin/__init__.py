"""The admin page and Prometheus endpoint: ``pgbroker serve`` (needs ``pgbroker[admin]``).

See :mod:`pgbroker.admin.app` for the app (its pages: :mod:`.pages` and :mod:`.jobs`) and
:mod:`pgbroker.admin.auth` and :mod:`.guards` for who may use them.
"""

from __future__ import annotations

import logging
import secrets
import signal
import sys
from typing import Any

import waitress.server

from ..errors import ConfigurationError
from .app import create_app
from .auth import ENV_PASSWORD, ENV_TOKEN, ENV_USER, Credentials, is_loopback

__all__ = ["create_app", "serve"]

logger = logging.getLogger(__name__)


def serve(database_url: str, schema: str = "pgbroker", *, host: str = "127.0.0.1",
          port: int = 8025, refresh: float = 3.0, window: float | None = None,
          lease_timeout: float | None = None, threads: int = 4,
          credentials: Credentials | None = None) -> int:
    """Serve the admin app with waitress until SIGINT or SIGTERM; returns an exit status.

    Refuses (:class:`ConfigurationError`) a non-loopback ``host`` without credentials; on a
    loopback address without them it makes a one-time token and prints it on stderr.
    """
    credentials = credentials or Credentials.from_env()
    if not credentials.configured:
        if not is_loopback(host):
            raise ConfigurationError(
                f"refusing to serve the admin page on {host!r} without credentials: set "
                f"{ENV_USER} and {ENV_PASSWORD}, or {ENV_TOKEN} (or listen on 127.0.0.1)")
        credentials = Credentials(token=secrets.token_urlsafe(24))
        print(f"pgbroker admin: no credentials configured; log in with this one-time token: "
              f"{credentials.token}", file=sys.stderr, flush=True)
    app = create_app(database_url, schema, credentials, refresh=refresh, window=window,
                     lease_timeout=lease_timeout, pool_size=threads)
    server: Any = waitress.server.create_server(app, host=host, port=port, threads=threads,
                                                ident="pgbroker")

    def stop(*_: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    shown = f"[{host}]" if ":" in host else host
    print(f"pgbroker admin: serving on http://{shown}:{server.effective_port}/", flush=True)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        app.extensions["pgbroker"].close()
    return 0
