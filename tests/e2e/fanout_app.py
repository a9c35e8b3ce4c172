"""``tests.apps.e2e_app`` for the fanout tests: a worker consumes the queue named by
``PGBROKER_TEST_FANOUT_QUEUE``, bound to the fanout exchange ``fan_x`` (durable, as kombu
declares a queue by default), and a Celery ``Broadcast`` queue of its own (auto-delete) bound to
the fanout exchange ``bcast_x``."""

from __future__ import annotations

import os

from kombu import Exchange, Queue
from kombu.common import Broadcast

from tests.apps.e2e_app import app

__all__ = ["FANOUT", "app"]

FANOUT = Exchange("fan_x", type="fanout")

app.conf.task_queues = [Queue(os.environ.get("PGBROKER_TEST_FANOUT_QUEUE", "fan_a"), FANOUT),
                        Broadcast("bcast_x")]
