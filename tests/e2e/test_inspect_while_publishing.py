"""A client's ``inspect`` while the same process publishes (issue 27, item 6).

A process has one shared connection (pgbroker._pg.process_store): its publishes and the lease of
each consumer it opens -- ``inspect`` consumes a reply queue -- use it from different threads.
The lease took its advisory lock (``consumer_lock_try``) outside the store's statement lock, so a
publish in another thread interleaved with it on the one libpq connection: libpq refused one of
the two ("another command is already in progress": ``inspect`` raised), or one thread read the
other's result and the other waited on the socket for ever (``inspect`` hung in
``_lease._take_lock``, or in ``register_consumer`` behind the publish that hung). The client runs
as a process of its own, so that a hang is a timeout here, not a stuck test run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.control import REPLY_TIMEOUT, node
from tests.support.workers import start_worker
from tests.support.processes import REPO_ROOT

#: inspect calls, each while another thread of the client publishes as fast as it can
CALLS = 10

CLIENT = f"""
import json, sys, threading, time
from tests.apps.e2e_app import app, touch
stop, sent = threading.Event(), [0]
def publish():
    while not stop.is_set():
        touch.apply_async(("from the client",), queue="nobody-consumes-this")
        sent[0] += 1
threading.Thread(target=publish, daemon=True).start()
while not sent[0]:  # publishing already when the first inspect starts
    time.sleep(0.01)
for _ in range({CALLS}):
    began = time.monotonic()
    try:
        replies, error = app.control.inspect(timeout={REPLY_TIMEOUT}).active(), None
    except Exception as exc:
        replies, error = None, repr(exc)
    print(json.dumps({{"seconds": time.monotonic() - began, "nodes": sorted(replies or {{}}),
                      "error": error, "sent": sent[0]}}), flush=True)
stop.set()
"""


def test_inspect_answers_within_its_timeout_while_the_process_publishes(
        broker_url: str, producer: object) -> None:
    worker = start_worker(broker_url, "-c", "1")
    env = {**os.environ, "PGBROKER_TEST_BROKER_URL": broker_url}
    client = subprocess.Popen([sys.executable, "-c", CLIENT], cwd=REPO_ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = client.communicate(timeout=CALLS * (REPLY_TIMEOUT + 5) + 30)
    except subprocess.TimeoutExpired:
        client.kill()
        out, err = client.communicate()
        raise AssertionError(f"the client hung; its calls so far:\n{out}\n{err[-3000:]}") from None
    calls = [json.loads(line) for line in out.splitlines()]
    assert client.returncode == 0 and len(calls) == CALLS, err[-3000:]
    assert [c["error"] for c in calls] == [None] * CALLS
    assert all(c["nodes"] == [node(worker)] for c in calls), calls
    # its own timeout, and the connection and reply queue set-up: never a wait on a lock
    assert max(c["seconds"] for c in calls) < REPLY_TIMEOUT + 3, calls
    assert calls[-1]["sent"] > calls[0]["sent"] > 0  # it did publish all along
