"""A reference KV block pool and a harness that drives it and the ledger together.

``RefPool`` is the simplest model of vLLM's ``BlockPool`` that still has the
features a leak hides behind: ref counts, a free queue (hashed blocks go to
its tail on free, unhashed to its head), prefix-cache hashes that survive a
free, and a null block 0 whose ref count is not maintained.

``Harness`` plays the engine: every operation changes the ``RefPool`` and
feeds the ``OwnershipLedger`` the events the vLLM hooks would produce for it.
A pool-level hook (``get_new_blocks``/``touch``/``free_blocks``) has no
request at hand, so each operation can run *attributed* (the hook names the
request) or *pool-level* (``request_id=None``, followed by ``claim`` with the
request's block table after an acquisition, as the ``allocate_slots`` wrapper
would). The harness also keeps the ground truth a test compares findings to.

Fault operations:

* ``skip_free_on_abort``: the request is aborted and declared freed, but its
  blocks never go back to the pool (vllm #32255 and friends).
* ``bump_ref``: a reference is taken outside every hooked path (a connector
  bound to the pool, a copy-on-write pair): ref count +1, no owner.
* ``finish(..., double_free_block=b)``: the request's free releases block
  ``b`` twice (SGLang #6888).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvguard.core import checkpoint
from kvguard.core.engine import EngineActivity, EngineIdentity, HoldBound
from kvguard.core.findings import Reconciliation
from kvguard.core.ledger import OwnershipLedger
from kvguard.core.reconciler import ReconcileOptions, reconcile
from kvguard.core.report import CheckpointReport
from kvguard.core.snapshot import PoolSlice, PoolSnapshot
from kvguard.core.types import (
    AcquireKind,
    Evidence,
    FinishReason,
    RequestId,
)
from kvguard.vllm_plugin.request_ids import client_request_id

NULL_BLOCK = 0
NULL_BLOCK_GARBAGE_REFCNT = 7
"""vLLM does not maintain the null block's ref count: give it a value that would show."""

PROMPT_SENTINEL = "SECRET-PROMPT-TEXT do not leak me"
TOKEN_SENTINEL = 987_654_321


class RefPool:
    """Reference block pool: ref counts, a free queue, and prefix-cache hashes."""

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks >= 2
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.ref[NULL_BLOCK] = NULL_BLOCK_GARBAGE_REFCNT
        self.hashed: set[int] = set()
        # The free queue, head first. Block 0 is never in it.
        self.queue: list[int] = list(range(1, num_blocks))

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """The pool's own free count (vLLM ``free_block_queue.num_free_blocks``)."""
        return len(self.queue)

    def get_new_blocks(self, n: int) -> list[int]:
        assert n <= len(self.queue), "caller checks capacity"
        out, self.queue = self.queue[:n], self.queue[n:]
        for b in out:
            assert self.ref[b] == 0, f"block {b} in free queue with ref {self.ref[b]}"
            self.hashed.discard(b)  # evict its cached prefix
            self.ref[b] += 1
        return out

    def touch(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref[b] == 0 and b in self.queue:
                self.queue.remove(b)
            self.ref[b] += 1

    def free_blocks(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.hashed:
                    self.queue.append(b)  # LRU tail: evicted last
                else:
                    self.queue.insert(0, b)

    def snapshot(self, *, walk_free_queue: bool) -> PoolSnapshot:
        in_q = set(self.queue)
        return PoolSnapshot(
            ref_counts=list(self.ref),
            cached=[b in self.hashed for b in range(self.num_blocks)],
            num_free_reported=len(self.queue),
            null_block_ids=frozenset({NULL_BLOCK}),
            in_free_queue=[b in in_q for b in range(self.num_blocks)] if walk_free_queue else None,
        )

    # ground truth ---------------------------------------------------------
    def count_states_truth(self) -> tuple[int, int]:
        """(free, cached) blocks by the pool alone: ref 0 and in the queue."""
        free = sum(1 for b in self.queue if b not in self.hashed)
        return free, len(self.queue) - free


@dataclass
class Req:
    rid: RequestId
    client_id: str
    phase: str = "waiting"  # waiting | running | finished
    blocks: list[int] = field(default_factory=list)
    """The engine's block table (one entry per reference)."""
    # What a real request carries and kvguard must never copy anywhere:
    prompt: str = PROMPT_SENTINEL
    prompt_token_ids: list[int] = field(default_factory=lambda: [TOKEN_SENTINEL, 1, 2])


@dataclass
class Leak:
    """Ground truth of a skipped free: who, why, how many blocks."""

    rid: RequestId
    client_id: str
    blocks: list[int]
    finished_at: float


class Harness:
    """The engine: changes the reference pool and feeds the ledger the hook events."""

    def __init__(self, num_blocks: int, *, lazy_claims: bool = False,
                 clock_start: float = 1_700_000_000.0) -> None:
        self.lazy_claims = lazy_claims
        """Like the real vLLM hooks: pool-level acquisitions are claimed only at the
        request's next transition (finish, preempt) or by an audit, not right away."""
        self.pool = RefPool(num_blocks)
        # Request ids look like vLLM's (``<client>-<8 hex>``): map them as its adapter does.
        self.ledger = OwnershipLedger(null_block_ids=(NULL_BLOCK,),
                                      client_id_of=client_request_id)
        self.reqs: dict[RequestId, Req] = {}
        self.t = clock_start
        """Unix time in seconds; every operation advances it (``tick``)."""
        self._ids = itertools.count()
        self.leaks: list[Leak] = []
        self.bumps: Counter[int] = Counter()
        self.num_finished_clean = 0
        self.finished_clean_by_reason: Counter[FinishReason] = Counter()
        self.double_freed: list[tuple[RequestId, int]] = []

    # clock --------------------------------------------------------------
    def tick(self, dt: float = 1.0) -> float:
        self.t += dt
        return self.t

    # views --------------------------------------------------------------
    def live(self) -> list[Req]:
        return [r for r in self.reqs.values() if r.phase != "finished"]

    def is_drained(self) -> bool:
        return not self.live()

    def hashed_candidates(self, req: Req) -> list[int]:
        """Blocks a prefix hit of ``req`` may touch (hashed, not already in its table)."""
        return sorted(b for b in self.pool.hashed if b not in req.blocks and self.pool.ref[b] >= 0)

    # lifecycle ----------------------------------------------------------
    def admit(self) -> Req:
        n = next(self._ids)
        rid = RequestId(f"req{n}-{n * 2654435761 % 2**32:08x}")
        req = Req(rid=rid, client_id=f"req{n}")
        self.reqs[rid] = req
        self.ledger.on_request_admitted(rid, self.tick())
        return req

    def allocate(self, req: Req, n: int, *, hash_mask: list[bool], attributed: bool) -> list[int]:
        """``allocate_slots`` -> ``get_new_blocks(n)``, then full blocks get a hash."""
        assert req.phase != "finished" and n <= self.pool.num_free
        self.tick()
        ids = self.pool.get_new_blocks(n)
        req.blocks.extend(ids)
        req.phase = "running"
        self.ledger.on_blocks_acquired(req.rid if attributed else None, ids, AcquireKind.ALLOCATE)
        if not attributed and not self.lazy_claims:
            self.ledger.claim(req.rid, req.blocks)
        for b, h in zip(ids, hash_mask, strict=False):
            if h:
                self.pool.hashed.add(b)
        return ids

    def prefix_hit(self, req: Req, blocks: list[int], *, attributed: bool) -> None:
        """``get_computed_blocks`` -> ``touch(blocks)``: share cached prefix blocks."""
        assert req.phase != "finished"
        assert all(b in self.pool.hashed and b not in req.blocks for b in blocks)
        self.tick()
        self.pool.touch(blocks)
        req.blocks.extend(blocks)
        req.phase = "running"
        self.ledger.on_blocks_acquired(
            req.rid if attributed else None, blocks, AcquireKind.PREFIX_HIT
        )
        if not attributed and not self.lazy_claims:
            self.ledger.claim(req.rid, req.blocks)

    def _claim_at_transition(self, req: Req) -> None:
        """The lifecycle hooks claim the request's table before its blocks move."""
        if self.lazy_claims:
            self.ledger.claim(req.rid, req.blocks)

    def _release(self, req: Req, *, attributed: bool) -> None:
        blocks, req.blocks = req.blocks, []
        self.pool.free_blocks(blocks)
        self.ledger.on_blocks_released(req.rid if attributed else None, blocks)

    def preempt(self, req: Req, *, attributed: bool) -> None:
        """``_preempt_request``: free everything, back to the waiting queue."""
        assert req.phase != "finished"
        self.tick()
        self._claim_at_transition(req)
        self.ledger.on_request_preempted(req.rid)
        self._release(req, attributed=attributed)
        req.phase = "waiting"

    def finish(
        self,
        req: Req,
        reason: FinishReason,
        *,
        attributed: bool,
        double_free_block: int | None = None,
    ) -> None:
        """Finish (stop, length, abort, error...) and free the request's blocks."""
        assert req.phase != "finished"
        at = self.tick()
        self._claim_at_transition(req)
        self.ledger.on_request_finished(req.rid, reason, at)
        if double_free_block is not None:
            assert double_free_block in req.blocks
        self._release(req, attributed=attributed)
        if double_free_block is not None:
            # FAULT: the same block is released a second time.
            self.pool.free_blocks([double_free_block])
            self.ledger.on_blocks_released(
                req.rid if attributed else None, [double_free_block]
            )
            self.double_freed.append((req.rid, double_free_block))
        self.ledger.on_request_freed(req.rid, at)
        req.phase = "finished"
        if double_free_block is None:
            self.num_finished_clean += 1
            self.finished_clean_by_reason[reason] += 1

    def abort(self, req: Req, *, attributed: bool) -> None:
        self.finish(req, FinishReason.ABORTED, attributed=attributed)

    def drain(
        self, *, attributed: bool = True, reason: FinishReason = FinishReason.STOPPED
    ) -> None:
        """Finish and free every live request: a drained moment follows."""
        for req in self.live():
            self.finish(req, reason, attributed=attributed)

    # faults -------------------------------------------------------------
    def skip_free_on_abort(self, req: Req, *, declare_freed: bool = True) -> Leak:
        """FAULT: the request is aborted, the engine forgets it, its blocks stay referenced."""
        assert req.phase != "finished"
        at = self.tick()
        self._claim_at_transition(req)
        self.ledger.on_request_finished(req.rid, FinishReason.ABORTED, at)
        if declare_freed:
            self.ledger.on_request_freed(req.rid, at)
        leak = Leak(req.rid, req.client_id, list(req.blocks), at)
        req.blocks = []  # the engine popped its block table without freeing it
        req.phase = "finished"
        if leak.blocks:
            self.leaks.append(leak)
        return leak

    def bump_candidates(self) -> list[int]:
        """Blocks a stray reference can land on (not held by a leaked request)."""
        leaked = {b for lk in self.leaks for b in lk.blocks}
        return [b for b in range(1, self.pool.num_blocks)
                if self.pool.ref[b] >= 0 and b not in leaked]

    def bump_ref(self, block: int) -> None:
        """FAULT: a reference taken outside every hooked path (no ledger event)."""
        self.tick()
        self.pool.touch([block])
        self.bumps[block] += 1

    # audit --------------------------------------------------------------
    def reconcile(
        self,
        *,
        walk_free_queue: bool = True,
        evidence: Evidence = Evidence.DRAINED,
        delayed_free_bound_seconds: float = 30.0,
    ) -> Reconciliation:
        snap = self.pool.snapshot(walk_free_queue=walk_free_queue)
        return reconcile(
            snap,
            self.ledger,
            ReconcileOptions(
                now=self.t,
                evidence=evidence,
                delayed_free_bound_seconds=delayed_free_bound_seconds,
            ),
        )

    def expected_drained_findings(self) -> tuple[dict[RequestId, int], set[int]]:
        """Ground truth at a drained moment (no double free).

        Returns the finished-request leaks (request -> blocks) and the orphaned
        block ids. A block a leaked request still references is charged to that
        request even if a stray reference also sits on it (table row "only
        finished owners").
        """
        held: dict[RequestId, int] = {}
        leaked_blocks: set[int] = set()
        for lk in self.leaks:
            held[lk.rid] = held.get(lk.rid, 0) + len(set(lk.blocks))
            leaked_blocks.update(lk.blocks)
        orphans = {b for b, n in self.bumps.items() if n and b not in leaked_blocks}
        return held, orphans


def build_report(
    rec: Reconciliation,
    *,
    checkpoint_id: int,
    taken_at: float,
    engine: str = "engine-0",
    epoch: str = "epoch-1",
    saturation_ratio: float = 0.8,
) -> CheckpointReport:
    """The package's own report builder, with test defaults for engine and epoch."""
    return checkpoint.build_report(rec, checkpoint_id=checkpoint_id, engine=engine,
                                   epoch=epoch, taken_at=taken_at,
                                   saturation_ratio=saturation_ratio)


# ------------------------------------------------------------ random workloads
def random_clean_ops(h: Harness, data: Any, n_ops: int, *, style: str = "attributed") -> None:
    """Draw ``n_ops`` healthy engine operations (hypothesis ``st.data()`` object).

    ``style``: ``attributed``, ``pool`` (pool-level hooks) or ``mixed``.
    """
    from hypothesis import strategies as st

    def attributed() -> bool:
        if style == "mixed":
            return bool(data.draw(st.booleans(), label="attributed"))
        return style == "attributed"

    for _ in range(n_ops):
        live = h.live()
        ops = ["admit"] if len(live) < 10 else []
        if live:
            ops.append("finish")
            if h.pool.num_free:
                ops.append("allocate")
            if any(h.hashed_candidates(r) for r in live):
                ops.append("prefix_hit")
            if any(r.blocks for r in live):
                ops.append("preempt")
        op = data.draw(st.sampled_from(ops), label="op")
        if op == "admit":
            h.admit()
            continue
        if op == "allocate":
            req = h.reqs[data.draw(st.sampled_from([r.rid for r in live]), label="req")]
            n = data.draw(st.integers(1, min(4, h.pool.num_free)), label="n")
            mask = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="hashed")
            h.allocate(req, n, hash_mask=mask, attributed=attributed())
        elif op == "prefix_hit":
            rids = [r.rid for r in live if h.hashed_candidates(r)]
            req = h.reqs[data.draw(st.sampled_from(rids), label="req")]
            blocks = data.draw(st.lists(st.sampled_from(h.hashed_candidates(req)), min_size=1,
                                        max_size=4, unique=True), label="hit")
            h.prefix_hit(req, blocks, attributed=attributed())
        elif op == "preempt":
            rids = [r.rid for r in live if r.blocks]
            h.preempt(h.reqs[data.draw(st.sampled_from(rids), label="req")],
                      attributed=attributed())
        else:
            req = h.reqs[data.draw(st.sampled_from([r.rid for r in live]), label="req")]
            reason = data.draw(st.sampled_from([FinishReason.STOPPED, FinishReason.LENGTH,
                                                FinishReason.ABORTED, FinishReason.ERROR]),
                               label="reason")
            h.finish(req, reason, attributed=attributed())


class HarnessPoolAccess:
    """The online audit's view of a ``Harness`` (what the vLLM adapter reads from vLLM)."""

    def __init__(self, h: Harness) -> None:
        self.h = h

    @property
    def num_blocks(self) -> int:
        return self.h.pool.num_blocks

    @property
    def null_block_ids(self) -> frozenset[int]:
        return frozenset({NULL_BLOCK})

    def read(self, lo: int, hi: int) -> PoolSlice:
        p = self.h.pool
        in_q = set(p.queue)
        out_of_queue = sum(1 for b in range(lo, hi) if b not in in_q)
        return PoolSlice(p.ref[lo:hi], [b in p.hashed for b in range(lo, hi)], out_of_queue)

    def in_free_queue(self, lo: int, hi: int) -> list[bool]:
        in_q = set(self.h.pool.queue)
        return [b in in_q for b in range(lo, hi)]

    def request_ids(self) -> list[str]:
        return [r.rid for r in self.h.reqs.values() if r.phase != "finished" and r.blocks]

    def request_blocks(self, request_id: str) -> list[int]:
        return list(self.h.reqs[RequestId(request_id)].blocks)

    def num_free(self) -> int:
        return self.h.pool.num_free


class RefAdapter:
    """The reference engine adapter (``kvguard.core.engine.EngineAdapter``) over a ``Harness``.

    What ``VllmAdapter`` is to vLLM: the session reads the reference pool, its block tables
    and what is in flight through it. Finished requests never linger (no delayed frees).
    """

    def __init__(self, h: Harness) -> None:
        self.h = h
        self._pool = HarnessPoolAccess(h)

    @property
    def identity(self) -> EngineIdentity:
        return EngineIdentity(kind="reference", version="1", default_name="ref0")

    @property
    def pool(self) -> HarnessPoolAccess:
        return self._pool

    def read_pool(self) -> PoolSnapshot:
        return self.h.pool.snapshot(walk_free_queue=True)

    def request_tables(self) -> dict[str, list[int]]:
        return {r.rid: list(r.blocks) for r in self.h.live() if r.blocks}

    def activity(self) -> EngineActivity:
        live = self.h.live()
        return EngineActivity(running=sum(1 for r in live if r.phase == "running"),
                              waiting=sum(1 for r in live if r.phase == "waiting"),
                              deferred_frees=0, unfinished=None)

    def has_live_work(self) -> bool:
        act = self.activity()
        return bool(act.running or act.waiting)

    def finished_requests(self) -> dict[str, FinishReason]:
        return {}

    def client_request_id(self, request_id: str) -> str:
        return client_request_id(request_id)

    def hold_bound(self) -> HoldBound:
        return HoldBound(30.0, "reference default")

    def kv_transfers(self) -> None:
        return None

    def offload_source(self) -> None:
        return None

    def faults_enabled(self) -> list[str]:
        return []
