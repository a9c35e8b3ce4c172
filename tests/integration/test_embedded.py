"""The embedded PostgreSQL fallback really starts (as root too) and answers queries.

Runs in a subprocess: the embedded server belongs to the process that started it and is stopped
and deleted when that process exits, which is also checked here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("pgserver")

SCRIPT = textwrap.dedent(
    """
    import json, os, psycopg
    from pgbroker._pg.local_server import resolve_database_url, admin_url
    url = resolve_database_url("embedded-test")
    with psycopg.connect(url, autocommit=True) as conn:
        one = conn.execute("SELECT 1").fetchone()[0]
        listen = conn.execute("SHOW listen_addresses").fetchone()[0]
        datadir = conn.execute("SHOW data_directory").fetchone()[0]
        conn.execute("CREATE DATABASE embedded_check")
    with psycopg.connect(admin_url(url, "embedded_check")) as conn:
        db = conn.execute("SELECT current_database()").fetchone()[0]
    print(json.dumps({"url": url, "one": one, "listen": listen, "datadir": datadir, "db": db}))
    """
)


def test_embedded_server_answers_select_1() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PGBROKER_DATABASE_URL"}
    env.pop("PGBROKER_EMBEDDED_DATADIR", None)
    env["PGBROKER_EMBEDDED"] = "1"  # even when 127.0.0.1:5432 answers
    repo = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = str(repo) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        env=env,
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["one"] == 1
    assert result["db"] == "embedded_check"
    assert "127.0.0.1:5432" not in result["url"]
    assert "?host=/" in result["url"]  # a unix socket...
    assert result["listen"] == ""  # ...and no TCP address at all
    # The throwaway server was stopped and its directory deleted when the process exited.
    assert not Path(result["datadir"]).exists()
    assert not Path(result["datadir"]).parent.exists()
