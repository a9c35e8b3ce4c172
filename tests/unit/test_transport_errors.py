"""The transport's error for a server that is not there: at once, a connection error kombu
retries, the password masked (the transport on a real database:
tests/integration/test_transport.py)."""

from __future__ import annotations

import time
from urllib.parse import quote

import kombu
import psycopg
import pytest

from pgbroker.errors import DatabaseUnavailable
from pgbroker.transport import Transport
from tests.support.db import free_port

SECRET = "s3cr3t-pw"


@pytest.mark.parametrize("password", [SECRET, pytest.param(
    f"two words {SECRET}", id="with-a-space")])
def test_establish_connection_to_a_dead_port_fails_at_once(password: str) -> None:
    url = f"pgbroker://postgres:{quote(password, safe='')}@127.0.0.1:{free_port()}/nowhere"
    conn = kombu.Connection(url, transport_options={"connect_timeout": 30})
    started = time.monotonic()
    with pytest.raises(Transport.connection_errors) as info:
        conn.transport.establish_connection()
    print(f"dead port reported after {time.monotonic() - started:.3f}s")
    assert isinstance(info.value, DatabaseUnavailable)
    assert SECRET not in str(info.value)
    assert "**" in str(info.value)  # the message says where it tried, password masked
    assert isinstance(info.value.__cause__, psycopg.OperationalError)
    assert psycopg.OperationalError in Transport.connection_errors

    # kombu's own retry wrapper sees a connection error and reraises it as its OperationalError
    with pytest.raises(kombu.exceptions.OperationalError) as wrapped:
        conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0)
    assert SECRET not in str(wrapped.value)
    conn.release()
