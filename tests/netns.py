"""Hosts with a network of their own for tests: Linux network namespaces joined to this one.

:func:`hosts` creates network namespaces (``ip netns add``), each joined to the test's own
namespace by a veth pair on a /30 of its own (``outer_ip`` on this side, ``inner_ip``
inside), with ``lo`` up, and removes them afterwards. A process runs "on" a host under
:attr:`NetHost.prefix` (``ip netns exec NAME``): it shares the file system, the pids and
the Unix sockets of the test, only its network is the host's. :meth:`NetHost.cut` is a
partition (this side of the veth down: the host's packets vanish with no reset or error,
as behind a dead switch, and its open TCP connections are left half-open);
:meth:`NetHost.restore` joins it again. Needs root and ``ip`` (iproute2):
:func:`unavailable` says why they cannot be made here, for a skip.
"""

from __future__ import annotations

import ipaddress
import os
import random
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

IP = shutil.which("ip") or "/usr/sbin/ip"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([IP, *args], capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} -> {result.returncode}: {result.stderr}")
    return result


def unavailable() -> str | None:
    """Why network namespaces cannot be created here, or None when they can."""
    if not Path(IP).exists():
        return f"{IP} (iproute2) not found"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"chdprobe{secrets.token_hex(3)}"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


@dataclass
class NetHost:
    """One network namespace and its veth pair."""

    name: str
    outer: str  #: the veth end in the test's namespace
    outer_ip: str
    inner_ip: str

    @property
    def prefix(self) -> list[str]:
        """The command prefix that runs a process on this host."""
        return [IP, "netns", "exec", self.name]

    def cut(self) -> None:
        """Partition the host: its link to the test's namespace goes down."""
        _ip("link", "set", self.outer, "down")

    def restore(self) -> None:
        _ip("link", "set", self.outer, "up")


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 of 10.201.0.0/16 no address of this namespace is in."""
    used = _ip("-4", "-o", "addr", "show").stdout
    while True:
        net = ipaddress.IPv4Network(f"10.201.{random.randrange(1, 255)}.0/24")
        if f" {net.network_address.exploded.rsplit('.', 1)[0]}." not in used:
            return net


@contextmanager
def hosts(count: int) -> Iterator[list[NetHost]]:
    """``count`` hosts (namespaces with a veth pair each), removed on exit."""
    tag = secrets.token_hex(3)
    subnet = list(_free_subnet().subnets(new_prefix=30))
    made: list[NetHost] = []
    try:
        for i in range(count):
            name, outer, inner = f"chd{tag}h{i}", f"chd{tag}o{i}", f"chd{tag}i{i}"
            outer_ip, inner_ip = (str(a) for a in list(subnet[i].hosts())[:2])
            _ip("netns", "add", name)
            made.append(NetHost(name, outer, outer_ip, inner_ip))
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            _ip("link", "set", inner, "netns", name)
            _ip("addr", "add", f"{outer_ip}/30", "dev", outer)
            _ip("link", "set", outer, "up")
            _ip("-n", name, "addr", "add", f"{inner_ip}/30", "dev", inner)
            _ip("-n", name, "link", "set", inner, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield made
    finally:
        for host in made:
            _ip("netns", "del", host.name, check=False)  # its veth pair goes with it
            _ip("link", "del", host.outer, check=False)
