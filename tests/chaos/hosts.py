"""Worker hosts: network namespaces with addresses of their own, linked to this machine by veth.

The partition test (``test_network_faults.py``) puts a proxy alone in an unnamed namespace; the
many-host scenarios need several *hosts*: each :class:`Host` is a named network namespace
(``ip netns add``) with one end of a veth pair, ``10.<net>.<i>.2/24`` inside and
``10.<net>.<i>.1/24`` on this machine's side, where PostgreSQL listens (start the server with
``listen=",".join(h.gateway for h in hosts)`` plus 127.0.0.1). A worker started with
:meth:`Host.start_worker` reaches the database only through its link; :meth:`Host.cut` takes the
link down on this machine's side (packets dropped, as a failed switch port or a partition does)
and :meth:`Host.heal` brings it back.

Needs root and ``ip`` (iproute2); :data:`needs_hosts` skips otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.support import processes as helpers
from tests.support.processes import WorkerProcess

__all__ = ["Host", "hosts", "needs_hosts"]

needs_hosts = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="worker hosts need root and ip (network namespaces joined by veth pairs)")

#: The second octet of this process's addresses: 10.<net>.<host>.<1|2>.
_NET = 200 + os.getpid() % 50


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class Host:
    """One network namespace with its own address (see the module docstring)."""

    def __init__(self, index: int):
        self.index = index
        tag = f"{os.getpid() % 100000}{index}"
        self.netns = f"pgbh{tag}"
        self.outer = f"pgbo{tag}"   # this machine's end of the veth pair
        self.inner = f"pgbi{tag}"
        self.gateway = f"10.{_NET}.{index}.1"  # this machine, as the host sees it
        self.address = f"10.{_NET}.{index}.2"
        _ip("netns", "add", self.netns)
        _ip("link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
        _ip("link", "set", self.inner, "netns", self.netns)
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.outer)
        _ip("link", "set", self.outer, "up")
        for args in (("addr", "add", f"{self.address}/24", "dev", self.inner),
                     ("link", "set", self.inner, "up"), ("link", "set", "lo", "up")):
            _ip("netns", "exec", self.netns, "ip", *args)

    def __repr__(self) -> str:
        return f"<Host {self.netns} {self.address}>"

    def enter(self) -> list[str]:
        """The argv prefix that runs a command on this host."""
        return ["ip", "netns", "exec", self.netns]

    def start_worker(self, broker_url: str, *args: str, options: dict[str, object] | None = None,
                     app: str = "tests.e2e.app") -> WorkerProcess:
        """A ``celery worker`` of ``app`` on this host, named ``host<i>-...@%h``."""
        name = f"host{self.index}-{time.monotonic_ns()}"
        env = {"PGBROKER_TEST_TRANSPORT_OPTIONS": json.dumps(options or {})}
        argv = self.enter() + [sys.executable, "-m", "celery", "-A", app, "worker",
                               "-P", "prefork", "--loglevel=INFO", "-n", f"{name}@%h", *args]
        # tests.helpers builds the environment and log path of every worker; reused as is
        return WorkerProcess(argv, helpers._env(broker_url, env),
                             helpers._log_path(None, name), name).wait_ready(90)

    def cut(self) -> None:
        """Take the link down on this machine's side: the host's packets go nowhere."""
        _ip("link", "set", self.outer, "down")

    def heal(self) -> None:
        _ip("link", "set", self.outer, "up")

    def close(self) -> None:
        for args in (("link", "del", self.outer), ("netns", "del", self.netns)):
            subprocess.run(["ip", *args], capture_output=True, timeout=30, check=False)


@contextmanager
def hosts(count: int) -> Iterator[list[Host]]:
    """``count`` :class:`Host` s, removed on exit."""
    made: list[Host] = []
    try:
        for index in range(1, count + 1):
            made.append(Host(index))
        yield made
    finally:
        for host in made:
            host.close()
