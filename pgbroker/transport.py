"""pgbroker transport: kombu messages in a PostgreSQL table.

Features
========
* Type: Virtual, asynchronous (the worker's event loop waits on LISTEN/NOTIFY; no busy polling)
* Supports Direct: Yes
* Supports Topic: Yes
* Supports Fanout: Yes (bindings in the database; a broadcast row + NOTIFY of its id)
* Supports Priority: Yes (AMQP direction: 0-255, higher runs first)
* Supports TTL: Yes (Celery ``expires`` and the per-message ``expiration`` property)
* Supports ETA: Yes (``eta``/``countdown`` wait in the database as ``scheduled`` until due)

Connection String
=================
.. code-block::

    pgbroker://USER:PASSWORD@HOST:PORT/DBNAME      (parsed by kombu, like amqp://)
    pgbroker+postgresql://USER@HOST1:PORT1,HOST2:PORT2/DBNAME?target_session_attrs=read-write
                                                   (any libpq URL after the '+', options too)
    pgbroker://USER@HOST1/DB;pgbroker://USER@HOST2/DB   (kombu's failover alternates)

Transport Options
=================
See :class:`pgbroker.settings.Settings`: ``schema``, ``auto_migrate``, ``max_attempts``,
``retention``, ``lease_timeout``, ``heartbeat_interval``, ``sweep_interval``, ``poll_interval``,
``claim_batch_max``, ``prune_batch_size``, ``use_advisory_locks``, ``max_message_size``,
``max_header_size``, ``connect_timeout``, ``durable_publish``, ``durable_acks``,
``require_idempotency_key``; kombu's ``deadletter_queue`` takes unroutable messages (else they
are kept dead in ``pgbroker.unroutable``). Unknown options are an error.

This module is glue: every statement is in :mod:`pgbroker._store`, every message check in
:mod:`pgbroker._messages`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import select
import socket
import threading
import uuid
import warnings
from time import monotonic
from typing import Any

import psycopg
import uuid6
from kombu.exceptions import ChannelError
from kombu.transport import virtual
from kombu.transport.virtual.base import UNDELIVERABLE_FMT, UndeliverableWarning
from kombu.transport.virtual.exchange import (
    STANDARD_EXCHANGE_TYPES,
    DirectExchange,
    TopicExchange,
)
from kombu.transport.base import to_rabbitmq_queue_arguments
from kombu.utils.objects import cached_property

from . import _db, _revoke
from ._lease import Lease
from ._messages import (
    MAX_NAME_LENGTH,
    REQUEUED,
    TRANSIENT,
    _delivery_tag,
    due_now,
    kombu_payload,
    message_to_job,
    parse_delivery_tag,
    validate_binding,
    validate_queue_name,
)
from ._settle import RETRY as SETTLE_RETRY
from ._settle import Settler
from ._store import BROADCAST_TTL, JobRow, LoopStatements, NewJob, Store
from ._text import Unreadable
from ._target import current_target
from .errors import DatabaseUnavailable, MessageError
from .settings import Settings

__all__ = ["Transport", "Channel", "QoS", "Message", "MAX_NAME_LENGTH",
           "message_to_job", "parse_delivery_tag", "validate_queue_name"]

logger = logging.getLogger(__name__)

#: Seconds a process trusts what it read of an exchange's bindings before reading them again.
BINDINGS_TTL = 1.0

#: The queue of the dead letters of unroutable messages (see Channel._unroutable).
UNROUTABLE = "pgbroker.unroutable"

#: Seconds wake-ups (NOTIFYs) of a channel are held together after one found nothing to claim.
WAKE_COALESCE = 0.05

def _wait_readable(fd: int, timeout: float) -> bool:
    """Wait until ``fd`` is readable (poll(2): select(2) fails on descriptors above 1023)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLERR | select.POLLHUP)
    return bool(poller.poll(timeout * 1000))


class Message(virtual.Message):
    """A delivered message that remembers why it could not be decoded.

    Celery acks a message whose body it cannot decode (so it does not loop). The transport
    turns that ack into ``dead`` with the reason instead: nothing is silently dropped.
    """

    def decode(self) -> Any:
        try:
            return super().decode()
        except Exception as exc:
            self.channel._undecodable[self.delivery_tag] = (
                f"undecodable message ({self.content_type!r}, {self.content_encoding!r}): "
                f"{type(exc).__name__}: {exc}")
            raise


class QoS(virtual.QoS):
    """Acks, rejects and restores are UPDATEs of the delivery's row (never re-inserts)."""

    def __init__(self, channel: Channel, prefetch_count: int = 0):
        super().__init__(channel, prefetch_count)
        self._pid = os.getpid()

    def ack(self, delivery_tag: str) -> None:
        channel: Channel = self.channel
        reason = channel._undecodable.pop(delivery_tag, None)
        delivery = parse_delivery_tag(delivery_tag)
        if delivery is not None:
            job_id, attempt, transient = delivery
            if reason is not None:
                channel.transport.settle_rows("bury", [(job_id, attempt)], reason)
            elif channel.transport.defer_acks and not transient and \
                    self.channel.settings.retention:
                # In the worker's event loop: sent with the next claim, or at the end of this
                # loop turn at the latest. A crash before that only means a redelivery.
                channel.pending_acks.append((job_id, attempt))
                channel.transport.request_turn()
            else:
                channel.transport.settle_rows("ack_delete" if transient else "ack",
                                              [(job_id, attempt)])
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        channel: Channel = self.channel
        reason = channel._undecodable.pop(delivery_tag, None)
        delivery = parse_delivery_tag(delivery_tag)
        if delivery is not None:
            job_id, attempt, _ = delivery
            if requeue and reason is None:
                channel.transport.settle_rows("requeue", [(job_id, attempt)], REQUEUED)
            else:
                channel.transport.settle_rows(
                    "bury", [(job_id, attempt)], reason or "rejected by the consumer without requeue")
        self._quick_ack(delivery_tag)
        channel.transport.request_turn()  # a prefetch slot is free

    def refuse(self, delivery_tag: str, delivery: tuple[uuid.UUID, int], reason: str) -> None:
        """A delivery its consumer failed on: ``dead`` with ``reason``, its prefetch slot free."""
        channel: Channel = self.channel
        if delivery_tag in self._delivered:
            channel._undecodable[delivery_tag] = reason
            self.reject(delivery_tag, requeue=False)
        else:  # a no_ack consumer's: not tracked
            channel.transport.settle_rows("bury", [delivery], reason)

    def restore_unacked(self) -> list[tuple[BaseException, Any]]:
        """Give every unacked delivery back in one statement (warm shutdown, recover)."""
        if os.getpid() != self._pid:  # a forked child must never touch the parent's deliveries
            self._delivered.clear()
            return []
        self._flush()
        self.channel.flush_acks()  # never requeue what was acked but not yet written
        tags = list(self._delivered)
        self._delivered.clear()
        if not tags:
            return []
        try:
            deliveries = [d[:2] for d in map(parse_delivery_tag, tags) if d is not None]
            self.channel.transport.settle_rows("requeue", deliveries, "restored unacked")
        except Exception as exc:  # noqa: BLE001 - the sweeper rescues them after the lease
            logger.warning("pgbroker: could not requeue %d unacked message(s): %s; they are "
                           "redelivered once this consumer's lease expires", len(tags), exc)
        return []

    def restore_unacked_once(self, stderr: Any = None) -> None:
        if os.getpid() != self._pid:
            self._on_collect.cancel()
            return
        super().restore_unacked_once(stderr)


class _DirectExchange(DirectExchange):
    """Direct routing; a message no binding matches is the channel's to decide (``_unroutable``)
    rather than dropped without a word."""

    def deliver(self, message: dict[str, Any], exchange: str, routing_key: str,
                **kwargs: Any) -> None:
        self.channel._route(message, exchange, routing_key, **kwargs)


class _TopicExchange(TopicExchange):
    """Topic routing like AMQP; a transient message (worker events) goes to the live consumers
    as a broadcast instead of a row per bound queue, so events never pile up in ``jobs``."""

    def lookup(self, table: Any, exchange: str, routing_key: str, default: Any) -> set[str]:
        return {queue for key, _, queue in table if topic_matches(key, routing_key)}

    def deliver(self, message: dict[str, Any], exchange: str, routing_key: str,
                **kwargs: Any) -> None:
        if message["properties"].get("delivery_mode") == TRANSIENT:
            self.channel._broadcast(exchange, message)
        else:
            self.channel._route(message, exchange, routing_key, **kwargs)


def topic_matches(binding_key: str, routing_key: str) -> bool:
    """AMQP topic matching, word by word: ``*`` is exactly one word, ``#`` zero or more
    (kombu's regex makes ``#`` need at least one, so ``stock.#`` missed ``stock``)."""
    pattern, words = binding_key.split("."), routing_key.split(".")

    @functools.cache
    def match(i: int, j: int) -> bool:
        if i == len(pattern):
            return j == len(words)
        if pattern[i] == "#":
            return match(i + 1, j) or (j < len(words) and match(i, j + 1))
        return j < len(words) and pattern[i] in ("*", words[j]) and match(i + 1, j + 1)

    return match(0, 0)


def _matches(exchange_type: str, binding_key: str, routing_key: str) -> bool:
    """AMQP routing: fanout takes all, topic matches ``*``/``#`` patterns, direct is equality."""
    if exchange_type == "fanout":
        return True
    if exchange_type == "topic":
        return topic_matches(binding_key, routing_key)
    return binding_key == routing_key


class Channel(virtual.Channel):
    """A kombu channel over the ``jobs`` table."""

    QoS = QoS
    Message = Message
    exchange_types = {**STANDARD_EXCHANGE_TYPES, "direct": _DirectExchange,
                      "topic": _TopicExchange}
    supports_fanout = True  # bindings are in the database: every process sees them
    body_encoding = None  # the body is stored as bytes; no base64 detour
    default_priority = 0
    min_priority = 0
    max_priority = 255

    def __init__(self, connection: Transport, **kwargs: Any):
        super().__init__(connection, **kwargs)
        self.transport: Transport = connection
        self.store: Store = connection.store
        self.settings: Settings = connection.settings
        self._undecodable: dict[str, str] = {}
        self._more = True          # a claim may find something
        self._woken = False        # ... because a NOTIFY said so (see wake)
        self._quiet_until = 0.0    # wake-ups wait until then (see wake)
        self._held_wake = False    # one is waiting
        self._rotation = 0         # fairness between queues
        self._round: list[str] = []  # event loop: the queues still to claim from in this round
        self._declared: set[str] = set()
        self._no_ack: set[str] = set()   # queues consumed with no_ack: acked at claim
        self.pending_acks: list[tuple[uuid.UUID, int]] = []  # deferred acks (event loop mode)
        self._bound: dict[str, tuple[float, list[tuple[str, str]]]] = {}  # exchange -> bindings

    # -- exchanges and bindings (kept in the database, so every process routes alike) ------------

    def exchange_declare(self, exchange: str | None = None, type: str = "direct",
                         durable: bool = False, auto_delete: bool = False,
                         arguments: dict[str, Any] | None = None, nowait: bool = False,
                         passive: bool = False) -> None:
        known = exchange in self.state.exchanges
        if passive and not known and exchange and self.store.exchange_type(exchange):
            return
        super().exchange_declare(exchange, type, durable, auto_delete, arguments, nowait,
                                 passive)
        if not known and not passive and exchange:
            validate_queue_name(exchange, "exchange")
            self.store.declare_exchange(exchange, type or "direct", durable, auto_delete,
                                        arguments)

    def exchange_delete(self, exchange: str, if_unused: bool = False,
                        nowait: bool = False) -> None:
        super().exchange_delete(exchange, if_unused, nowait)
        self.store.delete_exchange(exchange)

    def _queue_bind(self, exchange: str, routing_key: str, pattern: Any, queue: str) -> None:
        validate_queue_name(routing_key or "-", "routing key")
        validate_binding(exchange, routing_key or "", queue)
        self.store.bind(exchange, routing_key or "", queue)
        self._bound.pop(exchange, None)

    def queue_unbind(self, queue: str, exchange: str | None = None, routing_key: str = "",
                     arguments: Any = None, **kwargs: Any) -> None:
        super().queue_unbind(queue, exchange, routing_key, arguments, **kwargs)
        if exchange:
            self.store.unbind(exchange, routing_key or "", queue)
            self._bound.pop(exchange, None)

    def typeof(self, exchange: str, default: str = "direct") -> Any:
        if exchange and exchange not in self.state.exchanges:
            found = self.store.exchange_type(exchange)
            if found:
                return self.exchange_types[found]
        return super().typeof(exchange, default)

    def _bindings(self, exchange: str) -> list[tuple[str, str]]:
        """The exchange's bindings from the database, cached for BINDINGS_TTL seconds: only to
        skip writing broadcasts nobody would read (worker events with no monitor running)."""
        cached = self._bound.get(exchange)
        if cached is None or monotonic() - cached[0] > BINDINGS_TTL:
            cached = (monotonic(), self.store.bindings(exchange))
            self._bound[exchange] = cached
        return cached[1]

    def _lookup(self, exchange: str, routing_key: str, default: Any = None) -> list[str]:
        """The queues bound to ``exchange`` that ``routing_key`` matches; [] for none (the
        dead-letter queue is :meth:`_unroutable`'s choice, after the database was asked)."""
        if not exchange:
            return [routing_key or default]
        try:
            found = self.typeof(exchange).lookup(self.get_table(exchange), exchange,
                                                 routing_key, None)
        except KeyError:
            found = []
        if found:
            return list(found)
        # Bound by another process (a client's reply queue): ask the database, every time -- a
        # cached answer would drop a reply to a queue bound a moment ago, or feed a deleted one.
        kind = self.typeof(exchange).type
        return [queue for key, queue in self.store.bindings(exchange)
                if _matches(kind, key, routing_key)]

    def _route(self, message: dict[str, Any], exchange: str, routing_key: str,
               **kwargs: Any) -> None:
        """Put a direct or topic message into every queue it matches."""
        queues = [queue for queue in self._lookup(exchange, routing_key) if queue]
        if not queues:
            return self._unroutable(message, exchange, routing_key, **kwargs)
        for queue in queues:
            self._put(queue, message, **kwargs)

    def _unroutable(self, message: dict[str, Any], exchange: str, routing_key: str,
                    mandatory: bool = False, **kwargs: Any) -> None:
        """No queue is bound for this message. RabbitMQ drops it (and returns it to a
        ``mandatory`` publisher), kombu's virtual transports drop it unless the
        ``deadletter_queue`` option names a queue for it (with an UndeliverableWarning), and
        kombu's own test suite expects that. Here, as a kombu user expects, the publish raises
        nothing -- but nothing a producer meant to keep vanishes: the ``deadletter_queue`` takes
        it if set; else it is kept as a dead letter of :data:`UNROUTABLE` that says why (with
        the warning). ``mandatory`` refuses it with a MessageError instead; a transient message
        (a remote-control reply to a client that left) is dropped, as RabbitMQ drops it."""
        reason = (f"unroutable: no queue is bound to exchange {exchange!r} with routing key "
                  f"{routing_key!r}")
        if mandatory:
            raise MessageError(f"{reason}; nothing was stored (mandatory publish)")
        if message["properties"].get("delivery_mode") == TRANSIENT:
            logger.debug("pgbroker: transient message dropped: %s", reason)
            return None
        warnings.warn(UndeliverableWarning(UNDELIVERABLE_FMT.format(
            exchange=exchange, routing_key=routing_key)), stacklevel=2)
        if self.deadletter_queue:
            self._new_queue(self.deadletter_queue)
            return self._put(self.deadletter_queue, message, **kwargs)
        job = dataclasses.replace(self.new_job(UNROUTABLE, message), idempotency_key=None)
        target = current_target()
        if target is not None:  # inside pgbroker.transaction(db): the caller's transaction
            target.add_dead(job, self.settings, reason)
        else:
            self.store.insert_dead(job, reason)
        logger.warning("pgbroker: %s; kept as a dead letter of queue %r", reason, UNROUTABLE)
        return None

    def _put_fanout(self, exchange: str, message: dict[str, Any], routing_key: str,
                    **kwargs: Any) -> None:
        """A message to a fanout exchange, as AMQP routes it: a job in every bound queue
        declared without auto-delete (or exclusive), where it waits until consumed; and a
        broadcast for the auto-delete ones (Celery's mailboxes and ``Broadcast`` queues), which
        exist only while consumed. Nobody bound: nothing is written. A revoke is also written
        to the jobs it names, bound or not (:mod:`pgbroker._revoke`)."""
        job = self.new_job(None, message)
        revoke = _revoke.request_of(exchange, message)
        if revoke is not None:
            _revoke.apply(self.store, revoke, job, via="celery revoke")
            return
        target = current_target()
        if target is None:
            self.store.fanout(job)  # one statement
            return
        # inside pgbroker.transaction(db): the jobs are written by the caller's transaction
        transient = []
        for queue, stored in self.store.fanout_queues(exchange):
            if stored:
                target.add(dataclasses.replace(job, id=uuid6.uuid7(), queue=queue),
                           self.settings)
            else:
                transient.append(queue)
        if transient:
            self.store.broadcast(job, transient)

    def _broadcast(self, exchange: str, message: dict[str, Any]) -> None:
        """A transient message to a topic exchange (worker events): one row, read by every
        process consuming a queue bound to ``exchange`` whose binding matches. Nobody bound (no
        monitor running): nothing is written."""
        if not self._bindings(exchange):
            return
        self.store.broadcast(self.new_job(None, message))

    # -- queues ----------------------------------------------------------------------------------

    def prepare_queue_arguments(self, arguments: dict[str, Any] | None,
                                **kwargs: Any) -> dict[str, Any]:
        """Queue options as AMQP arguments (``expires`` -> ``x-expires`` in ms, ``message_ttl``
        -> ``x-message-ttl``), stored with the queue and honoured by every process."""
        return to_rabbitmq_queue_arguments(arguments or {}, **kwargs)

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        validate_queue_name(queue)
        if queue not in self._declared:
            # auto-delete and exclusive queues exist only while consumed (in AMQP): a fanout
            # message reaches them as a broadcast, never as a job that would wait there
            transient = bool(kwargs.get("auto_delete") or kwargs.get("exclusive"))
            self.store.declare_queue(queue, kwargs.get("arguments") or {},
                                     kwargs.get("durable"), transient)
            self._declared.add(queue)

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.store.queue_exists(validate_queue_name(queue))

    def _size(self, queue: str) -> int:
        return self.store.queue_size(queue)

    def _purge(self, queue: str) -> int:
        return self.store.purge(validate_queue_name(queue))

    def queue_delete(self, queue: str, if_unused: bool = False, if_empty: bool = False,
                     **kwargs: Any) -> None:
        """Delete the queue, its bindings and its waiting messages, whoever bound it (kombu's
        base class only deletes once per binding this process knows of)."""
        if if_empty and self._size(queue):
            return
        super().queue_delete(queue, if_unused, if_empty, **kwargs)
        self._delete(queue)

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self.store.delete_queue(queue)
        self._declared.discard(queue)

    # -- publish ---------------------------------------------------------------------------------

    def basic_publish(self, message: dict[str, Any], exchange: str, routing_key: str,
                      **kwargs: Any) -> Any:
        if exchange:  # names that no binding can match are refused, not routed to nowhere
            validate_queue_name(exchange, "exchange")
            if routing_key:
                validate_queue_name(routing_key, "routing key")
        return super().basic_publish(message, exchange, routing_key, **kwargs)

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        job = self.new_job(queue, message)
        target = current_target()
        if target is not None:  # inside pgbroker.transaction(db): the caller's transaction
            target.add(job, self.settings)
        else:
            self.store.insert(job)

    def new_job(self, queue: str | None, message: dict[str, Any]) -> NewJob:
        return message_to_job(self.settings, queue, message)

    # -- consume ---------------------------------------------------------------------------------

    def basic_consume(self, queue: str, no_ack: bool, callback: Any, consumer_tag: str,
                      **kwargs: Any) -> str:
        validate_queue_name(queue)
        self.transport._listen()  # before the first claim, or a NOTIFY could fall in between
        result = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        self.transport.lease.ensure(refresh=True)  # listed at once: x-expires must not hit it
        if no_ack:
            self._no_ack.add(queue)
        self._more = True
        self.transport.reset_credit()
        self.transport.request_turn()
        self.transport.schedule_due(self.store.next_due([queue]))
        return result

    def basic_qos(self, prefetch_size: int = 0, prefetch_count: int = 0,
                  apply_global: bool = False) -> None:
        super().basic_qos(prefetch_size, prefetch_count, apply_global)
        self.transport.request_turn()  # Celery raises the count for tasks with an eta

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        self.transport.reset_credit()
        if queue is not None and queue not in self._active_queues:
            self._no_ack.discard(queue)
            if "lease" in self.transport.__dict__:
                self.transport.lease.ensure(refresh=True)
        return result

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        message = super().basic_get(queue, no_ack, **kwargs)
        if message is not None and no_ack:
            self._ack_at_claim([message.delivery_tag])
        return message

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        """``basic_get``: claim one message now, or raise Empty."""
        validate_queue_name(queue)
        consumer = self.transport.lease.ensure()
        self.store.promote([queue])
        for row in self.store.claim(queue, 1, consumer):
            payload = self._payload(row)
            if payload is not None:
                return payload
        raise virtual.Empty()

    def _ack_at_claim(self, tags: list[str]) -> None:
        """no_ack consumers never ack: their deliveries are complete once handed over."""
        deliveries = [d for d in map(parse_delivery_tag, tags) if d is not None]
        for delete in (True, False):
            batch = [d[:2] for d in deliveries if (d[2] or self.settings.retention == 0) == delete]
            if batch:
                self.transport.settle_rows("ack_delete" if delete else "ack", batch)

    def flush_acks(self) -> None:
        """Write the deferred acks now."""
        self.transport.settle()
        acks, self.pending_acks = self.pending_acks, []
        if acks:
            self.transport.settle_rows("ack", acks)

    def claim_and_deliver(self) -> int:
        """Synchronous path (``drain_events``): claim what the free prefetch slots allow and
        hand it over, writing the deferred acks in the same statement. The event loop uses
        :meth:`send_claim` / :meth:`claimed` instead."""
        queues = self._active_queues
        if not queues or not self.qos.can_consume():
            self.flush_acks()
            return 0
        limit = self.qos.can_consume_max_estimate() or self.settings.claim_batch_max
        consumer = self.transport.lease.ensure()
        self._rotation = (self._rotation + 1) % len(queues)
        ordered = queues[self._rotation:] + queues[:self._rotation]
        delivered = 0
        full = False
        for queue in ordered:
            want = limit - delivered
            acks, self.pending_acks = self.pending_acks, []
            locked: list[tuple[uuid.UUID, int]] = []
            rows = self.store.claim(queue, want, consumer, acks, locked)
            self.transport.settle_later("ack", locked)
            full = full or len(rows) >= want
            delivered += self._hand_over(queue, rows)
            if delivered >= limit:
                break
        self._claimed(delivered > 0)
        # A full batch means more may be waiting; otherwise wait for a NOTIFY, a due timer or
        # the poll fallback.
        self._more = full
        return delivered

    def send_claim(self, line: LoopStatements) -> bool:
        """Event loop: send the claim of the next queue of this round, with the deferred acks,
        without waiting for it (:meth:`claimed` gets its rows). False: no free prefetch slot."""
        if not self.qos.can_consume():
            return False
        self._round = [q for q in self._round if q in self._active_queues]
        if not self._round:
            queues = self._active_queues
            self._rotation = (self._rotation + 1) % len(queues)
            self._round = queues[self._rotation:] + queues[:self._rotation]
            self._more = False  # taken: a NOTIFY or a full batch sets it again
        want = self.qos.can_consume_max_estimate() or self.settings.claim_batch_max
        queue = self._round.pop(0)
        acks, self.pending_acks = self.pending_acks, []
        line.send_claim(queue, want, self.transport.lease.ensure(), acks)
        self.transport.in_flight = (self, queue, want)
        return True

    def claimed(self, queue: str, want: int, rows: list[JobRow]) -> None:
        """Hand over the rows of a claim sent by :meth:`send_claim`."""
        self._hand_over(queue, rows)
        self._claimed(bool(rows))
        if len(rows) >= want:  # a full batch: more may be waiting, in a new round
            self._more = True
            self._round = []

    def wake(self) -> None:
        """A NOTIFY says a job is due in a queue of this channel: claim. Any role that can
        connect can send one, so after a claim woken this way found nothing, the next wake-up
        waits for the end of WAKE_COALESCE: a flood of them costs one claim per window, not one
        each (a real job then waits that long at most)."""
        if monotonic() >= self._quiet_until:
            self._more = True
            self._woken = True
            self._held_wake = False
        else:
            self._held_wake = True
            self.transport.wake_at(self._quiet_until)

    def _claimed(self, found: bool) -> None:
        if found:
            self._quiet_until = 0.0
        elif self._woken:
            self._quiet_until = monotonic() + WAKE_COALESCE
        self._woken = False

    def _hand_over(self, queue: str, rows: list[JobRow]) -> int:
        """Hand claimed rows to the consumer of ``queue``; returns how many were handed over.

        A row the consumer's own code fails on before running it (Celery raised, for a
        protocol-2 body that is not ``[args, kwargs, embed]``, and its worker exited) goes dead
        with the cause, alone: the rest of the batch is handed over, and no other worker is
        crashed by a redelivery of it."""
        handed = []
        for row in rows:
            payload = self._payload(row)
            if payload is None:
                continue
            tag = payload["properties"]["delivery_tag"]
            try:
                self.transport.hand_over(self, payload, row.queue)
            except self.transport.connection_errors:
                raise
            except Exception as exc:  # noqa: BLE001 - see above
                reason = (f"the consumer failed on it before running it: "
                          f"{type(exc).__name__}: {exc}")
                logger.error("pgbroker: job %s goes dead: %s", row.id, reason, exc_info=True)
                self.qos.refuse(tag, (row.id, row.attempt), reason)
                continue
            handed.append(tag)
        if handed and queue in self._no_ack:
            self._ack_at_claim(handed)
        return len(handed)

    def _payload(self, row: JobRow) -> dict[str, Any] | None:
        """The kombu payload of a claimed row; a row that cannot be one goes dead, with why."""
        try:
            for what, value in (("headers", row.headers), ("properties", row.properties)):
                if isinstance(value, Unreadable):  # see pgbroker._text.load_jsonb
                    raise ValueError(f"its {what} cannot be read back: {value.reason}")
                if not isinstance(value, dict):
                    raise TypeError("headers and properties must be JSON objects")
            tag = _delivery_tag(row.id, row.attempt,
                                row.properties.get("delivery_mode") == TRANSIENT)
            headers = due_now(row.headers)  # due by the database clock: by this one too
            return kombu_payload(row.body, row.content_type, row.content_encoding, headers,
                                 row.properties, row.exchange, row.routing_key, row.priority,
                                 tag, redelivered=row.attempt > 1)
        except Exception as exc:  # noqa: BLE001 - any malformed row must not stop the consumer
            logger.error("pgbroker: job %s is malformed and goes dead: %s", row.id, exc)
            self.transport.settle_rows("bury", [(row.id, row.attempt)],
                                       f"malformed job row: {type(exc).__name__}: {exc}")
            return None

    def basic_recover(self, requeue: bool = False) -> Any:
        if not requeue:
            raise NotImplementedError("pgbroker supports basic_recover(requeue=True) only")
        return self.qos.restore_unacked()

    def close(self) -> None:
        if not self.closed:
            try:
                self.transport.give_back(self)
                self.flush_acks()
            except Exception as exc:  # noqa: BLE001 - redelivered after the lease, at worst
                logger.warning("pgbroker: %d ack(s) not written at close: %s",
                               len(self.pending_acks), exc)
        super().close()
        self._undecodable.clear()


class Transport(virtual.Transport):
    """kombu transport over PostgreSQL (see the module docstring)."""

    Channel = Channel

    #: kombu parses a pgbroker:// URL into the connection's fields (host, port, user,
    #: password, database), as it does amqp://, so failover alternates ("pgbroker://a;
    #: pgbroker://b") report the URL in use. A libpq URL goes after "pgbroker+" (query
    #: options, several hosts): kombu leaves that part alone.
    can_parse_url = False
    default_port = 5432
    driver_type = "postgresql"
    driver_name = "psycopg"
    polling_interval = None  # drain_events below waits on LISTEN, never sleeps blindly

    implements = virtual.Transport.implements.extend(
        asynchronous=True,
        exchange_type=frozenset(["direct", "topic", "fanout"]),
        heartbeats=False,
    )

    connection_errors = virtual.Transport.connection_errors + _db.CONNECTION_ERRORS
    channel_errors = virtual.Transport.channel_errors + (ChannelError,)

    def __init__(self, client: Any, **kwargs: Any):
        super().__init__(client, **kwargs)
        self.settings = Settings.from_options(client.transport_options)
        self.conninfo = self._conninfo(client)
        self.store = Store(self.conninfo, self.settings)
        self._listener: psycopg.Connection[Any] | None = None
        #: the event loop's claims and acks, sent on the LISTEN connection without waiting
        self._line: LoopStatements | None = None
        #: the claim in flight on it: (channel, queue, how many were asked for)
        self.in_flight: tuple[Channel, str, int] | None = None
        self._loop: Any = None
        self._timers: list[Any] = []
        self._due_entry: Any = None
        self._due_at: float | None = None
        self._due_dirty = False  # a scheduled job was published: recompute the next due time
        self._wake: tuple[int, int] | None = None  # self-pipe waking the event loop for a turn
        self._turn_requested = False
        self._last_poll = monotonic()
        #: the thread handing over a message in drain_events (its acks are deferred)
        self._draining: int | None = None
        #: claimed or broadcast messages waiting for drain_events (synchronous path only)
        self._ready: collections.deque[tuple[Channel, dict[str, Any], str]] = collections.deque()
        #: drain_events calls that return at once, having delivered a batch (see there)
        self._credit = 0
        self._settler = Settler(self.store)  # what met another session's row lock
        self._settle_entry: Any = None
        #: wake-ups held back (Channel.wake) until then, and its timer in the event loop
        self._wake_due: float | None = None
        self._wake_entry: Any = None
        self._due_checked_at = 0.0  # when _refresh_due last asked the database
        #: broadcast id -> when it was delivered here (see _deliver_broadcast)
        self._broadcasts_seen: dict[str, float] = {}

    @staticmethod
    def _conninfo(client: Any) -> str:
        hostname = client.hostname
        if hostname and "://" in hostname:  # pgbroker+postgresql://...: a libpq URL
            # Keep the password out of the URL kombu shows (inspect stats prints the hostname,
            # as_uri formats it): it moves to kombu's password field, which Celery never
            # prints, and the URL keeps "**" where it was.
            bare, password = _db.split_password(hostname)
            if password is not None:
                client.hostname = _db.mask_password(hostname)
                client.password = client.password or password
            url = _db.libpq_url(bare)
            if client.password:
                return psycopg.conninfo.make_conninfo(url, password=client.password)
            return url
        if hostname and "=" in hostname:  # a key=value conninfo string
            return hostname
        # a pgbroker:// URL kombu parsed, or separate arguments; no host ("pgbroker://"):
        # libpq's defaults (PGHOST, the local socket)
        dbname = client.virtual_host if client.virtual_host not in (None, "", "/") else None
        return psycopg.conninfo.make_conninfo(
            host=hostname or None, port=client.port or None, user=client.userid or None,
            password=client.password or None, dbname=dbname)

    @cached_property
    def lease(self) -> Lease:
        return Lease(self.store, self._consumed_queues)

    def _consumed_queues(self) -> list[str]:
        return sorted({q for ch in self.channels for q in ch._active_queues})

    def driver_version(self) -> str:
        return psycopg.__version__

    # -- connection ------------------------------------------------------------------------------

    def establish_connection(self) -> Transport:
        self.store.connect()  # really connects: a dead database is an error now, not later
        return super().establish_connection()

    def close_connection(self, connection: Any) -> None:
        try:
            super().close_connection(connection)  # restores unacked deliveries first
        finally:
            self._unregister_loop()
            if "lease" in self.__dict__:
                self.lease.close()
            if self._settler.pending:  # a last try; what is left stays running, rescued later
                try:
                    self._settler.retry()
                except Exception as exc:  # noqa: BLE001 - the sweeper redelivers them
                    logger.warning("pgbroker: delivery updates not written at close: %s", exc)
                if self._settler.pending:
                    logger.warning("pgbroker: %d delivery update(s) still wait for another "
                                   "session's row lock at close; the sweeper redelivers them",
                                   len(self._settler.pending))
                    self._settler.pending = []
            _db.close(self._listener)
            self._listener = None
            self._line, self.in_flight = None, None
            if self._wake is not None:
                for fd in self._wake:
                    os.close(fd)
                self._wake = None
            self.store.close()

    def _listen(self) -> psycopg.Connection[Any]:
        if not _db.owned(self._listener):
            conn = _db.connect(self.conninfo, connect_timeout=self.settings.connect_timeout,
                               application_name="pgbroker listen")
            with _db.translate_errors("LISTEN"):
                conn.execute(f'LISTEN "{self.settings.channel}"')
            self._listener = conn
            self._line, self.in_flight = None, None
        assert self._listener is not None
        return self._listener

    def _read_notifications(self) -> int:
        """Drain pending NOTIFYs: mark the channels consuming those queues, arm due timers,
        deliver broadcasts. Returns the number of broadcast deliveries made."""
        pgconn = self._listen().pgconn
        with _db.translate_errors("reading notifications"):
            pgconn.consume_input()
            if pgconn.status != psycopg.pq.ConnStatus.OK:
                raise DatabaseUnavailable("the LISTEN connection was closed by the server")
        delivered = 0
        while (note := pgconn.notifies()) is not None:
            kind, _, rest = note.extra.decode("utf-8", "replace").partition(" ")
            if kind == "b":
                broadcast_id, _, exchange = rest.partition(" ")
                delivered += self._deliver_broadcast(broadcast_id, exchange)
                continue
            try:
                delay = float(kind)
            except ValueError:
                continue
            for channel in self.channels:
                if rest in channel._active_queues:
                    if delay <= 0:
                        channel.wake()
                    else:
                        # the payload's delay was measured at INSERT, not at COMMIT: ask the
                        # database clock once per loop turn, however many arrived
                        self._due_dirty = True
        return delivered

    def _deliver_broadcast(self, broadcast_id: str, exchange: str) -> int:
        """Hand a broadcast to this process's consumed queues bound to ``exchange``, once: any
        role that can connect can replay its NOTIFY, or name another exchange in it."""
        bound = [(channel, queue, key) for channel in self.channels
                 for queue in channel._active_queues
                 for ex, key, _ in self.state.queue_bindings(queue) if ex == exchange]
        if not bound or broadcast_id in self._broadcasts_seen:
            return 0
        try:
            row = self.store.broadcast_get(uuid.UUID(broadcast_id), BROADCAST_TTL)
        except ValueError:
            return 0
        if row is None or row[0] != exchange:  # pruned already, or a spoofed exchange
            return 0
        self._seen_broadcast(broadcast_id)
        _, routing_key, body, content_type, content_encoding, headers, properties, queues = row
        kind = self.state.exchanges.get(exchange, {}).get("type", "fanout")
        delivered = 0
        for n, (channel, queue, key) in enumerate(bound):
            # (a fanout's broadcast is for its auto-delete queues: the others got a job)
            if (queues is None or queue in queues) and _matches(kind, key, routing_key):
                self.hand_over(channel, kombu_payload(
                    body, content_type, content_encoding, headers, properties, exchange,
                    routing_key, 0, f"b/{broadcast_id}/{n}", redelivered=False), queue)
                delivered += 1
        return delivered

    def _seen_broadcast(self, broadcast_id: str) -> None:
        now = monotonic()
        seen = self._broadcasts_seen
        seen[broadcast_id] = now
        while seen:  # oldest first (insertion order): forget what can no longer be read
            oldest = next(iter(seen))
            if now - seen[oldest] < 2 * BROADCAST_TTL:
                break
            del seen[oldest]

    def wake_at(self, at: float) -> None:
        """Wake the channels that held back a wake-up (Channel.wake) at ``at`` (monotonic)."""
        if self._wake_due is not None and self._wake_due <= at:
            return
        self._wake_due = at
        if self._loop is not None:
            if self._wake_entry is not None:
                self._wake_entry.cancel()
            self._wake_entry = self._loop.call_later(max(at - monotonic(), 0.0), self._on_wake_due)

    def _on_wake_due(self) -> None:
        self._wake_due, self._wake_entry = None, None
        for channel in self.channels:
            if channel._held_wake and channel._active_queues:
                channel.wake()
        self.request_turn()

    # -- acks, requeues and burials that met another session's row lock (pgbroker._settle) ----

    def settle_rows(self, op: str, deliveries: list[tuple[uuid.UUID, int]],
                    error: str | None = None) -> None:
        """``op`` ("ack", "ack_delete", "requeue" or "bury") on these deliveries now; those
        whose row another session holds locked are done again a second later."""
        self._settler(op, deliveries, error)
        self._arm_settle()

    def settle_later(self, op: str, deliveries: list[tuple[uuid.UUID, int]]) -> None:
        self._settler.keep(op, deliveries)
        self._arm_settle()

    def _arm_settle(self) -> None:
        if self._settler.pending and self._loop is not None and self._settle_entry is None:
            self._settle_entry = self._loop.call_later(SETTLE_RETRY, self._retry_unsettled)

    def _retry_unsettled(self) -> None:
        self._settle_entry = None
        self._settler.retry()
        self._arm_settle()

    # -- due timers (scheduled jobs) -------------------------------------------------------------

    def schedule_due(self, delay: float | None) -> None:
        """Wake up in ``delay`` seconds to promote scheduled jobs (earliest wins)."""
        if delay is None:
            return
        at = monotonic() + max(delay, 0.0)
        if self._due_at is not None and self._due_at <= at:
            return
        self._due_at = at
        if self._loop is not None:
            if self._due_entry is not None:
                self._due_entry.cancel()
            self._due_entry = self._loop.call_later(max(delay, 0.0), self._on_due)

    def _on_due(self) -> None:
        self._due_at = None
        self._due_entry = None
        queues = self._consumed_queues()
        if not queues:
            return
        if self.store.promote(queues):
            for channel in self.channels:
                channel._more = True
            self.request_turn()
        self.schedule_due(self._next_due_after_promote(queues))

    def _next_due_after_promote(self, queues: list[str]) -> float | None:
        delay = self.store.next_due(queues)
        # a due time already reached but not promoted (LIMIT, or a race): try again shortly
        return None if delay is None else max(delay, 0.005)

    def _poll(self) -> None:
        """The fallback for lost notifications: claim anyway, and check due jobs."""
        self._last_poll = monotonic()
        for channel in self.channels:
            channel._more = True
        if self._consumed_queues():
            self._on_due()
        self.request_turn()

    # -- the event loop (Celery worker) ----------------------------------------------------------

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        self._unregister_loop()
        self._loop = loop
        listener = self._listen()
        if self._line is None:
            self._line = LoopStatements(listener, self.settings)
        loop.add_reader(listener.fileno(), self._on_readable)
        if self._wake is None:
            self._wake = os.pipe()
            for fd in self._wake:
                os.set_blocking(fd, False)
        loop.add_reader(self._wake[0], self._on_wake)
        self._timers = [loop.call_repeatedly(self.settings.poll_interval, self._poll)]
        if self._due_at is not None:
            delay, self._due_at = self._due_at - monotonic(), None
            self.schedule_due(delay)
        self.request_turn()

    def _unregister_loop(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        try:
            self.settle()
        except Exception as exc:  # noqa: BLE001 - its claims are rescued after the lease
            logger.warning("pgbroker: the claim in flight did not finish: %s", exc)
        for channel in self.channels:  # acks are no longer deferred: write the pending ones
            try:
                channel.flush_acks()
            except Exception as exc:  # noqa: BLE001 - redelivered after the lease, at worst
                logger.warning("pgbroker: acks not written: %s", exc)
        for entry in self._timers + [self._due_entry, self._settle_entry, self._wake_entry]:
            if entry is not None:
                entry.cancel()
        self._timers, self._due_entry, self._due_at = [], None, None
        self._settle_entry, self._wake_entry, self._wake_due = None, None, None
        fds = [self._wake[0]] if self._wake else []
        if self._listener is not None and not self._listener.closed:
            fds.append(self._listener.fileno())
        for fd in fds:
            try:
                loop.remove_reader(fd)
            except Exception:  # noqa: BLE001 - the hub may already be reset
                pass

    @property
    def defer_acks(self) -> bool:
        """Acks wait: for the end of the event-loop turn inside a worker's event loop; on the
        synchronous path, for the last message of the claimed batch to be handed over (acks
        made from the callbacks of ``drain_events`` in its own thread only)."""
        return self._loop is not None or self._draining == threading.get_ident()

    def request_turn(self) -> None:
        """Ask the event loop for a claim turn (after an ack, a QoS change, a timer).

        The turn runs from a reader callback, never from ``hub.on_tick``: Celery's prefork pool
        writes received tasks to its children from its own on_tick callback, and on_tick is an
        unordered set, so a task delivered there could wait a whole poll timeout. A byte on a
        pipe wakes the poller from any phase of the loop (``call_soon`` from the loop thread
        does not)."""
        if self._loop is not None and self._wake is not None and not self._turn_requested:
            self._turn_requested = True
            try:
                os.write(self._wake[1], b"\0")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already

    def _on_wake(self) -> None:
        try:
            while os.read(self._wake[0], 4096):  # type: ignore[index]
                pass
        except BlockingIOError:
            pass
        self._turn_requested = False
        self._turn()

    def _on_readable(self) -> None:
        self._read_notifications()
        self._take_result()
        self._turn()

    def _take_result(self) -> None:
        """Hand over the rows of the claim in flight, if it has finished."""
        if self._line is None or (rows := self._line.result()) is None:
            return
        self.settle_later("ack", self._line.take_locked())
        claim, self.in_flight = self.in_flight, None
        if claim is not None:
            channel, queue, want = claim
            channel.claimed(queue, want, rows)

    def settle(self) -> None:
        """Wait for the statement in flight (closing, restoring): what it claimed goes back."""
        if self._line is None or not self._line.busy:
            return
        claim, self.in_flight = self.in_flight, None
        rows = self._line.result(wait=True)
        self.settle_later("ack", self._line.take_locked())
        if rows and claim is not None:
            self.settle_rows("requeue", [(row.id, row.attempt) for row in rows],
                             "restored unacked")

    def _refresh_due(self) -> None:
        if not self._due_dirty:
            return
        if monotonic() - self._due_checked_at < WAKE_COALESCE:  # spoofed ones: see wake()
            self.wake_at(self._due_checked_at + WAKE_COALESCE)
            return
        self._due_dirty = False
        self._due_checked_at = monotonic()
        queues = self._consumed_queues()
        if queues:
            self.schedule_due(self.store.next_due(queues))

    def _turn(self) -> None:
        """One turn of the event loop: send a claim (with the deferred acks) for a channel that
        may find something, or else the acks alone; never wait for it. With a statement in
        flight, its result starts the next turn."""
        self._refresh_due()
        line = self._line
        if line is None or line.busy:
            return
        for channel in self.channels:
            if (channel._more or channel._round) and channel._active_queues \
                    and channel.send_claim(line):
                return
        acks = [ack for channel in self.channels for ack in channel.pending_acks]
        if acks:
            for channel in self.channels:
                channel.pending_acks = []
            line.send_ack(acks)

    # -- the synchronous path (plain kombu consumers, celery inspect clients) --------------------

    def hand_over(self, channel: Channel, payload: dict[str, Any], queue: str) -> None:
        """Deliver now inside the worker's event loop; on the synchronous path, keep it for
        ``drain_events``."""
        if self._loop is not None:
            self._deliver(payload, queue)
        else:
            self._ready.append((channel, payload, queue))

    def give_back(self, channel: Channel) -> None:
        """Requeue what ``channel`` claimed but has not handed over yet (it is closing)."""
        kept = [item for item in self._ready if item[0] is not channel]
        mine = [item[1]["properties"]["delivery_tag"] for item in self._ready
                if item[0] is channel]
        self._ready.clear()
        self._ready.extend(kept)
        deliveries = [d[:2] for d in map(parse_delivery_tag, mine) if d is not None and not d[2]]
        if deliveries:
            self.settle_rows("requeue", deliveries, "restored unacked")

    def drain_events(self, connection: Any, timeout: float | None = None) -> None:
        """Deliver everything one claim returned (and the broadcasts read meanwhile), highest
        priority first, then return; or wait for a notification, a due time or the poll.

        kombu's Mailbox (``celery inspect``/``control`` with a limit of replies) counts replies
        by calls: after a call that delivered n messages, the next n - 1 calls that find
        nothing to deliver return at once instead of waiting, so it does not wait its timeout
        for replies it already has. A new or cancelled consumer starts the count again.
        """
        deadline = None if timeout is None else monotonic() + timeout
        while True:
            if self._settler.due:  # the synchronous path has no timers
                self._settler.retry()
            if not self._ready:
                for channel in list(self.channels):
                    if channel._more and channel._active_queues:
                        channel.claim_and_deliver()
            if self._ready:
                self._deliver_ready()
                return
            if self._credit:
                self._credit -= 1
                return
            self._refresh_due()
            now = monotonic()
            if self._due_at is not None and now >= self._due_at:
                self._on_due()
                continue
            if self._wake_due is not None and now >= self._wake_due:
                self._on_wake_due()
                continue
            if now - self._last_poll >= self.settings.poll_interval:
                self._poll()
                continue
            wait = self._last_poll + self.settings.poll_interval - now
            for at in (self._due_at, self._wake_due):
                if at is not None:
                    wait = min(wait, at - now)
            if deadline is not None:
                if now >= deadline:
                    raise socket.timeout()
                wait = min(wait, deadline - now)
            if _wait_readable(self._listen().fileno(), max(wait, 0)):
                self._read_notifications()

    def _deliver_ready(self) -> None:
        """Hand over what is ready, highest priority first (a claim of several queues, and
        broadcasts, are merged); the acks made in the callbacks go in one statement at the end.
        A callback that raises leaves the rest for the next call."""
        batch = sorted(self._ready, key=lambda item: -item[1]["properties"].get("priority", 0))
        self._ready.clear()
        self._ready.extend(batch)
        self._credit = len(batch) - 1
        self._draining = threading.get_ident()
        try:
            for _ in range(len(batch)):
                _, payload, queue = self._ready.popleft()
                self._deliver(payload, queue)
        finally:
            self._draining = None
            for channel in self.channels:
                channel.flush_acks()

    def reset_credit(self) -> None:
        """A consumer started or stopped: ``drain_events``'s next empty call waits again."""
        self._credit = 0

    def verify_connection(self, connection: Any) -> bool:
        return self.store.conn is not None


def _register() -> None:
    """Register the ``pgbroker`` URL scheme with kombu (done by ``import pgbroker``)."""
    from kombu.transport import TRANSPORT_ALIASES

    TRANSPORT_ALIASES.setdefault("pgbroker", "pgbroker.transport:Transport")

