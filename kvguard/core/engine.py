"""What only the engine knows: the ``EngineAdapter`` Protocol and the types it returns.

A :class:`kvguard.core.session.GuardSession` is engine-agnostic; everything it
needs from an inference engine goes through one adapter: pool reads (sliced,
between steps, and whole, at a drained moment), request block tables, what is
in flight (to tell a drained moment), finished requests the engine still keeps,
the request-id mapping, the bound of legitimate holds, and the engine's identity.
Names are the engine's neutral concepts (a block pool, block tables, requests),
not one engine's classes; a second engine becomes an adapter plus hooks that feed
the session's events.

Every method runs on the engine's scheduler thread, between steps, and must not
block. An adapter method may raise; the session contains it (counted, reported,
the engine goes on).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvguard.core.offload import OffloadSource
from kvguard.core.online import PoolAccess
from kvguard.core.snapshot import PoolSnapshot
from kvguard.core.transfers import TransferSource
from kvguard.core.types import FinishReason

_NOT_IN_A_NAME = re.compile(r"[^A-Za-z0-9_.-]+")
HOST_PART_MAX_CHARS = 100
"""The host part of a default engine name is cut to this (names are at most 128)."""


def host_part(hostname: str | None = None) -> str:
    """This host as the first part of a default engine name: the host name (in
    Kubernetes the pod's name, which is unique in its namespace), with every character
    an engine name does not admit replaced by ``-`` and cut to ``HOST_PART_MAX_CHARS``.
    ``host`` when the host name is empty."""
    raw = socket.gethostname() if hostname is None else hostname
    part = _NOT_IN_A_NAME.sub("-", raw).strip("-.")[:HOST_PART_MAX_CHARS]
    return part or "host"


@dataclass(frozen=True, slots=True)
class EngineIdentity:
    """Which engine this is: kvguard's name for it, and the labels that join its series
    with the engine's own metrics.

    Invariant: ``name(None)`` is unique in a fleet as long as host names are (one server
    per host, or one pod per server), because it carries the host and the engine index.
    """

    kind: str
    """The engine family, e.g. ``vllm``."""
    version: str | None
    """Its version string, when it can be read."""
    default_name: str
    """kvguard's name for the engine (the ``engine_name`` label, the state file) when
    ``KVGUARD_ENGINE_NAME`` is unset: ``<host>-dp<rank>``, one per data-parallel rank,
    which has its own pool."""
    replica: str | None = None
    """This engine's place in a group of engines that share one configuration (e.g.
    ``dp1`` for data-parallel rank 1); ``None`` when it runs alone. A configured name
    gets it as a suffix, so that the ranks of one server never share a label."""
    model_name: str | None = None
    """The model name the engine's own metrics carry (vLLM: ``model_name``, the first
    served model name)."""
    engine_index: int = 0
    """The engine's index in its server, as the engine's own metrics label it (vLLM:
    ``engine="0"``; the data-parallel rank)."""

    def name(self, configured: str | None) -> str:
        """kvguard's name for the engine: ``configured`` (plus ``-<replica>`` in a group),
        else ``default_name``."""
        if not configured:
            return self.default_name
        return f"{configured}-{self.replica}" if self.replica else configured


@dataclass(frozen=True, slots=True)
class EngineActivity:
    """What the engine has in flight now: enough to tell a drained moment.

    Invariant: counts are ``>= 0``. ``finished_held`` lists finished requests the engine
    still keeps with their blocks (a delayed free while a KV transfer completes).
    """

    running: int
    waiting: int
    deferred_frees: int
    """Frees parked until an in-flight step completes."""
    unfinished: str | None
    """A request the engine still tracks that has not finished, if any."""
    finished_held: tuple[str, ...] = ()
    batches_in_flight: int = 0
    """Batches the engine has scheduled whose output it has not processed yet (async
    scheduling keeps one running while it schedules the next). A drained moment needs 0:
    the device then has no batch of the engine's own to finish, so a checkpoint's
    device synchronize does not wait on one, and nothing still writes a freed block."""

    @property
    def live_work(self) -> bool:
        return bool(self.running or self.waiting or self.unfinished is not None)


@dataclass(frozen=True, slots=True)
class HoldBound:
    """How long a finished request may legitimately keep its blocks (a delayed free)."""

    seconds: float
    source: str
    """Where the number came from (configuration, the connector's own timeout, default),
    for the log and the report."""


class EngineAdapter(Protocol):
    """The engine side of a guard session (one engine core, one block pool)."""

    @property
    def identity(self) -> EngineIdentity: ...

    @property
    def pool(self) -> PoolAccess:
        """Sliced reads of the pool and the request block tables (the online audit's view).
        The same object for the adapter's lifetime: the session keeps it."""

    def read_pool(self) -> PoolSnapshot:
        """Every block at once, at a drained moment."""

    def request_tables(self) -> Mapping[str, Sequence[int]]:
        """Every request's block ids, per the engine's own tables."""

    def activity(self) -> EngineActivity: ...

    def has_live_work(self) -> bool:
        """Whether requests are running or waiting now: what :meth:`activity` would say
        first, in one cheap test (every free re-arms the drain check, and under load the
        answer is nearly always yes)."""

    def finished_requests(self) -> Mapping[str, FinishReason]:
        """Finished requests the engine still keeps (with their blocks), and why each
        finished: adopted as delayed frees when the ledger is rebuilt."""

    def client_request_id(self, request_id: str) -> str:
        """The id the client gave for the engine's internal ``request_id``."""

    def hold_bound(self) -> HoldBound:
        """The engine's own bound for delayed frees (its KV connector's timeout)."""

    def faults_enabled(self) -> list[str]:
        """Faults the engine itself injects (tests and staging), to show in the state."""

    def kv_transfers(self) -> TransferSource | None:
        """The engine's KV connector for transfers between engines (P/D), or ``None``."""

    def offload_source(self) -> OffloadSource | None:
        """The engine's offloading KV connector (jobs to and from an offload tier), or
        ``None``."""
