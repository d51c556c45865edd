"""``VllmReclaimer``: frees a dead owner's blocks through the free path vLLM itself would
have taken (the engine side of :mod:`kvguard.core.monitors.reclaim`).

One free path per way the free went missing, each vLLM's own (0.32-0.34; the names are
rows of :mod:`kvguard.vllm_plugin.versions`):

=====================================  ============================================
what vLLM still holds for the owner    the free path called
=====================================  ============================================
the finished request itself            ``Scheduler._free_blocks(request)``: what
(``scheduler.requests``): a delayed    ``_update_from_kv_xfer_finished`` does when the
free whose completion never came       transfer completes (frees, forgets the request)
its block table only (the request is   ``KVCacheManager.free(request)``: what
gone): a free that was skipped         ``_free_request_blocks`` does (blocks in reverse
                                       order, tail first, hashes kept: cached blocks)
an entry of ``Scheduler.deferred_      ``BlockPool.free_blocks(reversed(blocks))`` on
frees`` whose fence never came         that entry, taken out of the queue: what
                                       ``_drain_deferred_frees`` does
=====================================  ============================================

So the pool's ref counts, free queue order and prefix-cache hashes end as vLLM's own free
would have left them (the scheduler-level tests compare with a clean run). The call runs
through kvguard's own hooks with the owner named (the ``owner`` cell of
:func:`~kvguard.vllm_plugin.hooks.install_hooks`), so the ledger charges each reference to
the dead request, as for the free that went missing.

Re-checked against vLLM at the moment of the free, refused when it fails: the owner is
not live in vLLM's scheduler nor in kvguard's ledger, and its hold is past its bound
(``owner_alive``); every block the verdict named is still in what is freed and has at
least one reference beyond those of live requests' tables (``blocks_changed``); no
offload job's fence covers a block, and no load job of the owner is pending (``fenced``:
vLLM fences a store's source blocks, not a load's destination, and a load whose completion
was lost may still write into them). A request vLLM keeps is freed only where
kvguard can drop a late completion for it before vLLM sees one (the connector hook is
installed): vLLM asserts that a completed transfer's request exists.

Call on the scheduler thread between steps (the reclaim monitor runs at a step end). A
deferred free is past its bound only long after the steps in flight when it was parked
have finished, so no in-flight step writes its blocks.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from typing import Any, Protocol

from kvguard.core.classify import HoldRule, hold_is_legitimate
from kvguard.core.ledger import OwnershipLedger
from kvguard.core.reclaim import ReclaimOutcome, RefusalReason
from kvguard.core.types import RequestId
from kvguard.core.wedge import DeadOwner
from kvguard.vllm_plugin.versions import (
    JOB_DEFERRED_FENCE_BLOCK_IDS,
    JOB_FENCED_BLOCK_IDS,
    JOB_IS_STORE,
    JOB_REQ_ID,
    OFFLOAD_CONNECTOR_SCHEDULER,
    OFFLOAD_JOBS,
    SCHEDULER_CONNECTOR,
    missing_message,
    read,
    released_request,
)

_REFUSE = RefusalReason


def _refused(reason: RefusalReason, path: str, detail: str) -> ReclaimOutcome:
    return ReclaimOutcome(refused=reason, path=path, detail=detail)


class GuardedScheduler(Protocol):
    """What reclaim needs of the guard attached to one vLLM scheduler (``EngineGuard``)."""

    scheduler: Any
    kv_cache_manager: Any
    block_pool: Any
    owner_cell: list[RequestId | None]
    """The hooks charge the pool calls made while it names a request to that request."""
    reclaimed_requests: set[str]
    """Requests vLLM kept that reclaim freed (a late completion for one is dropped)."""

    @property
    def ledger(self) -> OwnershipLedger: ...

    @property
    def delayed_free_bound(self) -> float: ...

    @property
    def completions_guarded(self) -> bool:
        """kvguard sees vLLM's transfer completions first (its connector hook is in)."""

    def on_freed(self, request_id: RequestId, at: float) -> None: ...


class VllmReclaimer:
    """The reclaimer of one guarded vLLM scheduler (:class:`~kvguard.core.reclaim.Reclaimer`)."""

    def __init__(self, guard: GuardedScheduler) -> None:
        self.guard = guard
        self.scheduler: Any = guard.scheduler
        self.kv_cache_manager: Any = guard.kv_cache_manager
        self.block_pool: Any = guard.block_pool

    # ----------------------------------------------------------- reading vLLM
    def _managers(self) -> list[Any]:
        coord = getattr(self.kv_cache_manager, "coordinator", None)
        return list(getattr(coord, "single_type_managers", ()) or ())

    def _live(self, request_id: str) -> bool:
        req = (getattr(self.scheduler, "requests", None) or {}).get(request_id)
        return req is not None and not req.is_finished()

    def _table(self, request_id: str) -> list[Any]:
        """vLLM's block table of ``request_id`` across KV groups (null blocks left out)."""
        out: list[Any] = []
        for mgr in self._managers():
            out.extend(b for b in mgr.req_to_blocks.get(request_id, ()) if not b.is_null)
        return out

    def _live_refs(self) -> Counter[int]:
        """References on each block from the tables of requests vLLM runs or queues."""
        refs: Counter[int] = Counter()
        for mgr in self._managers():
            for rid, blocks in mgr.req_to_blocks.items():
                if self._live(rid):
                    refs.update(b.block_id for b in blocks if not b.is_null)
        return refs

    def _offload_jobs(self) -> list[Any]:
        """vLLM's OffloadingConnector jobs in flight (empty without that connector)."""
        connector = read(self.scheduler, SCHEDULER_CONNECTOR)
        jobs = read(read(connector, OFFLOAD_CONNECTOR_SCHEDULER), OFFLOAD_JOBS)
        return list(jobs.values()) if isinstance(jobs, dict) else []

    def _fenced(self) -> set[int]:
        """Blocks a store job's fence holds (it still reads them)."""
        out: set[int] = set()
        for st in self._offload_jobs():
            for row in (JOB_FENCED_BLOCK_IDS, JOB_DEFERRED_FENCE_BLOCK_IDS):
                out.update(int(b) for b in read(st, row) or ())
        return out

    def _loading(self, request_id: str | None) -> bool:
        """Whether a load job for ``request_id`` is still pending: it writes into that
        request's blocks, which vLLM does not fence (a lost load's copy may still land)."""
        return request_id is not None and any(
            read(st, JOB_IS_STORE) is False and str(read(st, JOB_REQ_ID, "")) == request_id
            for st in self._offload_jobs())

    def _deferred_entry(self, block_ids: frozenset[int]) -> Any:
        """The ``deferred_frees`` entry that holds the owner's blocks (None: none does)."""
        for entry in getattr(self.scheduler, "deferred_frees", None) or ():
            ids = {b.block_id for b in entry[1] if not b.is_null}
            if block_ids <= ids:
                return entry
        return None

    # ---------------------------------------------------------------- checks
    def _recheck(self, owner: DeadOwner, blocks: list[Any], path: str) -> ReclaimOutcome | None:
        """Every block against the pool now: None when the free is safe, else the refusal."""
        own = Counter(b.block_id for b in blocks if not b.is_null)
        missing = sorted(owner.block_ids - own.keys())
        if missing:
            return _refused(_REFUSE.BLOCKS_CHANGED, path,
                            f"block(s) {missing[:8]} are no longer what vLLM would free for "
                            "the owner")
        fenced = sorted(own.keys() & self._fenced())
        if fenced:
            return _refused(_REFUSE.FENCED, path,
                            f"an offload job's fence holds block(s) {fenced[:8]}")
        if self._loading(owner.engine_request_id):
            return _refused(_REFUSE.FENCED, path,
                            "an offload load job of the owner is still pending: it writes "
                            "into these blocks, and only its connector can end it")
        live = self._live_refs()
        by_id = {b.block_id: b for b in blocks}
        short = sorted(bid for bid, n in own.items()
                       if by_id[bid].ref_cnt < n + live.get(bid, 0))
        if short:
            return _refused(_REFUSE.BLOCKS_CHANGED, path,
                            f"block(s) {short[:8]} have fewer references than the owner and "
                            "the live requests hold: freeing would take a live reference")
        return None

    def _alive(self, owner: DeadOwner, rid: str, now: float) -> str | None:
        if self._live(rid):
            return "vLLM runs or queues the request again"
        rec = self.guard.ledger.record(RequestId(rid))
        if rec is None:
            return None
        if rec.phase.is_live:
            return "kvguard's ledger has the request live again"
        rule = HoldRule(now=now, bound_seconds=self.guard.delayed_free_bound,
                        between_steps=True)
        if hold_is_legitimate(rec, rule):
            return "its hold is within its bound again (a lease renewed)"
        return None

    # ------------------------------------------------------------------ free
    def _charged(self, rid: str, free: Any, *args: Any) -> None:
        """Call vLLM's ``free`` with the hooks charging its pool frees to ``rid``."""
        cell = self.guard.owner_cell
        prev, cell[0] = cell[0], RequestId(rid)
        try:
            free(*args)
        finally:
            cell[0] = prev

    def reclaim(self, owner: DeadOwner) -> ReclaimOutcome:
        rid = owner.engine_request_id
        if rid is None:
            return _refused(_REFUSE.OWNER_UNKNOWN, "", "no request is known to own the blocks")
        now = time.time()
        why = self._alive(owner, rid, now)
        if why is not None:
            return _refused(_REFUSE.OWNER_ALIVE, "", why)
        sched = self.scheduler
        held = (getattr(sched, "requests", None) or {}).get(rid)
        if held is not None:
            return self._free_held(owner, rid, held)
        table = self._table(rid)
        if table:
            return self._free_table(owner, rid, table)
        entry = self._deferred_entry(owner.block_ids)
        if entry is not None:
            return self._free_deferred(owner, rid, entry)
        return _refused(_REFUSE.BLOCKS_CHANGED, "",
                        "vLLM holds the blocks in no table and no deferred free any more")

    def _free_held(self, owner: DeadOwner, rid: str, request: Any) -> ReclaimOutcome:
        path = "Scheduler._free_blocks"
        free = getattr(self.scheduler, "_free_blocks", None)
        if free is None:
            return _refused(_REFUSE.NO_FREE_PATH, path, missing_message(
                f"{type(self.scheduler).__name__}._free_blocks"))
        g = self.guard
        if getattr(self.scheduler, "connector", None) is not None and not g.completions_guarded:
            return _refused(_REFUSE.NO_FREE_PATH, path, missing_message(
                f"{type(self.scheduler).__name__}._update_from_kv_xfer_finished") +
                ": a late transfer completion would reach vLLM for a request it forgot")
        blocks = self._table(rid)
        refusal = self._recheck(owner, blocks, path)
        if refusal is not None:
            return refusal
        g.reclaimed_requests.add(rid)  # before the free: vLLM forgets the request in it
        free(request)  # hooked: the ledger hears the free and the request freed
        return ReclaimOutcome(freed_block_ids=_ids(blocks), path=path,
                              detail="the delayed free's completion never came")

    def _free_table(self, owner: DeadOwner, rid: str, table: list[Any]) -> ReclaimOutcome:
        path = "KVCacheManager.free"
        free = getattr(self.kv_cache_manager, "free", None)
        if free is None:
            return _refused(_REFUSE.NO_FREE_PATH, path, missing_message(path))
        refusal = self._recheck(owner, table, path)
        if refusal is not None:
            return refusal
        self._charged(rid, free, released_request(rid))
        g = self.guard
        rec = g.ledger.record(RequestId(rid))
        if rec is not None and rec.freed_at is None:
            g.on_freed(RequestId(rid), time.time())
        return ReclaimOutcome(freed_block_ids=_ids(table), path=path,
                              detail="vLLM forgot the request and kept its block table")

    def _free_deferred(self, owner: DeadOwner, rid: str, entry: Any) -> ReclaimOutcome:
        path = "Scheduler.deferred_frees"
        blocks = list(entry[1])
        refusal = self._recheck(owner, blocks, path)
        if refusal is not None:
            return refusal
        self.scheduler.deferred_frees.remove(entry)
        # As _drain_deferred_frees: in reverse order, so that the tail is evicted first.
        self._charged(rid, self.block_pool.free_blocks, reversed(blocks))
        return ReclaimOutcome(freed_block_ids=_ids(blocks), path=path,
                              detail="the deferred free's fence never came")


def _ids(blocks: Iterable[Any]) -> tuple[int, ...]:
    return tuple(sorted({b.block_id for b in blocks if not b.is_null}))
