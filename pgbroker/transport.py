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
are kept dead in ``pgbroker.unroutable``). Options of other transports (``polling_interval``,
``visibility_timeout``...) are read as pgbroker's or warned about:
:mod:`pgbroker._model.foreign_options`. Unknown options are an error.

This module is kombu glue: ``Channel`` and ``QoS`` call the connection's
:class:`pgbroker._consume.consumer.Consumer` (LISTEN, claims, timers, the event loop, acks), the
channel's :class:`pgbroker._produce.publish.Publisher` (where a published message is written) and
the connection's :class:`pgbroker._pg.store.Store` (the other statements: declarations, bindings,
``basic_get``); every message check is in :mod:`pgbroker._model.message`, the URL handling in
:mod:`pgbroker._pg.driver`.
"""

from __future__ import annotations

import logging
import os
import uuid
import warnings
from time import monotonic
from typing import Any

import psycopg
from kombu.exceptions import ChannelError
from kombu.transport import TRANSPORT_ALIASES, virtual
from kombu.transport.base import to_rabbitmq_queue_arguments
from kombu.transport.virtual.base import UNDELIVERABLE_FMT, UndeliverableWarning
from kombu.transport.virtual.exchange import STANDARD_EXCHANGE_TYPES

from ._consume.claim_policy import ClaimPolicy
from ._consume.consumer import Consumer
from ._consume.lease import Lease
from ._model.message import (
    MAX_NAME_LENGTH,
    REQUEUED,
    TRANSIENT,
    message_to_job,
    parse_delivery_tag,
    validate_binding,
    validate_queue_name,
)
from ._model.routing import RoutingDirectExchange, RoutingTopicExchange, matches
from ._pg import driver as _db
from ._pg.process_store import acquire, release
from ._pg.store import Store
from ._produce.publish import UNROUTABLE, Publisher
from .errors import MessageError
from .settings import Settings

__all__ = ["Transport", "Channel", "QoS", "Message", "MAX_NAME_LENGTH", "UNROUTABLE",
           "message_to_job", "parse_delivery_tag", "validate_queue_name"]

logger = logging.getLogger(__name__)

#: Seconds a process trusts what it read of an exchange's bindings before reading them again.
BINDINGS_TTL = 1.0


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
            consumer = channel.consumer
            if reason is not None:
                consumer.settle_rows("bury", [(job_id, attempt)], reason)
            elif consumer.defer_acks and not transient and channel.settings.retention:
                consumer.defer_ack(channel, (job_id, attempt))
            else:
                consumer.settle_rows("ack_delete" if transient else "ack", [(job_id, attempt)])
                if consumer.defer_acks:  # the freed prefetch slot: claim again (retention 0)
                    consumer.request_turn()
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        channel: Channel = self.channel
        reason = channel._undecodable.pop(delivery_tag, None)
        delivery = parse_delivery_tag(delivery_tag)
        if delivery is not None:
            job_id, attempt, _ = delivery
            if requeue and reason is None:
                channel.consumer.settle_rows("requeue", [(job_id, attempt)], REQUEUED)
            else:
                channel.consumer.settle_rows("bury", [(job_id, attempt)],
                                             reason or "rejected by the consumer without requeue")
        self._quick_ack(delivery_tag)
        channel.consumer.request_turn()  # a prefetch slot is free

    def refuse(self, delivery_tag: str, delivery: tuple[uuid.UUID, int], reason: str) -> None:
        """A delivery its consumer failed on: ``dead`` with ``reason``, its prefetch slot free."""
        channel: Channel = self.channel
        if delivery_tag in self._delivered:
            channel._undecodable[delivery_tag] = reason
            self.reject(delivery_tag, requeue=False)
        else:  # a no_ack consumer's: not tracked
            channel.consumer.settle_rows("bury", [delivery], reason)

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
            self.channel.consumer.settle_rows("requeue", deliveries, "restored unacked")
        except Exception as exc:  # noqa: BLE001 - the sweeper rescues them after the lease
            logger.warning("pgbroker: could not requeue %d unacked message(s): %s; they are "
                           "redelivered once this consumer's lease expires", len(tags), exc)
        return []

    def restore_unacked_once(self, stderr: Any = None) -> None:
        if os.getpid() != self._pid:
            self._on_collect.cancel()
            return
        super().restore_unacked_once(stderr)


class Channel(virtual.Channel):
    """A kombu channel over the ``jobs`` table."""

    QoS = QoS
    Message = Message
    exchange_types = {**STANDARD_EXCHANGE_TYPES, "direct": RoutingDirectExchange,
                      "topic": RoutingTopicExchange}
    supports_fanout = True  # bindings are in the database: every process sees them
    # the body is stored as bytes; no base64 detour (the ignore: kombu's 'base64' types it str)
    body_encoding = None  # type: ignore[assignment]
    default_priority = 0
    min_priority = 0
    max_priority = 255

    def __init__(self, connection: Transport, **kwargs: Any):
        super().__init__(connection, **kwargs)
        self.transport: Transport = connection
        self.store: Store = connection.store
        self.consumer: Consumer = connection.consumer
        self.settings: Settings = connection.settings
        self.publisher = Publisher(self.store, self.settings)
        #: which queue next, how many, whether a claim may find any; the deferred acks
        self.claims = ClaimPolicy(self.settings.claim_batch_max)
        self._undecodable: dict[str, str] = {}
        self._declared: set[str] = set()
        self._bound: dict[str, tuple[float, list[tuple[str, str]]]] = {}  # exchange -> bindings

    @property
    def queues(self) -> list[str]:
        """The queues this channel consumes (for the Consumer)."""
        return self._active_queues

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
                if matches(kind, key, routing_key)]

    def route(self, message: dict[str, Any], exchange: str, routing_key: str,
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
        self.publisher.dead_letter(message, reason)
        return None

    def _put_fanout(self, exchange: str, message: dict[str, Any], routing_key: str,
                    **kwargs: Any) -> None:
        self.publisher.fanout(exchange, message)  # jobs and a broadcast, as AMQP routes it

    def broadcast(self, exchange: str, message: dict[str, Any]) -> None:
        """A transient message to a topic exchange (worker events): one row, read by every
        process consuming a queue bound to ``exchange`` whose binding matches. Nobody bound (no
        monitor running): nothing is written."""
        if self._bindings(exchange):
            self.publisher.broadcast(message)

    # -- queues ----------------------------------------------------------------------------------

    def prepare_queue_arguments(self, arguments: dict[str, Any] | None,
                                **kwargs: Any) -> dict[str, Any]:
        """Queue options as AMQP arguments (``expires`` -> ``x-expires`` in ms, ``message_ttl``
        -> ``x-message-ttl``), stored with the queue and honoured by every process."""
        prepared: dict[str, Any] = to_rabbitmq_queue_arguments(arguments or {}, **kwargs)
        return prepared

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
        self.publisher.put(queue, message)

    # -- consume ---------------------------------------------------------------------------------

    def basic_consume(self, queue: str, no_ack: bool, callback: Any, consumer_tag: str,
                      **kwargs: Any) -> str:
        validate_queue_name(queue)
        self.consumer.listen()  # before the first claim, or a NOTIFY could fall in between
        result: str = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        self.consumer.lease.ensure(refresh=True)  # listed at once: x-expires must not hit it
        self.consumer.consume(self, queue, no_ack)
        return result

    def basic_qos(self, prefetch_size: int = 0, prefetch_count: int = 0,
                  apply_global: bool = False) -> None:
        super().basic_qos(prefetch_size, prefetch_count, apply_global)
        self.consumer.request_turn()  # Celery raises the count for tasks with an eta

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        self.consumer.cancel(self, queue)
        return result

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        message = super().basic_get(queue, no_ack, **kwargs)
        if message is not None and no_ack:
            self.consumer.ack_at_claim([message.delivery_tag])
        return message

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        """``basic_get``: claim one message now, or raise Empty."""
        validate_queue_name(queue)
        consumer = self.consumer.lease.ensure()
        self.store.promote([queue])
        for row in self.store.claim(queue, 1, consumer):
            payload = self.consumer.payload(row)
            if payload is not None:
                return payload
        raise virtual.Empty()

    def flush_acks(self) -> None:
        """Write the deferred acks now."""
        self.consumer.flush_acks(self)

    def basic_recover(self, requeue: bool = False) -> Any:
        if not requeue:
            raise NotImplementedError("pgbroker supports basic_recover(requeue=True) only")
        return self.qos.restore_unacked()

    def close(self) -> None:
        if not self.closed:
            try:
                self.consumer.give_back(self)
                self.flush_acks()
            except Exception as exc:  # noqa: BLE001 - redelivered after the lease, at worst
                logger.warning("pgbroker: %d ack(s) not written at close: %s",
                               len(self.claims.pending_acks), exc)
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
    default_port = 5432  # type: ignore[assignment]  # kombu's default, None, types it None
    driver_type = "postgresql"
    driver_name = "psycopg"
    # drain_events below waits on LISTEN, never sleeps blindly (kombu's 1.0 types it float)
    polling_interval = None  # type: ignore[assignment]

    implements = virtual.Transport.implements.extend(
        asynchronous=True,
        exchange_type=frozenset(["direct", "topic", "fanout"]),
        heartbeats=False,
    )

    connection_errors = virtual.Transport.connection_errors + _db.CONNECTION_ERRORS
    # (kombu's default, a 1-tuple, gives it that type)
    channel_errors = virtual.Transport.channel_errors + (ChannelError,)  # type: ignore[assignment]

    def __init__(self, client: Any, **kwargs: Any):
        super().__init__(client, **kwargs)
        self.settings = Settings.from_options(client.transport_options)
        _db.refuse_plus_alternates(list(getattr(client, "alt", None) or []))
        if _db.multi_host(client.hostname):
            # kombu's as_uri (Celery's banner) asks the transport for such a URL, not its parser
            self.can_parse_url = True
        self.conninfo = _db.kombu_conninfo(client)
        self.store = acquire(self.conninfo, self.settings)  # shared in the process
        self._holds_store = True
        #: LISTEN, claims, timers and the event loop of this connection's channels
        self.consumer = Consumer(self.store, self.settings, self.conninfo, self.channels,
                                 self.state, self._deliver, self.connection_errors)

    def as_uri(self, uri: str, include_password: bool = False, mask: str = "**") -> str:
        """How kombu shows a multi-host libpq URL (only asked for one: ``can_parse_url``)."""
        return _db.shown_url(uri, include_password, mask)

    @property
    def lease(self) -> Lease:
        return self.consumer.lease

    @property
    def in_flight(self) -> tuple[Any, str, int] | None:
        """The event loop's claim in flight: (channel, queue, how many were asked for)."""
        return self.consumer.in_flight

    def driver_version(self) -> str:
        return psycopg.__version__

    # -- connection ------------------------------------------------------------------------------

    def establish_connection(self) -> Transport:
        if not self._holds_store:  # closed, and connected again
            self.store, self._holds_store = acquire(self.conninfo, self.settings), True
        self.store.connect()  # really connects: a dead database is an error now, not later
        connection: Transport = super().establish_connection()
        return connection

    def close_connection(self, connection: Any) -> None:
        try:
            super().close_connection(connection)  # restores unacked deliveries first
        finally:
            self.consumer.close()
            if self._holds_store:
                self._holds_store = False
                release(self.store)

    def verify_connection(self, connection: Any) -> bool:
        return self.store.conn is not None

    # -- consuming: the worker's event loop, or drain_events (pgbroker._consume.consumer)
    # --------------

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        self.consumer.register(loop)

    # (the ignore: kombu's base Transport declares **kwargs; its virtual one, this signature)
    def drain_events(self, connection: Any, timeout: float | None = None,  # type: ignore[override]
                     ) -> None:
        self.consumer.drain(timeout)


def register_scheme() -> None:
    """Register the ``pgbroker`` URL scheme with kombu (done by ``import pgbroker``)."""
    TRANSPORT_ALIASES.setdefault("pgbroker", "pgbroker.transport:Transport")

