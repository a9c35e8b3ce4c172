"""Worker hosts: network namespaces with addresses of their own, linked to this machine by veth.

The partition test (``test_network_faults.py``) puts a proxy alone in an unnamed namespace; the
many-host scenarios need several *hosts*: each :class:`Host` is a named network namespace
(``ip netns add``) with one end of a veth pair, ``10.<net>.<i>.2/24`` inside and
``10.<net>.<i>.1/24`` on this machine's side, where PostgreSQL listens (start the server with
``listen=",".join(h.gateway for h in hosts)`` plus 127.0.0.1). A worker started with
:meth:`Host.start_worker` reaches the database only through its link; :meth:`Host.cut` takes the
link down on this machine's side (packets dropped, as a failed switch port or a partition does)
and :meth:`Host.heal` brings it back.

A second server can listen on another address of this machine on the same link
(:meth:`Host.add_gateway`), and one address alone can be black-holed (:meth:`Host.black_hole`):
netfilter drops every packet between the host and it, in both directions, where each packet
*arrives*, so that neither sender hears of it (no RST, no ICMP, no local "dropped" error) -- what a
client meets when a cloud failover moves a server's address away or a zone goes dark. The
link-down cut is coarser: every address at once, and the host's kernel is told of each packet
it could not hand to the link.

Needs root and ``ip`` (iproute2); :data:`needs_hosts` skips otherwise; a black hole needs
``iptables`` as well (Debian's package of that name; nf_tables or legacy), :data:`needs_iptables`.
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

__all__ = ["Host", "hosts", "needs_hosts", "needs_iptables"]

needs_hosts = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="worker hosts need root and ip (network namespaces joined by veth pairs)")


def _iptables_works() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("iptables") is None:
        return False
    done = subprocess.run(["iptables", "-S", "INPUT"], capture_output=True, timeout=30,
                          check=False)
    return done.returncode == 0


needs_iptables = pytest.mark.skipif(
    not _iptables_works(),
    reason="a black-holed address needs root, ip and a working iptables (apt-get install "
           "iptables; the kernel's netfilter): its packets are dropped where they arrive")

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
        self.gateways = [self.gateway]  # every address of this machine on the link
        self._holes: set[str] = set()  # black-holed addresses (see black_hole)
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
                     app: str = "tests.apps.e2e_app") -> WorkerProcess:
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

    def add_gateway(self) -> str:
        """Another address of this machine on the host's link (``10.<net>.<i>.3``, ``.4``...),
        for a second server to listen on; the host reaches it through the same link."""
        address = f"10.{_NET}.{self.index}.{len(self.gateways) + 2}"
        _ip("addr", "add", f"{address}/32", "dev", self.outer)
        self.gateways.append(address)
        return address

    def _holes_op(self, address: str, op: str, check: bool) -> None:
        """``iptables <op>`` (``-I``: insert, ``-D``: delete) of the black hole's two rules: this
        machine drops what the host sends to ``address``, the host drops what comes from it --
        both in INPUT, where the packet arrives, so that no sender is told."""
        for rule in (["iptables", "-w", op, "INPUT", "-i", self.outer, "-d", address],
                     self.enter() + ["iptables", "-w", op, "INPUT", "-s", address]):
            subprocess.run([*rule, "-j", "DROP"], check=check, capture_output=True, timeout=30)

    def black_hole(self, address: str) -> None:
        """Drop every packet between this host and ``address`` (one of :attr:`gateways`), both
        ways, silently (see the module docstring); the host's other addresses stay reachable.
        Needs :data:`needs_iptables`."""
        self._holes.add(address)
        self._holes_op(address, "-I", check=True)

    def dropped(self, address: str) -> int:
        """Packets of this host that :meth:`black_hole` has dropped on their way to
        ``address`` (its rule's counter on this machine): 0 while nothing tried to reach it."""
        listing = subprocess.run(["iptables", "-w", "-L", "INPUT", "-v", "-x", "-n"],
                                 check=True, capture_output=True, text=True, timeout=30).stdout
        for line in listing.splitlines():
            # pkts bytes target prot opt in out source destination
            fields = line.split()
            if fields[2:3] == ["DROP"] and self.outer in fields and fields[-1] == address:
                return int(fields[0])
        raise AssertionError(f"no black hole of {address} on {self.outer}:\n{listing}")

    def restore(self, address: str) -> None:
        """Take :meth:`black_hole` 's rules away again."""
        self._holes.discard(address)
        self._holes_op(address, "-D", check=False)

    def close(self) -> None:
        for address in list(self._holes):  # this machine's rules outlive the link otherwise
            self.restore(address)
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
