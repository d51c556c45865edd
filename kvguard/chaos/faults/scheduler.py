"""``ChaosScheduler``: vLLM's own ``Scheduler`` with faults in its code paths, below kvguard.

Load it with ``--scheduler-cls kvguard.chaos.faults.scheduler.ChaosScheduler`` (server) or
``scheduler_cls=...`` (``EngineArgs``, in-process); with async scheduling,
``AsyncChaosScheduler`` (the same faults on vLLM's ``AsyncScheduler``). kvguard's
plugin attaches to it like to any scheduler and wraps the *subclass's* methods from
outside, so kvguard sees only what this (faulty) vLLM does: a fault is never announced
to kvguard, and no kvguard code knows that faults exist. Faults in the KV cache
manager's single-type managers are per-instance patches of vLLM methods that kvguard
does not hook at all.

It also records what vLLM itself did (finish statuses, preemptions, faults fired), read
from vLLM's request objects: ground truth for the chaos matrix that kvguard did not
produce.

Safety: with no plan armed it behaves exactly like vLLM's ``Scheduler`` (each override
is one dictionary lookup, then ``super()``). A plan comes from :meth:`arm` (in-process) or
from ``KVGUARD_ALLOW_FAULTS=1`` plus ``KVGUARD_FAULTS=<spec>`` (both keys, read once when
the engine starts; ``KVGUARD_FAULTS`` alone refuses to start the engine). In a data-parallel
server every rank reads the same environment: ``KVGUARD_FAULTS_DP_RANKS=1`` (a comma list)
arms only those ranks, so that a leaking rank can run beside a healthy one.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from kvguard.chaos.faults.plan import Fault, FaultPlan
from kvguard.errors import ConfigError
from kvguard.vllm_plugin.adapter import data_parallel_rank

log = logging.getLogger("kvguard.faults")

MAX_FINISHED_RECORDED = 100_000
"""Finish statuses kept per request (oldest dropped first); the counts stay exact."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ChaosScheduler(Scheduler):
    """vLLM's scheduler, plus opt-in faults and a record of what vLLM did.

    ``finished`` maps each finished request (engine-internal id, the latest
    :data:`MAX_FINISHED_RECORDED`) to vLLM's own ``RequestStatus`` name at its free;
    ``finish_statuses`` counts them all; ``preemptions`` counts ``_preempt_request`` calls.
    Both are filled whether or not a fault is armed.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.faults = FaultPlan()
        self.finished: dict[str, str] = {}
        self.preemptions = 0
        self.finish_statuses: Counter[str] = Counter()
        self._preempting: str | None = None
        super().__init__(*args, **kwargs)  # kvguard (if installed) attaches in here
        self._patch_managers()
        spec = os.environ.get("KVGUARD_FAULTS", "")
        allowed = os.environ.get("KVGUARD_ALLOW_FAULTS", "").strip().lower() in ("1", "true",
                                                                                 "yes", "on")
        if spec.strip():
            plan = FaultPlan.parse(spec, allowed=allowed)
            if _this_rank_injects(self, os.environ.get("KVGUARD_FAULTS_DP_RANKS", "")):
                self.arm(plan)

    # ---------------------------------------------------------------- arming
    def arm(self, plan: FaultPlan) -> None:
        """Replace the fault plan (logs loudly when it is not empty)."""
        if plan:
            log.warning("KVGUARD FAULT INJECTION ENABLED (%s): this engine will leak or corrupt "
                        "KV blocks on purpose. Never use this in production.",
                        ", ".join(plan.enabled))
        self.faults = plan

    @property
    def faults_enabled(self) -> list[str]:
        """Armed faults and how often each fired (kvguard publishes this, duck-typed)."""
        return self.faults.enabled

    # ------------------------------------------------------- table helpers
    def _managers(self) -> list[Any]:
        coord = getattr(self.kv_cache_manager, "coordinator", None)
        return list(getattr(coord, "single_type_managers", ()) or ())

    def _table_blocks(self, request_id: str) -> list[Any]:
        out: list[Any] = []
        for mgr in self._managers():
            out.extend(b for b in mgr.req_to_blocks.get(request_id, ()) if not b.is_null)
        return out

    # ------------------------------------------------------------ overrides
    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        rid = str(request.request_id)
        self.finished[rid] = request.status.name
        if len(self.finished) > MAX_FINISHED_RECORDED:  # a staging server runs for long
            del self.finished[next(iter(self.finished))]
        self.finish_statuses[request.status.name] += 1
        if self.faults.armed(Fault.REFCOUNT_BUMP):
            # A reference taken behind every hook (a copy-on-write pair or a connector
            # bound to the pool bumping ref_cnt directly) that nobody gives back.
            tail = self._table_blocks(rid)
            if tail and self.faults.fire(Fault.REFCOUNT_BUMP, rid):
                tail[-1].ref_cnt += 1
        return super()._free_request(request, *args, **kwargs)

    def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self.preemptions += 1
        self._preempting = str(request.request_id)
        try:
            return super()._preempt_request(request, *args, **kwargs)
        finally:
            self._preempting = None

    def _free_request_blocks(self, request: Any) -> Any:
        rid = str(request.request_id)
        faults = self.faults
        if faults and self._table_blocks(rid):
            aborted = request.status == RequestStatus.FINISHED_ABORTED
            if aborted and faults.fire(Fault.SKIP_FREE_ON_ABORT, rid):
                return None  # the abort path never frees: the table and its refs stay
            if aborted and faults.fire(Fault.DOUBLE_FREE_ON_ABORT, rid):
                blocks = self._table_blocks(rid)
                ret = super()._free_request_blocks(request)
                self.kv_cache_manager.block_pool.free_blocks(list(reversed(blocks)))
                return ret
            if self._preempting == rid and faults.fire(Fault.PREEMPTION_SKIPS_FREE, rid):
                # The preemption drops the request's tables but never frees the blocks.
                self.kv_cache_manager.pop_blocks_for_free(request)
                return None
            if request.is_finished() and faults.armed(Fault.SPEC_ROLLBACK_KEEPS_BLOCKS):
                self._maybe_keep_rolled_back_blocks(request)
        return super()._free_request_blocks(request)

    def _maybe_keep_rolled_back_blocks(self, request: Any) -> None:
        """Drop the blocks past the request's computed tokens (rejected drafts and their
        lookahead) from its tables without freeing them."""
        rid = str(request.request_id)
        computed = int(request.num_computed_tokens)
        cut: list[tuple[list[Any], int]] = []
        for mgr in self._managers():
            blocks = mgr.req_to_blocks.get(rid)
            keep = _cdiv(computed, mgr.block_size)
            if blocks and len(blocks) > keep:
                cut.append((blocks, keep))
        if cut and self.faults.fire(Fault.SPEC_ROLLBACK_KEEPS_BLOCKS, rid):
            for blocks, keep in cut:
                del blocks[keep:]

    def _request_blocks_can_be_freed(self, request: Any) -> bool:
        if self.faults and request.is_finished() and self._table_blocks(
                str(request.request_id)) and self.faults.fire(
                    Fault.DEFERRED_FREE_NEVER_RELEASED, str(request.request_id)):
            # The free is parked in deferred_frees behind a fence that never comes: a
            # synchronous scheduler never drains deferred_frees at all.
            return False
        can: bool = super()._request_blocks_can_be_freed(request)
        return can

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        kvo = getattr(model_runner_output, "kv_connector_output", None)
        if self.faults and kvo is not None:
            # Completions lost between the connector's worker and the scheduler.
            for attr, fault in (("finished_recving", Fault.REMOTE_KV_NEVER_ARRIVES),
                                ("finished_sending", Fault.SEND_COMPLETION_LOST)):
                ids = getattr(kvo, attr, None)
                if ids:
                    lost = {r for r in ids if self.faults.fire(fault, str(r))}
                    if lost:
                        setattr(kvo, attr, set(ids) - lost)
        return super().update_from_output(scheduler_output, model_runner_output)

    # --------------------------------------------- patches below the pool
    def _patch_managers(self) -> None:
        """Per-instance patches of the single-type managers (kvguard hooks none of them)."""
        for mgr in self._managers():
            mgr.add_local_computed_blocks = self._extra_ref_on_hit(mgr.add_local_computed_blocks)
            if type(mgr).__name__ == "SlidingWindowManager":
                mgr._remove_blocks_in_range = self._skip_window_free(mgr)

    def _extra_ref_on_hit(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def add_local_computed_blocks(request_id: str, new_computed_blocks: Sequence[Any],
                                      *args: Any, **kwargs: Any) -> Any:
            ret = orig(request_id, new_computed_blocks, *args, **kwargs)
            hit = [b for b in new_computed_blocks if not b.is_null]
            if hit and self.faults.fire(Fault.PREFIX_HIT_EXTRA_REF, request_id):
                hit[0].ref_cnt += 1  # a second reference on the hit, never given back
            return ret
        return add_local_computed_blocks

    def _skip_window_free(self, mgr: Any) -> Callable[..., Any]:
        orig = mgr._remove_blocks_in_range

        def _remove_blocks_in_range(request_id: str, first_block: int, last_block: int) -> Any:
            blocks = mgr.req_to_blocks.get(request_id)
            if not blocks or first_block >= last_block or not any(
                    not b.is_null for b in blocks[first_block:last_block]) \
                    or not self.faults.fire(Fault.SLIDING_WINDOW_REMOVAL_SKIPS_FREE, request_id):
                return orig(request_id, first_block, last_block)
            null = mgr._null_block
            for i in range(min(last_block, len(blocks)) - 1, first_block - 1, -1):
                if blocks[i] is null:
                    break
                blocks[i] = null  # out of the table, never freed
            return None
        return _remove_blocks_in_range


class AsyncChaosScheduler(ChaosScheduler, AsyncScheduler):
    """:class:`ChaosScheduler` on vLLM's ``AsyncScheduler`` (the same faults and records).

    vLLM runs a batch queue only for an ``AsyncScheduler``; a custom ``Scheduler`` subclass
    would silently run without async scheduling. Method order: this class, the chaos
    overrides, ``AsyncScheduler``, ``Scheduler``: every ``super()`` call of the chaos
    overrides reaches the async scheduler's own code.
    """


def _this_rank_injects(scheduler: Scheduler, ranks: str) -> bool:
    """Whether this engine core's data-parallel rank is in ``ranks`` ("1,3"; empty: all)."""
    if not ranks.strip():
        return True
    try:
        wanted = {int(r) for r in ranks.split(",") if r.strip()}
    except ValueError:
        raise ConfigError("KVGUARD_FAULTS_DP_RANKS", ranks,
                          "a comma-separated list of data-parallel ranks, e.g. 1 or 0,2") \
            from None
    rank, _ = data_parallel_rank(scheduler)
    return rank in wanted
