"""``EngineGuard``: a guard session attached to one vLLM scheduler.

The engine-agnostic half (ledger, audits, checkpoint policy, history, counters,
published state) is :class:`kvguard.core.session.GuardSession`. This module adds
only what attaching to vLLM takes: the :class:`VllmAdapter`, a unique engine name
per process, the state file, the checkpoint-request file and the memory
attributor. The hooks (``kvguard.vllm_plugin.hooks``) feed the session's events.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from kvguard.attribution.setup import attributor_for_vllm
from kvguard.config import KvguardConfig
from kvguard.core.session import GuardSession
from kvguard.core.types import RequestId
from kvguard.core.wedge import DeadOwner, WedgeOptions
from kvguard.core.wedge_monitor import WedgeMonitor, session_dead_owners
from kvguard.tracing.tracer import RequestTracer
from kvguard.transport.control import request_mtime_ns
from kvguard.transport.publisher import StatePublisher
from kvguard.vllm_plugin.adapter import VllmAdapter
from kvguard.vllm_plugin.trace_setup import tracer_for_vllm
from kvguard.vllm_plugin.waiting_reader import VllmWaiting

_GUARDS: weakref.WeakValueDictionary[str, EngineGuard] = weakref.WeakValueDictionary()


def guards() -> list[EngineGuard]:
    """Every live guard in this process (one per engine core)."""
    return list(_GUARDS.values())


def guard_of(scheduler: Any) -> EngineGuard | None:
    """The guard attached to a vLLM scheduler, if kvguard is installed on it."""
    g = getattr(scheduler, "_kvguard", None)
    return g if isinstance(g, EngineGuard) else None


class InstalledHook(NamedTuple):
    """One method kvguard wraps on one engine object, in both of its forms."""

    obj: Any
    """The scheduler, its block pool or its KV cache coordinator (the instance)."""
    name: str
    plain: Callable[..., Any]
    """The hook as it runs on most steps: no clock in it."""
    metered: Callable[..., Any]
    """The same hook with a clock at each boundary (in place during a cost window)."""


class RequestFile:
    """The sidecar's checkpoint requests: a file whose mtime says when it last asked."""

    def __init__(self, run_dir: Path, engine: str) -> None:
        self._run_dir = run_dir
        self._engine = engine
        self._seen_ns = request_mtime_ns(run_dir, engine)

    def pending(self) -> bool:
        """One ``stat``: True when the file is newer than at the last poll. Reads only:
        safe from another thread (the idle waker's) while the engine thread polls."""
        return request_mtime_ns(self._run_dir, self._engine) > self._seen_ns

    def poll(self) -> bool:
        """One ``stat``: True when the file is newer than at the last poll."""
        mtime = request_mtime_ns(self._run_dir, self._engine)
        if mtime > self._seen_ns:
            self._seen_ns = mtime
            return True
        return False


class EngineGuard(GuardSession):
    """The guard session of one vLLM scheduler. Called only from its scheduler thread."""

    publisher: StatePublisher

    def __init__(self, scheduler: Any, config: KvguardConfig) -> None:
        adapter = VllmAdapter(scheduler)
        self.scheduler = scheduler
        self.kv_cache_manager = adapter.kv_cache_manager
        self.block_pool = adapter.block_pool
        engine = _unique_name(adapter.identity.name(config.engine_name))
        self.requests = RequestFile(config.run_dir, engine)
        """The sidecar's checkpoint requests (polled at step ends, and by the idle waker)."""
        super().__init__(adapter, config, engine=engine,
                         sink=StatePublisher(config.run_dir, engine),
                         requests=self.requests)
        self.vllm = adapter
        self.installed_hooks: list[InstalledHook] = []
        """Every hook in place, plain and metered (the cost meter switches between them)."""
        self.owner_cell: list[RequestId | None] = [None]
        """The request whose lifecycle call is running: the hooks charge the pool calls
        inside it to this request (set by the hooks, and by reclaim around its free)."""
        self.reclaimed_requests: set[str] = set()
        """Requests vLLM kept (a delayed free) that reclaim freed: a late transfer
        completion for one is dropped before vLLM sees it (vLLM asserts the request)."""
        self.attributor = attributor_for_vllm(scheduler, config,
                                              name=f"{self.engine}-{self.epoch}")
        self.request_tracer: RequestTracer | None = tracer_for_vllm(scheduler, self)
        """Findings into the requests' traces (None: no OTLP endpoint configured); the
        admission hook hands it each request's trace headers."""
        self.tracer = self.request_tracer
        self.wedge = WedgeMonitor(VllmWaiting(scheduler), self._dead_owners,
                                  WedgeOptions(config.wedge_after_seconds,
                                               config.wedge_after_steps), engine=self.engine)
        if config.reclaim:
            from kvguard.vllm_plugin.reclaimer import VllmReclaimer

            self.start_reclaim(VllmReclaimer(self), config.reclaim_after_verdicts)
        _GUARDS[self.engine] = self

    @property
    def completions_guarded(self) -> bool:
        """Whether kvguard sees vLLM's KV transfer completions before vLLM applies them
        (its connector hook is installed), so it can drop one for a reclaimed request."""
        return any(label.endswith("._update_from_kv_xfer_finished")
                   for label in self.hooks_installed)


    def _dead_owners(self, now: float) -> list[DeadOwner]:
        return session_dead_owners(self, now)


def _unique_name(name: str) -> str:
    if name not in _GUARDS:
        return name
    i = 2
    while f"{name}-{i}" in _GUARDS:
        i += 1
    return f"{name}-{i}"
