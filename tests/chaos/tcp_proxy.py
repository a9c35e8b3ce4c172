"""A small TCP proxy on 127.0.0.1 that the chaos tests put between a worker and PostgreSQL.

``pause()`` stops forwarding in both directions while every socket stays open: the peer's kernel
still acknowledges every packet, so to the client this is a server (or a middlebox) that hangs,
not a broken network -- TCP keepalives and ``tcp_user_timeout`` cannot see it. ``resume()``
forwards again (bytes that arrived meanwhile are delivered, in order); ``cut()`` closes every
forwarded connection at once (the client sees a reset).

A real network partition (packets dropped, nothing acknowledged) needs the kernel: run the proxy
in a network namespace of its own (``python -m tests.chaos.tcp_proxy --own-loopback`` under
``unshare --net``) and take that namespace's loopback down; see
``tests/chaos/test_network_faults.py``.

Command line (one proxy per process; prints ``<port>`` on stdout once it listens)::

    python -m tests.chaos.tcp_proxy UPSTREAM [--own-loopback]

``UPSTREAM`` is ``host:port`` or ``unix:/path/to/.s.PGSQL.5432``. Signals: SIGUSR1 pauses,
SIGUSR2 resumes, SIGHUP cuts, SIGTERM stops.
"""

from __future__ import annotations

import argparse
import contextlib
import selectors
import signal
import socket
import subprocess
import sys
import threading

__all__ = ["TcpProxy", "Upstream", "parse_upstream"]

#: ``("host", port)`` for TCP, or the path of a unix socket.
Upstream = tuple[str, int] | str


def parse_upstream(text: str) -> Upstream:
    """``host:port`` -> ``("host", port)``; ``unix:/path`` -> ``"/path"``."""
    if text.startswith("unix:"):
        return text[len("unix:"):]
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


class TcpProxy:
    """Forwards every connection accepted on ``127.0.0.1:<port>`` to ``upstream``.

    One thread runs a selector over the listening socket and every forwarded pair; ``pause``,
    ``resume`` and ``cut`` may be called from any thread (or a signal handler)."""

    def __init__(self, upstream: Upstream, host: str = "127.0.0.1", port: int = 0):
        self.upstream = upstream
        self._listener = socket.create_server((host, port))
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._peers: dict[socket.socket, socket.socket] = {}
        self._paused = threading.Event()
        self._running = threading.Event()
        self._cut_requested = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name=f"tcp-proxy-{self.port}",
                                        daemon=True)
        #: connections accepted so far (a reconnecting client shows up here)
        self.accepted = 0

    def __enter__(self) -> TcpProxy:  # Python 3.10 has no typing.Self
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> TcpProxy:
        self._running.set()
        self._thread.start()
        return self

    @property
    def paused(self) -> bool:
        return self._paused.is_set()

    def pause(self) -> None:
        """Stop forwarding (sockets stay open, the kernel keeps acknowledging)."""
        self._paused.set()
        self._wake()

    def resume(self) -> None:
        """Forward again."""
        self._paused.clear()
        self._wake()

    def cut(self) -> None:
        """Close every forwarded connection (new ones are still accepted)."""
        self._cut_requested.set()
        self._wake()

    def close(self) -> None:
        """Stop the proxy and close every socket."""
        self._running.clear()
        self._wake()
        if self._thread.is_alive():
            self._thread.join(5)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _connect_upstream(self) -> socket.socket:
        if isinstance(self.upstream, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(self.upstream)
            return sock
        return socket.create_connection(self.upstream, timeout=10)

    def _accept(self) -> None:
        client, _ = self._listener.accept()
        try:
            server = self._connect_upstream()
        except OSError:
            client.close()
            return
        server.settimeout(None)
        self.accepted += 1
        self._peers[client] = server
        self._peers[server] = client
        if not self.paused:
            for sock in (client, server):
                self._selector.register(sock, selectors.EVENT_READ)

    def _close_pair(self, sock: socket.socket) -> None:
        peer = self._peers.pop(sock, None)
        for s in (sock, peer):
            if s is None:
                continue
            self._peers.pop(s, None)
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(s)
            with contextlib.suppress(OSError):
                s.close()

    def _set_forwarding(self, on: bool) -> None:
        """(Un)register the forwarded sockets: a paused proxy must not spin on readable ones."""
        for sock in list(self._peers):
            registered = sock in self._selector.get_map()
            if on and not registered:
                self._selector.register(sock, selectors.EVENT_READ)
            elif not on and registered:
                self._selector.unregister(sock)

    def _run(self) -> None:
        forwarding = True
        try:
            while self._running.is_set():
                if self._cut_requested.is_set():
                    self._cut_requested.clear()
                    for sock in list(self._peers):
                        self._close_pair(sock)
                if forwarding == self.paused:
                    forwarding = not self.paused
                    self._set_forwarding(forwarding)
                for key, _ in self._selector.select(timeout=0.5):
                    sock = key.fileobj
                    if sock is self._wake_r:
                        self._wake_r.recv(4096)
                    elif sock is self._listener:
                        self._accept()
                    elif sock in self._peers and not self.paused:
                        self._forward(sock)  # type: ignore[arg-type]
        finally:
            for sock in list(self._peers):
                self._close_pair(sock)
            for s in (self._listener, self._wake_r, self._wake_w):
                with contextlib.suppress(OSError):
                    s.close()
            self._selector.close()

    def _forward(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(65536)
            if data:
                self._peers[sock].sendall(data)
                return
        except OSError:
            pass
        self._close_pair(sock)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("upstream", help="host:port or unix:/path")
    parser.add_argument("--own-loopback", action="store_true",
                        help="bring this network namespace's loopback up first (after unshare)")
    args = parser.parse_args(argv)
    if args.own_loopback:
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    proxy = TcpProxy(parse_upstream(args.upstream)).start()
    stop = threading.Event()
    signal.signal(signal.SIGUSR1, lambda *_: proxy.pause())
    signal.signal(signal.SIGUSR2, lambda *_: proxy.resume())
    signal.signal(signal.SIGHUP, lambda *_: proxy.cut())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    print(proxy.port, flush=True)
    while not stop.wait(0.5):
        pass
    proxy.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
