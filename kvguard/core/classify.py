"""The one block classifier: a block's state and what, if anything, is wrong with it.

Both audits judge a block with :func:`classify_block`: the drained checkpoint
(``kvguard.core.reconciler``) and the online audit between engine steps
(``kvguard.core.online``). They differ only in *when* they look, which the
:class:`HoldRule` states; the table is the same, so they cannot disagree about
a block they both see.

Per block, with ``rc`` its ref count and ``owners`` the ledger's references:

=======================================  ==================  ====================
condition                                state               charge (cause)
=======================================  ==================  ====================
rc == 0, no owners, in the free queue    free / cached       --
rc == 0, not in the free queue           orphaned            orphan (unreachable)
rc == 0 but owners, or rc < 0            free/cached/orph.   double_free
rc > 0 but in the free queue             by owners           double_free
rc > 0, a live owner                     active              refcount_drift if rc
                                                             != sum of owner refs
rc > 0, only finished owners             held_by_finished    finished_request, one
                                                             per owner past its
                                                             legitimate hold
rc > 0, only unclaimed references        orphaned (active    orphan (prefix_hit /
                                         between steps when  rollback path)
                                         they explain rc)
rc > 0, no owner, after a bad release    orphaned            refcount_drift
rc > 0, no owner                         orphaned            orphan
=======================================  ==================  ====================

A finished request's hold is *legitimate* (no charge) while
:func:`hold_is_legitimate` says so; that is the only rule for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvguard.core.ledger import DoubleFreeEvent, OwnershipLedger, RequestRecord
from kvguard.core.types import (
    AcquireKind,
    BlockId,
    BlockState,
    LeakCause,
    LeakPath,
    RequestId,
)

Fingerprint = tuple[object, ...]
"""What a suspect block looked like at one audit; equal at two audits = confirmed."""


@dataclass(frozen=True, slots=True)
class HoldRule:
    """When an audit looks, which decides how long a finished request may hold blocks.

    ``now`` is Unix time in seconds; ``bound_seconds`` the longest legitimate delayed
    (or, between steps, deferred) free. ``between_steps``: the online audit, where a step
    may be in flight, so a deferred free and a reference not claimed yet are normal
    for a while; at a drained checkpoint neither is.
    """

    now: float
    bound_seconds: float
    between_steps: bool = False
    deadline_grace_seconds: float = 5.0
    """After a connector's own deadline for a hold (:attr:`RequestRecord.hold_deadline`),
    how long the engine may take to give the blocks back: the connector reports the end
    of a hold at its next step, and the engine frees at that step's update."""


@dataclass(frozen=True, slots=True)
class Charge:
    """One culprit of one block: a finding of ``cause`` for ``request_id`` on ``path``."""

    cause: LeakCause
    request_id: RequestId | None
    path: LeakPath
    detail: str


@dataclass(frozen=True, slots=True)
class BlockJudgement:
    """A block's state and its charges (none: the block is consistent)."""

    state: BlockState
    charges: tuple[Charge, ...] = ()
    fingerprint: Fingerprint | None = None
    """Set when ``charges`` is not empty: the inputs the charges rest on. Two audits
    with the same fingerprint saw the same situation (the online audit's confirmation)."""

    @property
    def suspect(self) -> bool:
        return bool(self.charges)


def hold_is_legitimate(rec: RequestRecord, rule: HoldRule) -> bool:
    """A finished request's hold that is not a leak yet: a delayed free (KV transfer in
    flight) younger than the bound, and between steps also a deferred free that began
    less than the bound ago. At a drained checkpoint no step is in flight, so a deferred
    free still holding is a leak.

    Where the KV connector exposes its own deadline for the hold (a NIXL lease, renewed
    while the decode side keeps the request), that deadline replaces the bound: the hold
    is legitimate while it is alive, plus ``deadline_grace_seconds``, and a finding once
    it has lapsed without a release."""
    until = hold_legitimate_until(rec, rule)
    return until is not None and rule.now < until


def hold_legitimate_until(rec: RequestRecord, rule: HoldRule) -> float | None:
    """When (Unix seconds) ``rec``'s hold stops being legitimate under ``rule``, or None
    when it is no hold the rule allows at all. The one rule behind
    :func:`hold_is_legitimate` (legitimate exactly while ``rule.now`` is before this); an
    idle engine is woken at this moment to judge the drain the hold blocked."""
    if rec.delayed_free_pending and rec.hold_deadline is not None:
        return rec.hold_deadline + rule.deadline_grace_seconds
    if rec.delayed_free_pending and rec.delayed_free_started_at is not None:
        return rec.delayed_free_started_at + rule.bound_seconds
    if rule.between_steps and rec.deferred_free_pending:
        started = rec.finished_at if rec.finished_at is not None else rule.now
        return started + rule.bound_seconds
    return None


def _held_detail(rec: RequestRecord, rule: HoldRule) -> str:
    if rec.freed_at is not None:
        return "finished and freed, still holds its blocks"
    if rec.delayed_free_pending and rec.hold_deadline is not None:
        ago = rule.now - rec.hold_deadline
        source = rec.hold_source or "the connector's deadline"
        return (f"kept for a KV transfer whose hold ended {ago:.0f} s ago ({source}); the "
                "blocks were not released")
    if rec.waited_for_remote_kv:
        return (f"finished while waiting for its KV from {rec.remote_peer or 'a remote engine'}"
                "; its blocks are still held past the bound")
    return "finished, blocks not freed yet"


def _owner_key(owners: Mapping[RequestId, int]) -> tuple[tuple[str, int], ...]:
    return tuple(sorted(owners.items()))


def _judged(state: BlockState, charges: list[Charge], *key: object) -> BlockJudgement:
    if not charges:
        return BlockJudgement(state)
    causes = tuple(sorted({c.cause.value for c in charges}))
    return BlockJudgement(state, tuple(charges), (state.value, causes, *key))


def classify_block(
    b: BlockId,
    rc: int,
    is_cached: bool,
    in_free_queue: bool | None,
    ledger: OwnershipLedger,
    rule: HoldRule,
    double_free: DoubleFreeEvent | None = None,
) -> BlockJudgement:
    """Judge block ``b`` (ref count ``rc``) against ``ledger``; pure, changes nothing.

    ``in_free_queue``: the block's membership of the pool's free queue, ``None`` when the
    reader did not walk it (then a zero ref count is taken as reachable).
    ``double_free``: the ledger's latest release of an unheld reference on ``b``.
    """
    owners = ledger.owners_of(b)
    unattr = ledger.unattributed_refs(b)
    okey = _owner_key(owners)
    culprit = double_free.request_id if double_free is not None else None
    culprit_path = double_free.path if double_free is not None else LeakPath.UNKNOWN

    if rc <= 0:
        reachable = in_free_queue is not False and rc == 0
        state = (BlockState.CACHED if is_cached else BlockState.FREE) if reachable \
            else BlockState.ORPHANED
        if rc < 0 or owners or unattr:
            holders = [r.client_request_id for r in
                       (ledger.record(rid) for rid in owners) if r is not None]
            victims = ", ".join(holders) or "an unattributed reference"
            detail = (f"ref_cnt {rc} while still held by {victims}" if rc == 0
                      else f"ref_cnt {rc}: freed more times than acquired")
            return _judged(state, [Charge(LeakCause.DOUBLE_FREE, culprit, culprit_path,
                                          detail)], rc, okey, unattr)
        if not reachable:
            return _judged(state, [Charge(
                LeakCause.ORPHAN, None, LeakPath.UNKNOWN,
                "ref_cnt 0 but not in the free queue: the block can never be allocated "
                "again")], rc)
        return BlockJudgement(state)

    recs = [r for r in (ledger.record(rid) for rid in owners) if r is not None]
    live = [r for r in recs if r.phase.is_live]
    finished = [r for r in recs if not r.phase.is_live]
    if in_free_queue:
        state = BlockState.ACTIVE if live else \
            BlockState.HELD_BY_FINISHED if finished else BlockState.ORPHANED
        return _judged(state, [Charge(LeakCause.DOUBLE_FREE, culprit, culprit_path,
                                      f"ref_cnt {rc} but the block is in the free queue")],
                       rc, okey, unattr)
    expected = sum(owners.values()) + unattr
    if live:
        if expected == rc:
            return BlockJudgement(BlockState.ACTIVE)
        return _judged(BlockState.ACTIVE, [Charge(
            LeakCause.REFCOUNT_DRIFT, live[0].request_id, LeakPath.UNKNOWN,
            f"ref_cnt {rc} but {expected} known references")], rc, expected, okey)
    if finished:
        charges = [Charge(LeakCause.FINISHED_REQUEST, r.request_id, r.exit_path,
                          _held_detail(r, rule))
                   for r in finished if not hold_is_legitimate(r, rule)]
        return _judged(BlockState.HELD_BY_FINISHED, charges, rc, okey)
    if unattr:
        kind = ledger.unattributed_kind(b)
        path = LeakPath.PREFIX_HIT if kind is AcquireKind.PREFIX_HIT else LeakPath.ROLLBACK
        # Between steps a reference no request has claimed yet may be a live allocation
        # the next claim phase names; its serial makes it confirm only if it stays so.
        state = BlockState.ACTIVE if rule.between_steps and unattr == rc \
            else BlockState.ORPHANED
        return _judged(state, [Charge(
            LeakCause.ORPHAN, None, path,
            f"ref_cnt {rc}, taken by a {kind.value if kind else 'pool'} call that no "
            "request claimed")], rc, unattr, ledger.unattributed_serial(b))
    if double_free is not None:
        return _judged(BlockState.ORPHANED, [Charge(
            LeakCause.REFCOUNT_DRIFT, culprit, culprit_path,
            f"ref_cnt {rc} after a release of an unheld reference")], rc)
    return _judged(BlockState.ORPHANED, [Charge(
        LeakCause.ORPHAN, None, LeakPath.UNKNOWN,
        f"ref_cnt {rc} and no known owner: a reference was taken outside every hooked "
        "path")], rc)
