"""Two nodes on one machine: two Linux network namespaces joined by a veth pair.

Each namespace has only its own loopback and its end of the veth (``10.<a>.<b>.1`` on the
prefill node, ``.2`` on the decode node, one /24 per test process): a process started in
one reaches the other only across the veth, as two hosts on one link. Needs root
(``ip netns``).

:func:`entered` moves the calling *thread* into a namespace for the length of a
``with`` block (``setns(2)`` on the thread, then back): sockets it opens, and processes it
starts (they inherit the thread's namespace), belong to that node. So the test process
starts each server in its node, and talks to a node from a thread that entered it;
nothing runs in the machine's own namespace, and no port is opened there.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)} (entering a network namespace "
                           "needs root)")


@contextlib.contextmanager
def entered(netns: str) -> Iterator[None]:
    """This thread in ``netns`` (a name under ``/run/netns``) for the block."""
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(f"/run/netns/{netns}", os.O_RDONLY)
        try:
            _setns(target)
            try:
                yield
            finally:
                _setns(own)
        finally:
            os.close(target)
    finally:
        os.close(own)


@dataclass(frozen=True)
class Node:
    netns: str
    address: str
    """Its end of the veth: where its servers bind, and where the other node reaches it."""
    device: str
    """The veth's name in this namespace (``UCX_NET_DEVICES`` for NIXL)."""


@dataclass(frozen=True)
class TwoNodes:
    prefill: Node
    decode: Node


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@contextlib.contextmanager
def two_nodes() -> Iterator[TwoNodes]:
    """Create the two namespaces and their link; delete both (and so the link) on exit."""
    tag = os.getpid() % 100_000
    subnet = f"10.{200 + tag % 50}.{tag % 250}"
    nodes = TwoNodes(
        prefill=Node(f"kvg{tag}p", f"{subnet}.1", f"kvp{tag}"),
        decode=Node(f"kvg{tag}d", f"{subnet}.2", f"kvd{tag}"))
    created: list[str] = []
    try:
        for node in (nodes.prefill, nodes.decode):
            _ip("netns", "add", node.netns)
            created.append(node.netns)
        _ip("link", "add", nodes.prefill.device, "type", "veth", "peer", "name",
            nodes.decode.device)
        for node in (nodes.prefill, nodes.decode):
            _ip("link", "set", node.device, "netns", node.netns)
            _ip("-n", node.netns, "addr", "add", f"{node.address}/24", "dev", node.device)
            _ip("-n", node.netns, "link", "set", node.device, "up")
            _ip("-n", node.netns, "link", "set", "lo", "up")
        yield nodes
    finally:
        for name in created:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def link_bytes(node: Node) -> int:
    """Bytes sent plus received on ``node``'s end of the veth (the kernel's counters)."""
    out = subprocess.run(["ip", "-n", node.netns, "-s", "-j", "link", "show", "dev",
                          node.device], check=True, capture_output=True, text=True,
                         timeout=30).stdout
    (dev,) = json.loads(out)
    stats = dev["stats64"]
    return int(stats["rx"]["bytes"]) + int(stats["tx"]["bytes"])
