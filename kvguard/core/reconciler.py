"""Put every usable block in exactly one state and name what is wrong with it.

The reconciler compares three things: the pool's ref counts (what the engine
does), the ledger's owners (what kvguard saw happen) and the pool's own free
count (what the engine believes). It reconciles from *state*, not from events
alone: a reference taken by a path no hook sees (a connector bound to the pool,
a copy-on-write pair, a bug) still shows up as a ref count nobody owns.

Each block is judged by the one classifier both audits share
(:func:`kvguard.core.classify.classify_block`, whose docstring has the table);
this module walks the pool quickly and groups the charges into findings.

Findings are grouped per (cause, request) so a leak of 5 blocks by one request
is one finding of 5 blocks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, compress, repeat
from operator import eq, itemgetter, ne
from typing import cast

from kvguard.core.classify import BlockJudgement, Charge, HoldRule, classify_block
from kvguard.core.findings import Finding, Reconciliation
from kvguard.core.ledger import DoubleFreeEvent, OwnershipLedger, RequestRecord
from kvguard.core.report import PoolReport
from kvguard.core.snapshot import PoolSnapshot, count_falsy
from kvguard.core.types import (
    BlockId,
    BlockState,
    Evidence,
    LeakCause,
    LeakPath,
    RequestId,
    RequestPhase,
)


@dataclass(frozen=True, slots=True)
class ReconcileOptions:
    """How to judge holds that may be legitimate."""

    now: float
    """Unix time of the audit, in seconds."""
    delayed_free_bound_seconds: float = 30.0
    """A finished request may hold its blocks this long while its KV transfer completes."""
    evidence: Evidence = Evidence.DRAINED

    @property
    def hold_rule(self) -> HoldRule:
        return HoldRule(now=self.now, bound_seconds=self.delayed_free_bound_seconds,
                        between_steps=self.evidence is Evidence.ONLINE)


_GroupKey = tuple[LeakCause, RequestId | None, LeakPath]


class _Collector:
    def __init__(self, opts: ReconcileOptions, ledger: OwnershipLedger) -> None:
        self.opts = opts
        self.ledger = ledger
        self.groups: dict[_GroupKey, Finding] = {}

    def add(self, charge: Charge, block_id: int) -> None:
        key = (charge.cause, charge.request_id, charge.path)
        f = self.groups.get(key)
        if f is None:
            rid = charge.request_id
            f = Finding(cause=charge.cause, path=charge.path, blocks=0, request_id=rid,
                        detail=charge.detail, evidence=self.opts.evidence)
            rec = self.ledger.record(rid) if rid is not None else None
            if rid is not None:
                f.client_request_id = rec.client_request_id if rec is not None \
                    else self.ledger.client_id_of(rid)
            if rec is not None:
                f.finish_reason = rec.finish_reason
                if rec.finished_at is not None:
                    f.held_for_seconds = max(0.0, self.opts.now - rec.finished_at)
            self.groups[key] = f
        f.add_block(block_id)

    def judged(self, b: int, j: BlockJudgement) -> None:
        for charge in j.charges:
            self.add(charge, b)


def reconcile(
    snapshot: PoolSnapshot, ledger: OwnershipLedger, opts: ReconcileOptions
) -> Reconciliation:
    """Classify every usable block of ``snapshot`` against ``ledger``. Pure: changes neither."""
    refs = snapshot.ref_counts
    cached = snapshot.cached
    free_q = snapshot.in_free_queue
    nulls = snapshot.null_block_ids
    counts = {s: 0 for s in BlockState}
    out = _Collector(opts, ledger)
    double_free_by_block: dict[int, DoubleFreeEvent] = {e.block_id: e for e in ledger.double_frees}
    finished = RequestPhase.FINISHED
    records = list(ledger.records())
    done = [r for r in records if r.phase is finished]

    if free_q is not None:
        interesting = set(ledger.owned_block_ids()) | double_free_by_block.keys()
        n_zero = _walk_every_block(refs, cached, free_q, nulls, interesting, ledger,
                                   double_free_by_block, counts, out)
    else:
        n_zero = _classify_sparse(refs, cached, nulls, ledger, done,
                                  double_free_by_block, counts, out, snapshot.zero_refs,
                                  snapshot.cached_unreferenced)

    pool_level: list[Finding] = []
    if free_q is None and snapshot.num_free_reported != n_zero:
        # Blocks with ref_cnt < 0 sit in the free queue and already have their own
        # double_free findings: they explain that much of the excess.
        n_negative = sum(1 for b, rc in enumerate(refs) if rc < 0 and b not in nulls)
        diff = snapshot.num_free_reported - n_zero
        unexplained = diff - n_negative if diff > 0 else diff
        if unexplained:
            cause = LeakCause.DOUBLE_FREE if unexplained > 0 else LeakCause.ORPHAN
            pool_level.append(Finding(
                cause=cause, path=LeakPath.UNKNOWN, blocks=abs(unexplained),
                evidence=opts.evidence,
                detail=f"the pool reports {snapshot.num_free_reported} free blocks but "
                       f"{n_zero} have ref_cnt 0"))

    holders = sum(1 for r in done if r.blocks)
    findings = list(out.groups.values())
    findings.extend(pool_level)
    findings.sort(key=lambda f: (f.cause.value, -(f.blocks), f.request_id or ""))
    states = PoolReport.from_counts(capacity=snapshot.capacity, counts=counts,
                                    num_free_reported=snapshot.num_free_reported)
    return Reconciliation(
        states=states,
        findings=findings,
        finished_requests_holding=holders,
        num_free_observed=n_zero,
    )


def _walk_every_block(
    refs: Sequence[int], cached: Sequence[object], free_q: Sequence[int],
    nulls: frozenset[int],
    interesting: set[int], ledger: OwnershipLedger, dbl: dict[int, DoubleFreeEvent],
    counts: dict[BlockState, int], out: _Collector,
) -> int:
    """Per-block path, used when the free queue was walked: checks each block's membership."""
    n_free = n_cached = n_zero = 0
    for b, rc in enumerate(refs):
        if b in nulls:
            continue
        if rc == 0 and b not in interesting:
            n_zero += 1
            if not free_q[b]:  # unreachable: the classifier words it
                _classify(BlockId(b), rc, bool(cached[b]), False, ledger, None, counts, out)
            elif cached[b]:
                n_cached += 1
            else:
                n_free += 1
            continue
        if rc == 0:
            n_zero += 1
        _classify(BlockId(b), rc, bool(cached[b]), bool(free_q[b]), ledger, dbl.get(b),
                  counts, out)
    counts[BlockState.FREE] += n_free
    counts[BlockState.CACHED] += n_cached
    return n_zero


def _classify_sparse(
    refs: Sequence[int], cached: Sequence[object], nulls: frozenset[int],
    ledger: OwnershipLedger, done: list[RequestRecord],
    dbl: dict[int, DoubleFreeEvent], counts: dict[BlockState, int], out: _Collector,
    zero_refs: int | None = None, cached_unreferenced: int | None = None,
) -> int:
    """Fast path: Python work only for blocks that may be wrong, C-level passes for the rest.

    A *clean* block is held by exactly one live request with one reference, has no
    unattributed reference and no double free, and its ref count is 1: it is counted
    ``active`` with nothing more to say. Clean blocks (most of a busy pool) are found
    and checked with C-level passes (gathers by ``itemgetter``, ``compress``,
    ``list.count``); plain free and cached blocks (most of a drained pool) are only
    counted. Blocks with a non-zero ref count that nobody owns (orphans) are searched
    for only when the counts say some exist: the pool's non-zero ref counts must equal
    the clean blocks plus the non-zero ones among the blocks judged one by one.

    ``cached_unreferenced`` (the reader's count of cached blocks with ref count 0, null
    blocks included) spares every pass over ``cached``: it is then read only for the
    blocks judged one by one. Without it, cached blocks are counted from ``cached`` and
    the clean blocks' entries are gathered.
    """
    n = len(refs)
    # Block ids are plain ints and request ids plain strs at run time (NewType).
    owners = cast(Mapping[int, object], ledger.owners_map())
    unattributed = cast(Mapping[int, int], ledger.unattributed_map())
    slow: set[int] = set(chain.from_iterable([r.blocks for r in done]))
    slow.update(unattributed.keys(), dbl.keys())
    # Several owners or references (prefix sharing): judged one by one.
    slow.update(ledger.shared_block_ids())
    # Every owned block that is not slow has exactly one owner, a live request, holding
    # one reference. They are checked through gathers over all the ledger's owner keys,
    # corrected for the few owned blocks judged one by one (``excluded``), so neither a
    # walk over the records' tables nor a set difference over 40 % of the pool is built.
    owned: list[int] = list(owners)
    excluded = {b for b in slow if b in owners}
    excluded.update(b for b in nulls if b in owners)
    try:
        held = _gather(refs, owned) if owned else ()
    except IndexError:  # the ledger names blocks the pool does not have: not judged
        owned = [b for b in owned if b < n]
        excluded = {b for b in excluded if b < n}
        held = _gather(refs, owned) if owned else ()
    clean: list[int] | None = None  # None: every owned block but the excluded ones
    active = len(owned) - len(excluded)
    counted = cached_unreferenced is not None
    cached_nonzero = 0  # cached blocks with a non-zero ref count (only when not counted)
    if held.count(1) - sum(1 for b in excluded if refs[b] == 1) == active:
        if not counted and owned:
            cached_owned = len(owned) - count_falsy(_gather(cached, owned))
            cached_nonzero = cached_owned - sum(1 for b in excluded if cached[b])
    else:  # drift: judged one by one
        single = [b for b in owned if b not in excluded]
        held = _gather(refs, single) if single else ()
        clean = list(compress(single, map(eq, held, repeat(1))))
        slow.update(compress(single, map(ne, held, repeat(1))))
        active = len(clean)
        if not counted and clean:
            cached_nonzero = active - count_falsy(_gather(cached, clean))

    zeros = refs.count(0) if zero_refs is None else zero_refs
    nonzero = n - zeros - sum(1 for b in nulls if b < n and refs[b] != 0)
    nonzero_slow = sum(1 for b in slow if b < n and b not in nulls and refs[b] != 0)
    if nonzero != active + nonzero_slow:  # referenced blocks nobody owns: find them
        clean_ids = clean if clean is not None else set(owned).difference(excluded)
        slow.update(set(compress(range(n), refs)).difference(clean_ids))
    slow.difference_update(nulls)

    n_zero = zeros - sum(1 for b in nulls if b < n and refs[b] == 0)
    zero_done = cached_done = 0
    for b in sorted(slow):  # block order: findings list block ids in order
        if b >= n:
            continue
        rc = refs[b]
        is_cached = bool(cached[b])  # read once: ``cached`` may read the block itself
        if rc == 0:
            zero_done += 1
            cached_done += is_cached
        elif is_cached:
            cached_nonzero += 1
        _classify(BlockId(b), rc, is_cached, None, ledger, dbl.get(b), counts, out)
    counts[BlockState.ACTIVE] += active
    if cached_unreferenced is not None:
        n_cached = cached_unreferenced - cached_done - sum(
            1 for b in nulls if b < n and refs[b] == 0 and cached[b])
    else:
        cached_total = n - count_falsy(cached) - sum(1 for b in nulls if b < n and cached[b])
        n_cached = cached_total - cached_nonzero - cached_done
    counts[BlockState.CACHED] += n_cached
    counts[BlockState.FREE] += n_zero - zero_done - n_cached
    return n_zero


def _gather(seq: Sequence[object] | Mapping[int, object], idx: list[int]) -> tuple[object, ...]:
    """``tuple(seq[i] for i in idx)`` at C speed (``idx`` non-empty)."""
    if len(idx) == 1:
        return (seq[idx[0]],)
    return cast(tuple[object, ...], itemgetter(*idx)(seq))


def judge_block(
    b: BlockId, rc: int, is_cached: bool, in_free_queue: bool | None,
    ledger: OwnershipLedger, opts: ReconcileOptions,
) -> list[Finding]:
    """The findings of one block alone (one per culprit), as a full audit would state them."""
    out = _Collector(opts, ledger)
    dbl = ledger.latest_double_free(b)
    out.judged(b, classify_block(b, rc, is_cached, in_free_queue, ledger, opts.hold_rule, dbl))
    return list(out.groups.values())


def _classify(
    b: BlockId,
    rc: int,
    is_cached: bool,
    in_free_queue: bool | None,
    ledger: OwnershipLedger,
    double_free: DoubleFreeEvent | None,
    counts: dict[BlockState, int],
    out: _Collector,
) -> None:
    j = classify_block(b, rc, is_cached, in_free_queue, ledger, out.opts.hold_rule, double_free)
    counts[j.state] += 1
    out.judged(b, j)
