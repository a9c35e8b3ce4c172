"""What a pgbroker worker answers to ``celery inspect`` against what a RabbitMQ worker answers
for the same task, field by field: Celery's own inspect tests compare whole entries.

Both workers are real ``celery worker`` processes of ``tests.apps.e2e_app``, one on the test's
database, one on the RabbitMQ server at :data:`RABBITMQ_URL` (skipped when none listens there).
Ids, node names and times differ by nature and are compared by form only.
"""

from __future__ import annotations

import socket
import uuid
from datetime import datetime
from typing import Any

import kombu
import pytest

from pgbroker._pg.local_server import normalize_url
from tests.support.control import REPLY_TIMEOUT, client_app, node
from tests.support.processes import run_worker, wait_for

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"


def _rabbitmq_listens() -> bool:
    try:
        socket.create_connection(("127.0.0.1", 5672), timeout=2).close()
    except OSError:
        return False
    return True


@pytest.fixture
def rabbitmq_queue() -> Any:
    """A queue name of this test's own on RabbitMQ, deleted afterwards."""
    if not _rabbitmq_listens():
        pytest.skip(f"no RabbitMQ at {RABBITMQ_URL}")
    name = f"parity-{uuid.uuid4().hex[:8]}"
    yield name
    with kombu.Connection(RABBITMQ_URL) as conn:
        conn.default_channel.queue_delete(name)


def _scheduled_entry(broker_url: str, queue: str, env: dict[str, str] | None) -> dict[str, Any]:
    """Start a worker on ``queue``, send it an eta task and return its one ``scheduled`` entry,
    the task's id, the worker's node name and the eta's value replaced by their form."""
    worker = run_worker("tests.apps.e2e_app", broker_url, "-Q", queue, "-c", "1", env=env)
    worker.wait_ready(60)
    with client_app(broker_url) as client:
        sent = client.send_task("tests.apps.e2e_app.touch", ("later",), countdown=600, queue=queue)
        inspect = client.control.inspect(timeout=REPLY_TIMEOUT, destination=[node(worker)])
        replies = wait_for(lambda: (inspect.scheduled() or {}).get(node(worker)), 60,
                           message="the eta task in the worker's scheduled list")
    worker.kill_group()
    assert len(replies) == 1
    entry = replies[0]
    # what differs by nature: compared here, then replaced by its form
    assert (entry["request"]["id"], entry["request"]["hostname"]) == (sent.id, node(worker))
    eta = datetime.fromisoformat(entry["eta"])
    assert eta.utcoffset() is not None
    request = dict(entry["request"], id="<task id>", hostname="<node>")
    return dict(entry, eta=("<aware datetime>", eta.utcoffset()), request=request)


def test_inspect_scheduled_entry_is_rabbitmqs(broker_url: str, db_url: str,
                                               rabbitmq_queue: str) -> None:
    on_rabbitmq = _scheduled_entry(RABBITMQ_URL, rabbitmq_queue,
                                   {"PGBROKER_TEST_RUNS_URL": normalize_url(db_url)})
    on_pgbroker = _scheduled_entry(broker_url, rabbitmq_queue, None)
    print(f"\nRabbitMQ: {on_rabbitmq}\npgbroker: {on_pgbroker}")
    assert on_pgbroker == on_rabbitmq
