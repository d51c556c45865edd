"""What the session does without some engine events, so that what it still judges stays right.

An engine integration that cannot hook a method (a vLLM nobody tested renamed it) turns
the matching flag of :class:`EventsSeen` off before the first event. The session then
makes up, from what the engine itself holds, for what the ledger would have learnt:

* ``pool_events`` off (no pool hook at all: one missing hook would leave the stream
  incomplete, and a release never seen reads as a double free): the ledger learns
  blocks from the engine's tables only (claims at finish, preemption and audits), and
  a request's references are given back when the engine frees or preempts it, trusting
  its free. Off with it: double-free evidence, and the naming of the request that held a
  leaked block (a block still referenced in the pool and in no table is still found, as
  an orphan).
* ``admissions`` off: a request first met at a claim is adopted there.
* ``finishes`` or ``frees`` off: at each drained audit, every record of a request the
  engine no longer holds is settled: finished (reason unknown) and freed. Without it a
  request the engine dropped without freeing would look live (its leak hidden), and the
  records of finished requests would pile up.

Imports neither vLLM nor torch.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from kvguard.core.ledger import OwnershipLedger
from kvguard.core.types import FinishReason, RequestPhase


@dataclass(slots=True)
class EventsSeen:
    """Which engine events the integration delivers (all True on a tested engine)."""

    pool_events: bool = True
    """Blocks acquired and released, as the pool moves them."""
    admissions: bool = True
    finishes: bool = True
    """A request finishing, with its reason."""
    frees: bool = True
    """The engine done with a finished request (delayed frees end here)."""

    @property
    def settles_at_audit(self) -> bool:
        """Whether drained audits settle records first (:func:`settle_records`)."""
        return not (self.finishes and self.frees)


def settle_records(ledger: OwnershipLedger, held: AbstractSet[str], seen: EventsSeen,
                   now: float) -> int:
    """At a drained moment: mark finished (``seen.finishes`` off) and freed (``seen.frees``
    off) every record whose request the engine no longer keeps (``held``: the finished
    requests it keeps, e.g. for a delayed free; a block table left behind does not count,
    it is what a leak looks like). A record still holding blocks stays, as
    evidence; its request is then finished, and its blocks judged like any finished
    request's. Returns the records settled. ``now``: Unix s."""
    settled = 0
    for rec in list(ledger.records()):
        rid = rec.request_id
        if rid in held:
            continue
        touched = False
        if not seen.finishes and rec.phase is not RequestPhase.FINISHED:
            ledger.on_request_finished(rid, FinishReason.UNKNOWN, now)
            ledger.compact(rid)  # freed already (the free was seen), nothing held: gone
            touched = True
        if not seen.frees and rec.phase is RequestPhase.FINISHED and rec.freed_at is None:
            ledger.on_request_freed(rid, now)
            touched = True
        settled += touched
    return settled
