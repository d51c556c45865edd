"""Dead owners: who holds blocks and will never give them back on its own.

Read from what kvguard already keeps, never from the pool itself:

* the ledger's finished requests that still hold blocks past their legitimate hold
  (:func:`~kvguard.core.classify.hold_is_legitimate`, the between-steps rule: a delayed
  or deferred free within its bound is alive, not dead);
* the offload audit's stuck jobs (their requests' blocks);
* the online audit's confirmed orphans and ref-count drift (blocks nobody owns).

Only blocks no live request also holds are counted (a prefix-shared block comes back
only when its live owner is done, so it is not dead). Cost: one pass over the finished
requests that hold blocks, the stuck jobs and the confirmed blocks; the wedge monitor
calls it only when requests have waited past its thresholds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvguard.core.classify import HoldRule, hold_is_legitimate
from kvguard.core.ledger import OwnershipLedger, RequestRecord
from kvguard.core.types import BlockId, LeakCause, LeakPath, RequestId
from kvguard.core.wedge import DeadOwner, DeadOwnerKind

_HOLD_KINDS = {LeakPath.DELAYED_FREE: DeadOwnerKind.DELAYED_FREE,
               LeakPath.REMOTE_KV_WAIT: DeadOwnerKind.DELAYED_FREE}
_AUDIT_KINDS = {LeakCause.ORPHAN: DeadOwnerKind.ORPHAN,
                LeakCause.REFCOUNT_DRIFT: DeadOwnerKind.REFCOUNT_DRIFT}


def _live_shared(ledger: OwnershipLedger, block: BlockId) -> bool:
    for rid in ledger.owners_of(block):
        rec = ledger.record(rid)
        if rec is not None and rec.phase.is_live:
            return True
    return False


def _own_dead_blocks(ledger: OwnershipLedger, rec: RequestRecord) -> frozenset[int]:
    return frozenset(int(b) for b in rec.blocks if not _live_shared(ledger, b))


def dead_owners(ledger: OwnershipLedger, *, now: float, bound_seconds: float,
                stuck_offload_requests: Iterable[str] = (),
                confirmed_causes: Mapping[int, Iterable[LeakCause]] | None = None,
                ) -> list[DeadOwner]:
    """Every dead owner now (Unix s ``now``; ``bound_seconds``: the delayed-free bound).

    ``stuck_offload_requests``: internal ids of requests whose offload job is stuck.
    ``confirmed_causes``: block -> causes the online audit confirmed on it.
    """
    rule = HoldRule(now=now, bound_seconds=bound_seconds, between_steps=True)
    out: list[DeadOwner] = []
    seen: set[RequestId] = set()
    for rec in ledger.finished_holding():
        if hold_is_legitimate(rec, rule):
            continue
        ids = _own_dead_blocks(ledger, rec)
        if ids:
            seen.add(rec.request_id)
            held = None if rec.finished_at is None else max(0.0, now - rec.finished_at)
            out.append(DeadOwner(_HOLD_KINDS.get(rec.exit_path, DeadOwnerKind.FINISHED_REQUEST),
                                 rec.client_request_id, ids, held, rec.request_id))
    for rid in stuck_offload_requests:
        off = ledger.record(RequestId(rid))
        if off is None or off.request_id in seen or not off.blocks:
            continue
        # The job's own request waits on it: its blocks come back only with the job.
        seen.add(off.request_id)
        out.append(DeadOwner(DeadOwnerKind.OFFLOAD_JOB, off.client_request_id,
                             frozenset(int(b) for b in off.blocks),
                             engine_request_id=off.request_id))
    by_kind: dict[DeadOwnerKind, set[int]] = {}
    for block, causes in (confirmed_causes or {}).items():
        for cause in causes:
            kind = _AUDIT_KINDS.get(cause)
            if kind is not None:
                by_kind.setdefault(kind, set()).add(block)
    for kind, blocks in sorted(by_kind.items()):
        out.append(DeadOwner(kind, None, frozenset(blocks)))
    return out
