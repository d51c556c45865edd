"""The wedge verdict: requests wait forever because dead owners hold the blocks they need.

An engine is *wedged* when all of these hold at one step boundary:

1. requests are waiting (``num_waiting > 0``);
2. none has been admitted for at least ``after_seconds`` **and** ``after_steps`` engine
   steps (the *stall*, measured by :class:`~kvguard.core.wedge_monitor.WedgeMonitor`);
3. some blocks are held by owners kvguard has proven dead (:class:`DeadOwner`: finished
   requests, delayed frees and offload jobs past their bound, orphans, ref-count drift);
4. the oldest waiting request cannot be admitted even after every block that is *not*
   dead came back: ``head_blocks_needed > capacity - dead_blocks``, or nothing but dead
   owners holds a block (``held_blocks == dead_blocks``: nothing live can give any back,
   and the stall shows the free blocks are not enough).

A pool held by live owners (long generations, a burst, preemption) has no dead blocks,
so rule 3 alone keeps it from ever being wedged: that is *busy*, not wedged, however
long requests wait (the property tests in ``tests/core/test_wedge.py``).

The judgment is pure (:func:`judge_wedge`): it reads a :class:`WaitingView` (what the
engine says waits) and the dead owners (:mod:`kvguard.core.dead_owners`), changes
nothing and imports no engine. Units: blocks are usable pool blocks (the null block
excluded), times are seconds.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

MAX_LISTED_OWNERS = 16
"""A verdict lists at most this many dead owners (the block count is always exact)."""


class DeadOwnerKind(enum.StrEnum):
    """Why an owner of blocks is dead (never gives them back on its own)."""

    FINISHED_REQUEST = "finished_request"
    """Finished (stopped, aborted, ...), freed or past its free, still holds blocks."""
    DELAYED_FREE = "delayed_free"
    """A delayed free (KV transfer, P/D) past its bound or its connector's lease."""
    OFFLOAD_JOB = "offload_job"
    """A request whose offload job is stuck past the offload bound."""
    ORPHAN = "orphan"
    """Blocks with references no request owns (confirmed by the online audit)."""
    REFCOUNT_DRIFT = "refcount_drift"
    """References beyond the owners the ledger knows (confirmed by the online audit)."""


@dataclass(frozen=True, slots=True)
class WaitingView:
    """What the engine says waits, read between steps. Counts >= 0; seconds >= 0.

    ``head_blocks_needed``: blocks the oldest waiting request needs to be admitted (its
    first chunk; prefix-cache hits not subtracted, so an upper bound). ``num_free_blocks``:
    the pool's own free count (cached, evictable blocks included). ``capacity_blocks``:
    usable blocks (null block excluded).
    """

    num_waiting: int
    num_running: int
    oldest_wait_seconds: float
    head_blocks_needed: int
    num_free_blocks: int
    capacity_blocks: int


@dataclass(frozen=True, slots=True)
class Stall:
    """How long nothing has been admitted while requests wait (0 when nothing waits)."""

    seconds: float
    steps: int


@dataclass(frozen=True, slots=True)
class DeadOwner:
    """One dead owner and the distinct blocks it holds that no live owner shares."""

    kind: DeadOwnerKind
    request_id: str | None
    """The client's request id (``None`` for orphans and drift: no owner is known)."""
    block_ids: frozenset[int]
    held_for_seconds: float | None = None
    """Since the request finished (or its job started); ``None`` when unknown."""
    engine_request_id: str | None = None
    """The engine's internal id of the request (what its block tables are keyed by)."""


@dataclass(frozen=True, slots=True)
class WedgeOptions:
    """When a stall is long enough to judge. Seconds and engine steps, both must pass."""

    after_seconds: float = 30.0
    after_steps: int = 20


class DeadOwnerView(BaseModel):
    """A dead owner in the published verdict (request ids and counts only)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    kind: DeadOwnerKind
    request_id: str | None = None
    blocks: int = Field(ge=0)
    held_for_seconds: float | None = None


class WedgeVerdict(BaseModel):
    """The wedge judgment at one step boundary (published in the engine's state)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    wedged: bool
    judged_at: float = Field(description="Unix s.")
    waiting_requests: int = Field(ge=0)
    running_requests: int = Field(ge=0)
    oldest_wait_seconds: float = Field(ge=0)
    stalled_seconds: float = Field(ge=0, description="Since the last admission while "
                                                     "requests waited.")
    stalled_steps: int = Field(ge=0)
    head_blocks_needed: int = Field(ge=0, description="Blocks the oldest waiting request "
                                                      "needs (upper bound).")
    free_blocks: int = Field(ge=0)
    dead_blocks: int = Field(ge=0, description="Distinct blocks held by dead owners.")
    blocks_to_return: int = Field(ge=0, description="Dead blocks that would have to come "
                                                    "back for the oldest waiting request "
                                                    "to be admitted.")
    dead_owners: list[DeadOwnerView] = Field(
        default_factory=list, description=f"The {MAX_LISTED_OWNERS} largest, largest first.")
    dead_owners_total: int = Field(default=0, ge=0)
    explanation: str


def distinct_dead_blocks(owners: Sequence[DeadOwner]) -> frozenset[int]:
    """Every block some dead owner holds, each once."""
    out: set[int] = set()
    for o in owners:
        out |= o.block_ids
    return frozenset(out)


def judge_wedge(view: WaitingView, stall: Stall, owners: Sequence[DeadOwner],
                opts: WedgeOptions, *, now: float) -> WedgeVerdict:
    """Judge one moment (pure). ``owners`` must hold only blocks no live owner shares.

    Invariant (tested over random inputs): with no dead block the verdict is never
    ``wedged``, whatever waits and for however long.
    """
    dead = distinct_dead_blocks(owners)
    num_dead = len(dead)
    free = view.num_free_blocks
    held = max(0, view.capacity_blocks - free)
    need = view.head_blocks_needed
    stalled = (view.num_waiting > 0 and stall.seconds >= opts.after_seconds
               and stall.steps >= opts.after_steps)
    never_fits = need > view.capacity_blocks - num_dead
    only_dead_hold = num_dead > 0 and held <= num_dead
    wedged = stalled and num_dead > 0 and (never_fits or only_dead_hold)
    to_return = max(0, min(num_dead, need - free)) if wedged else 0
    if wedged and to_return == 0:
        to_return = min(num_dead, 1)  # the stall shows the free count is not enough
    ranked = sorted(owners, key=lambda o: (-len(o.block_ids), o.kind.value,
                                           o.request_id or ""))
    listed = [DeadOwnerView(kind=o.kind, request_id=o.request_id, blocks=len(o.block_ids),
                            held_for_seconds=o.held_for_seconds)
              for o in ranked[:MAX_LISTED_OWNERS]]
    return WedgeVerdict(
        wedged=wedged, judged_at=now, waiting_requests=view.num_waiting,
        running_requests=view.num_running, oldest_wait_seconds=view.oldest_wait_seconds,
        stalled_seconds=stall.seconds, stalled_steps=stall.steps,
        head_blocks_needed=need, free_blocks=free, dead_blocks=num_dead,
        blocks_to_return=to_return, dead_owners=listed, dead_owners_total=len(owners),
        explanation=_explain(wedged, view, stall, num_dead, to_return, ranked, opts))


def _explain(wedged: bool, view: WaitingView, stall: Stall, num_dead: int, to_return: int,
             ranked: Sequence[DeadOwner], opts: WedgeOptions) -> str:
    waits = (f"{view.num_waiting} request(s) waiting (oldest {view.oldest_wait_seconds:.0f} s), "
             f"none admitted for {stall.seconds:.0f} s / {stall.steps} steps")
    if not wedged:
        if view.num_waiting == 0:
            return "nothing waits"
        if num_dead == 0:
            return (f"{waits}; no block is held by a dead owner: the pool is busy with live "
                    "requests, not wedged")
        if stall.seconds < opts.after_seconds or stall.steps < opts.after_steps:
            return f"{waits}; below the wedge thresholds ({opts.after_seconds:g} s, " \
                   f"{opts.after_steps} steps)"
        return (f"{waits}; {num_dead} block(s) held by dead owners, but live owners hold "
                "enough to admit the oldest waiting request once they finish")
    first = ranked[0] if ranked else None
    who = "" if first is None else (
        f"; largest: {first.kind.value}"
        + (f" {first.request_id}" if first.request_id else "")
        + f" with {len(first.block_ids)} block(s)")
    return (f"WEDGED: {waits}. {num_dead} block(s) are held by {len(ranked)} dead owner(s)"
            f"{who}. The oldest waiting request needs {view.head_blocks_needed} block(s), "
            f"{view.num_free_blocks} are free: {to_return} dead block(s) must come back "
            "before anything is admitted. The engine will not recover on its own: take it "
            "out of rotation (readiness is 503) and restart it; the dead owners name the "
            "free path to repair (docs/wedge.md).")


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` tokens (``block_size`` > 0)."""
    return math.ceil(max(0, tokens) / block_size)
