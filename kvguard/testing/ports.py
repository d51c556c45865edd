"""Loopback ports for servers that bind later than the moment they are chosen.

A server started as a subprocess binds its port tens of seconds after the port
was picked (vLLM's NIXL side channel binds only once the engine is built). A
port picked with ``bind(("127.0.0.1", 0))`` comes from the kernel's ephemeral
range, the same range every outgoing connection and every ``bind(0)`` of vLLM's
own ZMQ sockets draws from, so in that window another process can take it: CI
lost a whole P/D module to ``ZMQError: Address already in use`` that way.

:func:`free_loopback_port` therefore picks below the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), where the kernel never hands
ports out on its own; only an explicit bind can collide there, and it checks
that the port binds now and never returns the same port twice in one process.
Processes that pick concurrently start from different pseudo-random offsets.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path
from typing import Final

LOOPBACK: Final = "127.0.0.1"
#: Lowest port handed out: above the registered services most hosts run.
LOWEST_PORT: Final = 10_000
#: Used when the ephemeral range cannot be read (Linux's default lower bound).
DEFAULT_EPHEMERAL_LOW: Final = 32_768
_RANGE_FILE: Final = Path("/proc/sys/net/ipv4/ip_local_port_range")

_lock = threading.Lock()
_issued: set[int] = set()
_rng = random.Random()  # seeded from os.urandom: concurrent processes differ


def ephemeral_low(range_file: Path = _RANGE_FILE) -> int:
    """The lowest port of the kernel's ephemeral range (32768 where unknown)."""
    try:
        low = int(range_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW
    return low if low > LOWEST_PORT + 1_000 else DEFAULT_EPHEMERAL_LOW


def _binds(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((LOOPBACK, port))
        except OSError:
            return False
        return True


def free_loopback_port() -> int:
    """A TCP port on 127.0.0.1, below the ephemeral range, that binds right now.

    Never the same port twice in one process. Raises ``RuntimeError`` when no
    port in ``[LOWEST_PORT, ephemeral_low())`` binds (free some, or widen the
    range with ``sysctl net.ipv4.ip_local_port_range``).
    """
    return free_loopback_ports(1)


def free_loopback_ports(count: int) -> int:
    """The first of ``count`` consecutive TCP ports on 127.0.0.1 that all bind right now
    (below the ephemeral range, none issued before in this process): for servers that
    offset one configured port per rank, as vLLM does for data-parallel KV-event endpoints.

    Raises ``ValueError`` for ``count < 1`` and ``RuntimeError`` when no such run is free.
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, not {count}")
    high = ephemeral_low()
    span = high - LOWEST_PORT - count + 1
    with _lock:
        start = _rng.randrange(span)
        for step in range(span):
            first = LOWEST_PORT + (start + step) % span
            run = range(first, first + count)
            if not _issued.intersection(run) and all(_binds(p) for p in run):
                _issued.update(run)
                return first
    what = "free TCP port" if count == 1 else f"{count} consecutive free TCP ports"
    raise RuntimeError(f"no {what} on {LOOPBACK} in [{LOWEST_PORT}, {high}): stop servers "
                       "that hold them")
