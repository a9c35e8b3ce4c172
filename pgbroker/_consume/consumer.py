"""The consuming side of one broker connection: LISTEN, claims, timers and hand-over.

:class:`Consumer` is to the kombu transport what kombu's ``MultiChannelPoller`` is to its Redis
transport, and River's ``producer.go`` to River: it owns the LISTEN connection (opened in
:meth:`Consumer.listen`, the one place to change for a reconnect), the event loop's statements
on it (:class:`pgbroker._consume.turn.LoopStatements`) and the claim in flight, the wake pipe and
the timers, the ready queue of ``drain_events``, the consumer's lease, and the updates that met
another session's row lock. Each channel's claims follow one :class:`ClaimPolicy`, in the worker's
event loop (:meth:`Consumer.register`) and in ``drain_events`` (:meth:`Consumer.drain`) alike
(:mod:`pgbroker._consume.claim_policy`). ``Channel`` and ``QoS`` (:mod:`pgbroker.transport`) only
call it.

Connections: two per process, the shared store's (:mod:`pgbroker._pg.process_store`: publishes,
acks outside the loop, the lease) and the LISTEN one, which carries the event loop's claims.

What it reads of a channel: ``queues`` (the consumed ones), ``claims`` (its policy, deferred
acks and no_ack queues, which only the Consumer changes) and ``qos`` (kombu's prefetch count and
delivered tags; a delivery its consumer failed on is refused there). It calls nothing else of
a channel's: the channel asks, the Consumer does.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from collections.abc import Callable
from time import monotonic
from typing import Any

import psycopg

from .._model.claimed import Claimed, Delivery, JobRow, parse_wake
from .._model.message import parse_delivery_tag
from .._model.routing import matches
from .._pg import driver as _db
from .._pg.store import Store
from ..settings import Settings
from .claim_policy import ClaimPolicy
from .delivery import Broadcasts, broadcast_payload, row_payload
from .lease import Lease
from .promotion import Promotion
from .settle import RETRY as SETTLE_RETRY
from .settle import Settler
from .timer import Timer
from .turn import LoopStatements

__all__ = ["Consumer"]

logger = logging.getLogger(__name__)

class Consumer:
    """LISTEN, claims and deliveries of one kombu transport (see the module docstring).

    Three kinds of thread call it. **loop**: the worker's event loop (Celery's hub) -- register,
    the reader callbacks (``_on_wake``, ``_on_readable``), the timers, and the acks Celery makes
    there (a prefork worker acks in its main process's loop). **drain**: the thread in
    ``drain_events`` (a plain kombu consumer) and the callbacks it runs. **any**: the lease's
    heartbeat thread (``request_turn`` after a rescue), a thread that acks outside the loop,
    the one that closes the connection. Which touches what:

    ==========================================  ==============  ===============================
    state                                       written by      why no lock
    ==========================================  ==============  ===============================
    ``_listener``, ``line``, ``in_flight``      loop (else      one thread uses the LISTEN
                                                drain)          connection: the loop in a
                                                                worker, else the drain thread
    ``_loop``, ``_wake``, ``_poll_entry``,      loop (else      set at register, cleared at
    the ``_timers`` (``_promotion``'s,          drain)          close; the other threads only
    ``_held``, ``_settle_timer``),                              read ``_loop``/``_wake`` (is
    ``_promotion``, ``_last_poll``                              there a loop to wake?)
    ``_turn_requested``                         any (True),     a request that sees True skips
                                                loop (False)    its byte only while one is in
                                                                the pipe; the loop clears the
                                                                flag after draining the pipe
                                                                and before its turn, which then
                                                                sees that request's state
    ``_ready``, ``_credit``, ``_draining``      drain           the synchronous path only (a
                                                                deque's append and pop are
                                                                atomic)
    ``_settler`` (its ``pending``)              any             ``settle_rows`` from any acking
                                                                thread; ``retry`` swaps the
                                                                list before it walks it
    ``_lease``                                  first caller    made once; its heartbeat thread
                                                                has its own lock
    ``_broadcasts``                             loop or drain   one path per connection
    a channel's ``claims`` (cursor, deferred    loop or drain   acks are deferred only in the
    acks; ``no_ack`` queues: the thread                         loop or by the drain thread
    that calls ``consume``/``cancel``)                          itself (:attr:`defer_acks`)
    ==========================================  ==============  ===============================
    """

    def __init__(self, store: Store, settings: Settings, conninfo: str, channels: list[Any],
                 state: Any, deliver: Callable[[dict[str, Any], str], None],
                 connection_errors: tuple[type[BaseException], ...]):
        self.store = store
        self.settings = settings
        self.conninfo = conninfo
        self.channels = channels  # the transport's list of channels (kombu keeps it)
        self._state = state       # kombu's BrokerState: the bindings this process declared
        self._deliver = deliver   # kombu's hand-over to the consumer callback of a queue
        self._connection_errors = connection_errors  # the transport's: never a job's fault
        self._lease: Lease | None = None
        self._listener: psycopg.Connection[Any] | None = None
        #: the event loop's claims and acks, sent on the LISTEN connection without waiting
        self.line: LoopStatements | None = None
        #: the claim in flight on it: (channel, queue, how many were asked for)
        self.in_flight: tuple[Any, str, int] | None = None
        self._loop: Any = None
        self._poll_entry: Any = None  # the loop's repeated poll
        #: scheduled jobs made pending when due, on its timer
        self._promotion = Promotion(store, self.queues, self._promoted, self.wake_at)
        self._wake: tuple[int, int] | None = None  # self-pipe waking the event loop for a turn
        self._turn_requested = False
        self._last_poll = monotonic()
        #: the thread handing over a message in drain_events (its acks are deferred)
        self._draining: int | None = None
        #: claimed or broadcast messages waiting for drain_events (synchronous path only)
        self._ready: collections.deque[tuple[Any, dict[str, Any], str]] = collections.deque()
        #: drain_events calls that return at once, having delivered a batch (see drain)
        self._credit = 0
        self._settler = Settler(store)  # what met another session's row lock
        self._settle_timer = Timer(self._retry_unsettled)  # updates that met a row lock
        self._held = Timer(self._on_wake_due)  # wake-ups a channel held back (ClaimPolicy.wake)
        self._timers = (self._promotion.timer, self._held, self._settle_timer)  # both paths
        self._broadcasts = Broadcasts(store)  # each delivered here once

    # -- connections: the LISTEN one and the lease's -----------------------------------------

    @property
    def lease(self) -> Lease:
        """The consumer's registration and heartbeats, made when first asked (not by producers)."""
        if self._lease is None:  # (its store's reconnect: a turn checks the LISTEN connection)
            self._lease = Lease(self.store, self.queues, self.request_turn)
            self._lease.settle_status = self._settler.status
        return self._lease

    @property
    def leased(self) -> bool:
        return self._lease is not None

    def listen(self) -> psycopg.Connection[Any]:
        """The LISTEN connection, (re)opened if it is gone or was inherited through fork; the
        event loop's statements run on it too, so a new one starts them afresh."""
        if not _db.owned(self._listener) and self.settings.transaction_pooling:
            # poll-only: a LISTEN through the pooler stays on a server session not ours
            self._listener = _db.connect(self.conninfo,
                                         connect_timeout=self.settings.connect_timeout,
                                         application_name="pgbroker loop")
            self.line, self.in_flight = None, None
        if not _db.owned(self._listener):
            self._listener = _db.listen(self.conninfo, self.settings.channel,
                                        connect_timeout=self.settings.connect_timeout,
                                        application_name="pgbroker listen")
            self.line, self.in_flight = None, None
            for channel in self.channels:  # what was notified meanwhile was not heard
                channel.claims.rescan()
        assert self._listener is not None
        return self._listener

    def queues(self) -> list[str]:
        """Every queue consumed through this connection, sorted."""
        return sorted({q for ch in self.channels for q in ch.queues})

    def close(self) -> None:
        """The connection closes: leave the event loop, unregister, a last try at the updates
        that wait for a row lock, close the LISTEN connection and the wake pipe."""
        self._unregister_loop()
        if self._lease is not None:
            self._lease.close()
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
        self.line, self.in_flight = None, None
        if self._wake is not None:
            for fd in self._wake:
                os.close(fd)
            self._wake = None

    # -- what channels and QoS call ----------------------------------------------------------

    def consume(self, channel: Any, queue: str, no_ack: bool) -> None:
        """``channel`` started consuming ``queue`` (LISTEN and the lease are up already);
        ``no_ack``: its deliveries are done once handed over (:meth:`ack_at_claim`)."""
        if no_ack:
            channel.claims.no_ack.add(queue)
        channel.claims.more = True
        self._credit = 0
        self.request_turn()
        self._promotion.consumed(queue)

    def cancel(self, channel: Any, queue: str | None) -> None:
        """A consumer of ``channel`` stopped (kombu forgot it already): ``drain``'s next empty
        call waits again; a queue no longer consumed is no longer no_ack, and the lease lists
        the queues left."""
        self._credit = 0
        if queue is not None and queue not in channel.queues:
            channel.claims.no_ack.discard(queue)
            if self.leased:
                self.lease.ensure(refresh=True)

    def ack_at_claim(self, tags: list[str]) -> None:
        """no_ack consumers never ack: their deliveries are complete once handed over."""
        deliveries = [d for d in map(parse_delivery_tag, tags) if d is not None]
        for delete in (True, False):
            batch = [d[:2] for d in deliveries if (d[2] or self.settings.retention == 0) == delete]
            if batch:
                self.settle_rows("ack_delete" if delete else "ack", batch)

    @property
    def defer_acks(self) -> bool:
        """Acks wait: for the end of the event-loop turn inside a worker's event loop; on the
        synchronous path, for the last message of the claimed batch to be handed over (acks
        made from the callbacks of ``drain`` in its own thread only)."""
        return self._loop is not None or self._draining == threading.get_ident()

    def defer_ack(self, channel: Any, delivery: Delivery) -> None:
        """In the worker's event loop: sent with the next claim, or at the end of this loop turn
        at the latest. A crash before that only means a redelivery."""
        channel.claims.pending_acks.append(delivery)
        self.request_turn()

    def flush_acks(self, channel: Any) -> None:
        """Write ``channel``'s deferred acks now."""
        self.settle()
        acks = channel.claims.take_acks()
        if acks:
            self.settle_rows("ack", acks)

    def settle_rows(self, op: str, deliveries: list[Delivery], error: str | None = None) -> None:
        """``op`` ("ack", "ack_delete", "requeue" or "bury") on these deliveries now; those
        whose row another session holds locked are done again a second later."""
        self._settler(op, deliveries, error)
        self._arm_settle()

    def settle_later(self, op: str, deliveries: list[Delivery]) -> None:
        self._settler.keep(op, deliveries)
        self._arm_settle()

    def _arm_settle(self) -> None:
        if self._settler.pending:
            self._settle_timer.at_latest(monotonic() + SETTLE_RETRY)

    def _retry_unsettled(self) -> None:
        self._settler.retry()
        self._arm_settle()

    def settle(self) -> None:
        """Wait for the statement in flight (closing, restoring): what it claimed goes back."""
        if self.line is None or not self.line.busy:
            return
        claim, self.in_flight = self.in_flight, None
        rows = self.line.result(wait=True)
        self.settle_later("ack", self.line.take_locked())
        if rows and claim is not None:
            self.settle_rows("requeue", [(row.id, row.attempt) for row in rows],
                             "restored unacked")

    def hand_over(self, channel: Any, payload: dict[str, Any], queue: str) -> None:
        """Deliver now in the worker's event loop; on the synchronous path, keep it for drain."""
        if self._loop is not None:
            self._deliver(payload, queue)
        else:
            self._ready.append((channel, payload, queue))

    def give_back(self, channel: Any) -> None:
        """Requeue what ``channel`` claimed but has not handed over yet (it is closing)."""
        kept = [item for item in self._ready if item[0] is not channel]
        mine = [it[1]["properties"]["delivery_tag"] for it in self._ready if it[0] is channel]
        self._ready.clear()
        self._ready.extend(kept)
        deliveries = [d[:2] for d in map(parse_delivery_tag, mine) if d is not None and not d[2]]
        if deliveries:
            self.settle_rows("requeue", deliveries, "restored unacked")

    def hand_over_rows(self, channel: Any, queue: str, rows: list[JobRow]) -> int:
        """Hand claimed rows to ``channel``'s consumer of ``queue``; returns how many it took.
        A row the consumer's own code fails on before running it (Celery raised, for a protocol-2
        body that is not ``[args, kwargs, embed]``, and its worker exited) goes dead with the
        cause, alone: the rest of the batch is handed over, and no other worker is crashed by a
        redelivery of it."""
        handed = []
        for row in rows:
            payload = self.payload(row)
            if payload is None:
                continue
            tag = payload["properties"]["delivery_tag"]
            try:
                self.hand_over(channel, payload, row.queue)
            except self._connection_errors:
                raise
            except Exception as exc:  # see above
                reason = (f"the consumer failed on it before running it: "
                          f"{type(exc).__name__}: {exc}")
                logger.error("pgbroker: job %s goes dead: %s", row.id, reason, exc_info=True)
                channel.qos.refuse(tag, (row.id, row.attempt), reason)
                continue
            handed.append(tag)
        if handed and queue in channel.claims.no_ack:
            self.ack_at_claim(handed)
        return len(handed)

    def payload(self, row: JobRow) -> dict[str, Any] | None:
        """The kombu payload of a claimed row; a row that cannot be one goes dead, with why."""
        try:
            return row_payload(row)
        except Exception as exc:  # noqa: BLE001 - any malformed row must not stop the consumer
            logger.error("pgbroker: job %s is malformed and goes dead: %s", row.id, exc)
            self.settle_rows("bury", [(row.id, row.attempt)],
                             f"malformed job row: {type(exc).__name__}: {exc}")
            return None

    # -- claims: one policy, two paths -------------------------------------------------------

    def claim_now(self, channel: Any) -> int:
        """Synchronous path (``drain``): a whole round of the policy at once, claiming what the
        free prefetch slots allow and handing it over, the deferred acks folded in."""
        queues = channel.queues
        if not queues or not channel.qos.can_consume():
            self.flush_acks(channel)
            return 0
        policy: ClaimPolicy = channel.claims
        limit = policy.batch(channel.qos)
        consumer = self.lease.ensure()
        delivered, full = 0, False
        for queue in policy.round(queues):
            want = limit - delivered
            locked: list[Delivery] = []
            try:
                rows = policy.took(queue, self.store.claim(
                    queue, want, consumer, policy.take_acks(), locked, policy.gated(queue),
                    policy.start(queue)), want)
            except psycopg.Error as exc:  # (its acks are in locked: see Store.claim)
                if _db.lost_connection(exc):
                    raise
                self.settle_later("ack", locked)
                self.wake_at(policy.failed(exc))
                return delivered
            self.settle_later("ack", locked)
            full = full or len(rows) >= want
            delivered += self.hand_over_rows(channel, queue, rows)
            if delivered >= limit:
                break
        policy.claimed(delivered > 0, full)
        policy.more = full  # the round is over: only a full batch says more is waiting
        return delivered

    def _send_claim(self, channel: Any, line: LoopStatements) -> bool:
        """Event loop: send the claim of the policy's next queue, with the deferred acks,
        without waiting for it (:meth:`_take_result` gets its rows). False: no free slot."""
        if not channel.qos.can_consume():
            return False
        policy: ClaimPolicy = channel.claims
        queue = policy.next_queue(channel.queues)
        want = policy.batch(channel.qos)
        line.send_claim(queue, want, self.lease.ensure(), policy.take_acks(), policy.gated(queue),
                        policy.start(queue))
        self.in_flight = (channel, queue, want)
        return True

    def _claimed(self, channel: Any, queue: str, want: int,
                 rows: Claimed | list[JobRow]) -> None:  # a plain list: a claim that failed
        """Hand over the rows of a claim sent by :meth:`_send_claim`."""
        self.hand_over_rows(channel, queue, channel.claims.took(queue, rows, want))
        channel.claims.claimed(bool(rows), len(rows) >= want)

    def _wake_channel(self, channel: Any) -> None:
        if not channel.claims.wake():
            self.wake_at(channel.claims.quiet_until)

    # -- notifications and broadcasts --------------------------------------------------------

    def _read_notifications(self, read: bool = True) -> int:
        """Drain pending NOTIFYs (``read=False``: those in libpq's buffer only): mark the channels
        consuming those queues, arm due timers, deliver broadcasts; how many broadcasts."""
        with _db.translate_errors("reading notifications"):
            payloads = _db.notifications(self.listen(), read=read)
        delivered = 0
        for payload in payloads:
            kind, _, rest = payload.partition(" ")
            if kind == "b":
                broadcast_id, _, exchange = rest.partition(" ")
                delivered += self._deliver_broadcast(broadcast_id, exchange)
                continue
            if (woken := parse_wake(kind)) is None:
                continue
            delay, place = woken
            for channel in self.channels:
                if rest in channel.queues:
                    if delay <= 0:
                        channel.claims.lower(rest, place)
                        self._wake_channel(channel)
                    else:
                        self._promotion.notified(place[1])
        return delivered

    def _deliver_broadcast(self, broadcast_id: str, exchange: str) -> int:
        """Hand a broadcast to this process's consumed queues bound to ``exchange``, once: any
        role that can connect can replay its NOTIFY, or name another exchange in it."""
        bound = [(channel, queue, key) for channel in self.channels
                 for queue in channel.queues
                 for ex, key, _ in self._state.queue_bindings(queue) if ex == exchange]
        if not bound or self._broadcasts.seen(broadcast_id):
            return 0
        row = self._broadcasts.read(broadcast_id, exchange)
        if row is None:
            return 0
        routing_key, queues = row[1], row[7]
        kind = self._state.exchanges.get(exchange, {}).get("type", "fanout")
        delivered = 0
        for n, (channel, queue, key) in enumerate(bound):
            # (a fanout's broadcast is for its auto-delete queues: the others got a job)
            if (queues is None or queue in queues) and matches(kind, key, routing_key):
                self.hand_over(channel, broadcast_payload(row, broadcast_id, n), queue)
                delivered += 1
        return delivered

    # -- timers: held wake-ups, due jobs, the poll -------------------------------------------

    def wake_at(self, at: float) -> None:
        """Wake the channels that held back a wake-up (ClaimPolicy.wake) at ``at`` (monotonic)."""
        self._held.at_latest(at)

    def _on_wake_due(self) -> None:
        for channel in self.channels:
            if channel.claims.held_wake and channel.queues:
                self._wake_channel(channel)
        self.request_turn()

    def _promoted(self) -> None:
        for channel in self.channels:
            channel.claims.more = True
        self.request_turn()

    def _poll(self) -> None:
        """The fallback for lost notifications (claim anyway, check due jobs) and readable events
        (a finished result in libpq's buffer: no claim goes out before it is taken)."""
        self._last_poll = monotonic()
        self._take_result()
        for channel in self.channels:
            channel.claims.polled(notified=not self.settings.transaction_pooling)
        self._promotion.poll()
        self.request_turn()

    # -- the event loop (Celery worker) ------------------------------------------------------

    def register(self, loop: Any) -> None:
        """Run inside ``loop`` (kombu's hub): its readers are the LISTEN socket and the wake
        pipe, its timers the poll, due jobs, held wake-ups and settle retries."""
        self._unregister_loop()
        self._loop = loop
        listener = self.listen()
        if self.line is None:
            self.line = LoopStatements(listener, self.settings)
        loop.add_reader(listener.fileno(), self._on_readable)
        if self._wake is None:
            self._wake = os.pipe()
            for fd in self._wake:
                os.set_blocking(fd, False)
        loop.add_reader(self._wake[0], self._on_wake)
        self._poll_entry = loop.call_repeatedly(self.settings.poll_interval, self._poll)
        for timer in self._timers:
            timer.attach(loop)
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
                self.flush_acks(channel)
            except Exception as exc:  # noqa: BLE001 - redelivered after the lease, at worst
                logger.warning("pgbroker: acks not written: %s", exc)
        if self._poll_entry is not None:
            self._poll_entry.cancel()
            self._poll_entry = None
        for timer in self._timers:
            timer.detach()
        fds = [self._wake[0]] if self._wake else []
        if self._listener is not None and not self._listener.closed:
            fds.append(self._listener.fileno())
        for fd in fds:
            try:
                loop.remove_reader(fd)
            except Exception:  # noqa: BLE001 - the hub may already be reset
                pass

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
        # a NOTIFY behind a result, parsed as the result was taken; not a read of the socket,
        # which could take an unfinished result's last bytes and leave the socket quiet
        self._read_notifications(read=False)
        self._turn()

    def _take_result(self) -> None:
        """Hand over the rows of the claim in flight, if it has finished."""
        if self.line is None:
            return
        failure = None
        try:
            rows = self.line.result()
        except psycopg.Error as exc:  # a claim that failed on a living connection: wait
            if _db.lost_connection(exc) or self.in_flight is None:
                raise
            rows, failure = [], exc
        if rows is None:
            return
        self.settle_later("ack", self.line.take_locked())
        claim, self.in_flight = self.in_flight, None
        if claim is not None:
            channel, queue, want = claim
            self._claimed(channel, queue, want, rows)
            if failure is not None:
                self.wake_at(channel.claims.failed(failure))

    def _turn(self) -> None:
        """One turn of the event loop: send a claim (with the deferred acks) for a channel that
        may find something, or else the acks alone; never wait for it. With a statement in
        flight, its result starts the next turn."""
        _db.ensure_current(self._listener, "the LISTEN connection")  # (after a failover)
        self._promotion.refresh()
        line = self.line
        if line is None or line.busy:
            return
        for channel in self.channels:
            if channel.claims.may_find(channel.queues) and self._send_claim(channel, line):
                return
        acks = [ack for channel in self.channels for ack in channel.claims.take_acks()]
        if acks:
            line.send_ack(acks)

    # -- the synchronous path (plain kombu consumers, celery inspect clients) ----------------

    def drain(self, timeout: float | None = None) -> None:
        """Deliver everything one claim returned (and the broadcasts read meanwhile), highest
        priority first, then return; or wait for a notification, a due time or the poll.

        kombu's Mailbox (``celery inspect``/``control`` with a limit of replies) counts replies
        by calls: after a call that delivered n messages, the next n - 1 calls that find
        nothing to deliver return at once instead of waiting, so it does not wait its timeout
        for replies it already has. A new or cancelled consumer starts the count again.
        """
        deadline = None if timeout is None else monotonic() + timeout
        while True:
            self._settle_timer.fire_if_due(monotonic())  # acks that met a lock, before claims
            if not self._ready:
                for channel in list(self.channels):
                    if channel.claims.more and channel.queues:
                        self.claim_now(channel)
            if self._ready:
                self._deliver_ready()
                return
            if self._credit:
                self._credit -= 1
                return
            self._promotion.refresh()
            now = monotonic()
            if any(timer.fire_if_due(now) for timer in self._timers):
                continue
            if now - self._last_poll >= self.settings.poll_interval:
                self._poll()
                continue
            wait = self._last_poll + self.settings.poll_interval - now
            for at in (timer.at for timer in self._timers):
                if at is not None:
                    wait = min(wait, at - now)
            if deadline is not None:
                if now >= deadline:
                    raise TimeoutError()
                wait = min(wait, deadline - now)
            if _db.wait_readable(self.listen().fileno(), max(wait, 0)):
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
                self.flush_acks(channel)

