"""Opt-in reclaim as a monitor: dead owners named at N consecutive wedge verdicts get their
blocks back through the engine's own free path (``KVGUARD_RECLAIM``; a safety valve, not a
fix: the missing free is still a bug to repair).

Watches: the wedge monitor's judgments (:class:`~kvguard.core.wedge_monitor.WedgeMonitor`,
``last`` and ``last_owners``), at every step end after the wedge monitor ran. An owner
(a finished request whose free never came, a delayed or deferred free past its bound)
named by ``after_verdicts`` consecutive wedge verdicts is handed, once per wedge, to the
engine's :class:`Reclaimer`, which re-checks every block against the pool at that moment
and frees it exactly as the missing free would have, on the engine thread, between steps.
Never reclaimed: orphans and ref-count drift (no owner is known: refused as
``owner_unknown``), an offload job (its fence holds the blocks: ``fenced``). A reclaim the
engine side finds unsafe (no free path in this engine version, an owner that came back to
life, a block whose references changed) is refused, counted and listed.

Adds: the ``reclaim`` section of the published state (:class:`ReclaimState`: blocks
reclaimed per cause, refusals per reason, the latest reclaims and refusals with request id,
cause, block count and ids, never prompt text or token ids); the sidecar turns it into
``kvguard_reclaimed_blocks_total{cause}`` and ``kvguard_reclaims_refused_total{reason}``,
``/v1/report`` and ``kvguard report --json`` list it. Each reclaim and refusal is logged.

Cost per step: nothing while off (the monitor is not attached); while on, one attribute
read and one identity comparison per step when no new wedge judgment was made (nothing
waits, or the stall is below the wedge thresholds); the per-owner work runs only at a
wedge judgment (at most every 0.5 s). A failure is counted under hook ``reclaim`` (not a
ledger-safe hook: a free path that raised half-way makes the session distrust its ledger
until rebuilt) and the engine goes on.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Hashable

from kvguard.config import KvguardConfig
from kvguard.core.monitor import BaseMonitor, MonitorHost, StateSection
from kvguard.core.reclaim import (
    MAX_LISTED,
    ReclaimEntry,
    Reclaimer,
    ReclaimOutcome,
    ReclaimState,
    RefusalReason,
)
from kvguard.core.wedge import DeadOwner, DeadOwnerKind, WedgeVerdict
from kvguard.core.wedge_monitor import WedgeMonitor

log = logging.getLogger("kvguard")

_NEVER_RECLAIMED = {DeadOwnerKind.ORPHAN, DeadOwnerKind.REFCOUNT_DRIFT}
"""No owner is known: nothing says which free path would have given the blocks back."""


def _key(owner: DeadOwner) -> Hashable:
    """One dead ownership across verdicts: a request by its engine id, an unknown owner by
    its blocks."""
    if owner.engine_request_id is not None:
        return (owner.kind, owner.engine_request_id)
    return (owner.kind, owner.block_ids)


class ReclaimWatch(BaseMonitor):
    """Reclaims dead ownerships named at ``after_verdicts`` consecutive wedge verdicts.
    Not thread-safe (engine thread only)."""

    name = "reclaim"

    def __init__(self, host: MonitorHost, wedge: WedgeMonitor, reclaimer: Reclaimer,
                 after_verdicts: int = 3) -> None:
        self.host = host
        self.wedge = wedge
        self.reclaimer = reclaimer
        self.after_verdicts = after_verdicts
        self.reclaims_total = 0
        self.reclaimed_blocks: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.recent: deque[ReclaimEntry] = deque(maxlen=MAX_LISTED)
        self._seen: WedgeVerdict | None = None
        self._streak: dict[Hashable, int] = {}
        """Ownership -> consecutive wedge verdicts that named it (up to the last one)."""
        self._handled: set[Hashable] = set()
        """Ownerships reclaimed or refused during the current wedge (each once)."""

    def after_drain_check(self, step_seconds: float | None) -> None:
        verdict = self.wedge.last
        if verdict is self._seen:  # the per-step cost: no new judgment since the last step
            return
        try:
            self._judged(verdict)
        except Exception as exc:
            self.host.errors.record(self.name, exc)

    def _judged(self, verdict: WedgeVerdict | None) -> None:
        self._seen = verdict
        if verdict is None or not verdict.wedged:
            self._streak = {}
            self._handled.clear()
            return
        owners = self.wedge.last_owners
        streak = {k: self._streak.get(k, 0) + 1 for k in map(_key, owners)}
        self._streak = streak
        for owner in owners:
            k = _key(owner)
            if streak[k] < self.after_verdicts or k in self._handled:
                continue
            self._handled.add(k)
            self._note(owner, self._attempt(owner))

    def _attempt(self, owner: DeadOwner) -> ReclaimOutcome:
        if owner.kind in _NEVER_RECLAIMED:
            return ReclaimOutcome(refused=RefusalReason.OWNER_UNKNOWN,
                                  detail="no owner is known, so no free path would have "
                                         "given these blocks back: repair the reference "
                                         "that was taken and never released")
        if owner.kind is DeadOwnerKind.OFFLOAD_JOB:
            return ReclaimOutcome(refused=RefusalReason.FENCED,
                                  detail="the offload job's fence holds the blocks; only "
                                         "its connector can release them")
        try:
            return self.reclaimer.reclaim(owner)
        except Exception as exc:
            self.host.errors.record(self.name, exc)
            return ReclaimOutcome(refused=RefusalReason.FAILED,
                                  detail=f"the free path raised {type(exc).__name__}")

    def _note(self, owner: DeadOwner, out: ReclaimOutcome) -> None:
        now = time.time()
        cause = owner.kind
        who = owner.request_id or "(no known owner)"
        if out.refused is None:
            ids = sorted(out.freed_block_ids)
            self.reclaims_total += 1
            self.reclaimed_blocks[cause.value] += len(ids)
            entry = ReclaimEntry(at=now, cause=cause, request_id=owner.request_id,
                                 blocks=len(ids), block_ids=ids, reclaimed=True,
                                 path=out.path, detail=out.detail)
            log.warning("kvguard on %s: RECLAIMED %d block(s) %s of %s %s through %s "
                        "(named at %d consecutive wedge verdicts); the missing free is a "
                        "bug to repair (docs/wedge.md)", self.host.engine, len(ids), ids,
                        cause.value, who, out.path or "the engine's free path",
                        self.after_verdicts)
        else:
            ids = sorted(owner.block_ids)
            self.refused[out.refused.value] += 1
            entry = ReclaimEntry(at=now, cause=cause, request_id=owner.request_id,
                                 blocks=len(ids), block_ids=ids, reclaimed=False,
                                 refused=out.refused, path=out.path, detail=out.detail)
            log.warning("kvguard on %s: reclaim of %d block(s) of %s %s refused (%s): %s",
                        self.host.engine, len(ids), cause.value, who, out.refused.value,
                        out.detail)
        self.recent.append(entry)

    def on_ledger_reset(self) -> None:
        self._streak = {}

    def on_config_changed(self, config: KvguardConfig) -> None:
        self.after_verdicts = config.reclaim_after_verdicts

    def state(self) -> ReclaimState:
        return ReclaimState(after_verdicts=self.after_verdicts,
                            reclaims_total=self.reclaims_total,
                            reclaimed_blocks_total=dict(self.reclaimed_blocks),
                            refused_total=dict(self.refused), recent=list(self.recent))

    def state_section(self) -> StateSection:
        return {"reclaim": self.state()}
