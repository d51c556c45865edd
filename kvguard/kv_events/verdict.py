"""The verdict on one engine's KV-event mirror: compare the pool's snapshot with the mirror at
the snapshot's own sequence number.

Inputs: a :class:`~kvguard.kv_events.snapshot.KvEventsSnapshot` (the pool, read by the engine
at a drained checkpoint, at batch ``last_seq``) and the mirror's view after that same batch
(:meth:`~kvguard.kv_events.mirror.Mirror.view_at`), so that events published after the
snapshot never count as differences.

Verdicts (:class:`KvEventsVerdict`), the first that applies:

``pending``
    Nothing to compare yet: no snapshot, the snapshot was read with events still queued in
    the engine (after a ``reset_prefix_cache`` at idle, its ``AllBlocksCleared`` waits for
    vLLM's next step: the check before the reset no longer holds), or the mirror has not
    received batch ``last_seq`` yet.
``consistent``
    Mirror and pool hold the same blocks.
``cleared_missed``
    The mirror holds blocks the pool dropped, and it missed the engine's last clear
    (``reset_prefix_cache`` queued ``AllBlocksCleared``) or the engine restarted since the
    mirror last started over.
``gap``
    They differ, and batches were lost since the mirror last started over (replay did not
    give them back).
``stale``
    The mirror holds blocks the pool no longer has (a ``BlockRemoved`` never applied): a
    router sends requests to an engine that lost the prefix.
``missing``
    The pool holds blocks the mirror lacks (a ``BlockStored`` never applied): a router misses
    cache hits.

Counts (``stale_blocks``, ``missing_blocks``) are always both reported; ``first_stale`` and
``first_missing`` name up to :data:`FIRST_BLOCKS` keys (block hashes, never token ids) when the
snapshot carries its keys, else only the counts and digests are compared.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from kvguard.kv_events.digest import digest_hex
from kvguard.kv_events.mirror import MirrorView
from kvguard.kv_events.snapshot import KvEventsSnapshot

FIRST_BLOCKS = 8
"""Block keys named per difference in a report."""


class KvEventsVerdict(StrEnum):
    PENDING = "pending"
    CONSISTENT = "consistent"
    CLEARED_MISSED = "cleared_missed"
    GAP = "gap"
    STALE = "stale"
    MISSING = "missing"


class MirrorFacts(BaseModel):
    """What the subscriber knows besides the mirror's blocks (read under its lock)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    last_seq: int
    clear_seq: int | None = None
    lost_since_reset: bool = False
    """Batches were lost after the mirror last started over (a clear or restart)."""
    epoch: str | None = None
    """The engine epoch the mirror started for (None: unknown)."""


class KvEventsCheck(BaseModel):
    """One comparison of an engine's pool with its mirror (``/v1/report``'s ``kv_events``)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    verdict: KvEventsVerdict
    checkpoint_id: int | None = None
    seq: int | None = Field(default=None, description="The batch both sides are compared at.")
    checked_at: float = Field(description="Unix time, s.")
    pool_blocks: int = 0
    mirror_blocks: int = 0
    stale_blocks: int = Field(default=0, description="In the mirror, not in the pool.")
    missing_blocks: int = Field(default=0, description="In the pool, not in the mirror.")
    first_stale: list[str] = Field(default_factory=list, description="Block keys (hashes).")
    first_missing: list[str] = Field(default_factory=list, description="Block keys (hashes).")
    explanation: str = ""


def judge(snapshot: KvEventsSnapshot | None, view: MirrorView | None, facts: MirrorFacts, *,
          engine_epoch: str | None, now: float) -> KvEventsCheck:
    """The verdict for one engine (see the module docstring)."""
    if snapshot is None:
        return KvEventsCheck(verdict=KvEventsVerdict.PENDING, checked_at=now,
                             explanation="no drained checkpoint has read the pool yet")
    snap = snapshot

    def check(verdict: KvEventsVerdict, explanation: str, *, mirror_n: int = 0,
              stale: list[str] | None = None, missing: list[str] | None = None,
              n_stale: int = 0, n_missing: int = 0) -> KvEventsCheck:
        return KvEventsCheck(
            verdict=verdict, checkpoint_id=snap.checkpoint_id, seq=snap.last_seq,
            checked_at=now, pool_blocks=snap.num_blocks, mirror_blocks=mirror_n,
            stale_blocks=n_stale, missing_blocks=n_missing,
            first_stale=(stale or [])[:FIRST_BLOCKS],
            first_missing=(missing or [])[:FIRST_BLOCKS], explanation=explanation)

    if not snap.comparable:
        return check(KvEventsVerdict.PENDING, (
            f"the pool was read with {snap.pending_events} event(s) queued in the engine "
            "and not yet published (vLLM publishes them at its next step; a "
            "reset_prefix_cache at idle leaves its AllBlocksCleared queued until then): the "
            "pool and the mirror are compared again at the first drained checkpoint after "
            "that step"))
    if view is None:
        return check(KvEventsVerdict.PENDING, (
            f"the mirror has batches up to {facts.last_seq}, the pool was read at batch "
            f"{snap.last_seq}; waiting for the rest (replay is asked for)"
            if facts.last_seq < snap.last_seq else
            f"the mirror can no longer be rolled back to batch {snap.last_seq}; the "
            "next drained checkpoint is compared"))
    mirror_n = len(view.keys)
    stale: list[str] = []
    missing: list[str] = []
    if snap.block_keys is not None:
        pool = set(snap.block_keys)
        stale = sorted(view.keys - pool)
        missing = sorted(pool - view.keys)
        n_stale, n_missing = len(stale), len(missing)
        same = not stale and not missing
    else:  # counts and digests only: differences are counted, not named
        same = mirror_n == snap.num_blocks and digest_hex(view.keys) == snap.digest
        n_stale = 0 if same else max(0, mirror_n - snap.num_blocks)
        n_missing = 0 if same else max(0, snap.num_blocks - mirror_n)

    def found(verdict: KvEventsVerdict, explanation: str) -> KvEventsCheck:
        return check(verdict, explanation, mirror_n=mirror_n, stale=stale, missing=missing,
                     n_stale=n_stale, n_missing=n_missing)

    if same:
        return found(KvEventsVerdict.CONSISTENT, (
            f"the mirror built from the KV events holds exactly the {mirror_n} block(s) the "
            f"pool holds at batch {snap.last_seq}"))
    missed_clear = snap.clear_seq is not None and (
        facts.clear_seq is None or facts.clear_seq < snap.clear_seq)
    restarted = facts.epoch is not None and engine_epoch is not None \
        and facts.epoch != engine_epoch
    diff = (f"{n_stale} block(s) in the mirror the pool no longer holds, {n_missing} in the "
            f"pool the mirror lacks (at batch {snap.last_seq})")
    if n_stale > 0 and (missed_clear or restarted):
        what = (f"the engine cleared its prefix cache (AllBlocksCleared in batch "
                f"{snap.clear_seq}) and the mirror never applied it" if missed_clear else
                "the engine restarted and the mirror kept the blocks of its previous run")
        return found(KvEventsVerdict.CLEARED_MISSED, (
            f"{what}: {diff}. A router with this mirror routes to prefixes the engine no "
            "longer has; resynchronise it (restart its subscription from batch 0, or clear "
            "its view of this engine)."))
    if facts.lost_since_reset:
        return found(KvEventsVerdict.GAP, (
            f"KV-event batches were lost and replay could not give them back: {diff}. Raise "
            "the publisher's buffer_steps/hwm, or clear this engine's mirror on a gap."))
    if n_stale:
        return found(KvEventsVerdict.STALE, (
            f"{diff}: BlockRemoved events never reached the mirror, with no gap in the "
            "sequence numbers. A router routes to prefixes this engine evicted."))
    return found(KvEventsVerdict.MISSING, (
        f"{diff}: BlockStored events never reached the mirror. A router misses cache hits "
        "on this engine."))
