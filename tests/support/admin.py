"""What the admin page's tests share: its test logins (:data:`CREDS`), reading a page's CSRF
token, and history -- finished jobs made with ``generate_series``, as the transport leaves them
(a UUIDv7 id of their creation time, the claim's time in ``locked_at``, Celery's ``argsrepr``
header), spread over a span of time ending now -- for the tests, screenshots and benchmark.

The ``app`` and ``client`` fixtures are in tests/integration/conftest.py; the unit, e2e and bench
tiers use these helpers too.
"""

from __future__ import annotations

import re

import psycopg
from flask.testing import FlaskClient

from pgbroker.admin.auth import Credentials

CREDS = Credentials(user="alice", password="correct horse", token="s3cret-token-0123",
                    viewer_user="victor", viewer_password="look but don't touch",
                    viewer_token="viewer-token-4567")


def csrf_of(html: str) -> str:
    match = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert match, "no CSRF token in the page"
    return match[1]


def csrf(client: FlaskClient) -> str:
    return csrf_of(client.get("/").text)


_HISTORY = """
INSERT INTO pgbroker.jobs (id, queue, task, task_id, retries, body, content_type, headers,
                           state, attempts, run_at, locked_at, locked_by, last_error,
                           created_at, updated_at)
SELECT (lpad(to_hex((extract(epoch FROM t.created) * 1000)::bigint), 12, '0') || '7'
        || substr(t.h, 1, 3) || '8' || substr(t.h, 4, 15))::uuid,
       (%(queues)s::text[])[1 + i %% cardinality(%(queues)s::text[])],
       (%(tasks)s::text[])[1 + i %% cardinality(%(tasks)s::text[])],
       t.h, 0, convert_to('[["order ' || i || '"], {}, {}]', 'UTF8'), 'application/json',
       jsonb_build_object('argsrepr', '(''order ' || i || ''',)', 'kwargsrepr', '{}'),
       CASE WHEN t.dead THEN 'dead' ELSE 'completed' END, 1,
       t.created, t.created + t.wait, gen_random_uuid(),
       CASE WHEN t.dead THEN 'ConnectionError: the SMTP server hung up' END,
       t.created, t.created + t.wait + t.run
FROM generate_series(%(lo)s::int, %(hi)s::int) AS i,
     LATERAL (SELECT (i - %(lo)s + 0.5) / (%(hi)s - %(lo)s + 1) AS u) AS u,
     LATERAL (SELECT md5(%(seed)s || i) AS h,
                     -- a rate that swells and ebbs twice over the span (w(u) = u - a sin..)
                     now() - interval '2 s' - make_interval(secs => %(offset)s + %(seconds)s
                         * (u.u - 0.35 * sin(4 * pi() * u.u) / (4 * pi()))) AS created,
                     -- waits of a few ms to ~1 s; run times mostly 20-300 ms, a slow tail
                     make_interval(secs => 0.002 + 0.4 * random() ^ 3) AS wait,
                     make_interval(secs => 0.02 + 0.25 * random()
                                   + CASE WHEN random() < 0.02 THEN 2 * random() ELSE 0 END)
                         AS run,
                     random() < 1.0 / %(dead_every)s AS dead) AS t
"""


def fill_history(pg: psycopg.Connection, n: int, seconds: float, *,
                 queues: tuple[str, ...] = ("celery",), tasks: tuple[str, ...] = ("t.a",),
                 dead_every: int = 80, seed: str = "h", chunk: int = 100_000) -> None:
    """``n`` finished jobs (one in ``dead_every`` dead, at random), created over the last
    ``seconds`` at a rate that varies, cycling through ``queues`` and ``tasks``."""
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n) - 1
        part = seconds * (hi - lo + 1) / n
        # each chunk covers its own share of the span, the last one ending now
        offset = seconds * (n - hi - 1) / n
        pg.execute(_HISTORY, {"lo": lo, "hi": hi, "seconds": part, "offset": offset,
                              "queues": list(queues), "tasks": list(tasks),
                              "dead_every": dead_every, "seed": seed})


def fill_depth(pg: psycopg.Connection, minutes: int, queue: str, task: str) -> None:
    """Backlog samples of the last ``minutes`` as the sweeper takes them (stats_depth): a
    backlog that builds up and drains."""
    pg.execute("""
        INSERT INTO pgbroker.stats_depth (minute, queue, task, pending, scheduled, running,
                                          oldest_pending)
        SELECT date_trunc('minute', now()) - make_interval(mins => m), %s, %s,
               greatest(0, 20 + 18 * sin(m / 6.0) + 6 * random())::int, 3, 2, 4 * random()
        FROM generate_series(1, %s) AS m
        ON CONFLICT DO NOTHING
    """, (queue, task, minutes))
