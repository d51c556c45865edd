"""Reclaim's vocabulary: what the engine side answers for one dead owner, and what the
reclaim monitor publishes (:mod:`kvguard.core.monitors.reclaim` does the reclaiming).

Pure data, no engine import: the engine side implements :class:`Reclaimer`; the state
section (:class:`ReclaimState`) is read by the sidecar (metrics, ``/v1/report``) and the CLI.
Block counts are pool blocks (the null block never counts); times are Unix seconds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from kvguard.core.wedge import DeadOwner, DeadOwnerKind

MAX_LISTED = 32
"""The state lists at most this many reclaims and refusals, the latest last."""

class RefusalReason(enum.StrEnum):
    """Why a dead owner's blocks were not reclaimed (``kvguard_reclaims_refused_total``)."""

    NO_FREE_PATH = "no_free_path"
    """This engine version lacks the free path the missing free would have taken (the
    version layer names it), or what keeps a late completion from reaching the engine."""
    OWNER_UNKNOWN = "owner_unknown"
    """Orphans and ref-count drift: reported, counted toward a wedge, never reclaimed."""
    OWNER_ALIVE = "owner_alive"
    """The owner came back to life (the engine runs or queues it, its hold is within its
    bound again)."""
    FENCED = "fenced"
    """An offload job's fence or a transfer inside its lease holds the blocks."""
    BLOCKS_CHANGED = "blocks_changed"
    """At the moment of the free, a block's references or table differed from the verdict."""
    FAILED = "failed"
    """The free path raised (also counted under hook ``reclaim``)."""


@dataclass(frozen=True, slots=True)
class ReclaimOutcome:
    """What the engine side did with one dead owner: freed blocks, or a refusal."""

    freed_block_ids: tuple[int, ...] = ()
    refused: RefusalReason | None = None
    path: str = ""
    """The engine's free path taken or wanted (e.g. ``KVCacheManager.free``)."""
    detail: str = ""
    """Why, in words (no prompt text, no token ids)."""


class Reclaimer(Protocol):
    """The engine side: frees one dead owner's blocks through the engine's own free path.

    Called on the engine's thread, between steps. Must re-check every block against the
    pool when it frees it and refuse (``ReclaimOutcome.refused``) rather than free what a
    live owner holds. May raise: the monitor contains it."""

    def reclaim(self, owner: DeadOwner) -> ReclaimOutcome: ...


class ReclaimEntry(BaseModel):
    """One reclaim or refusal in the published state."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    at: float = Field(description="Unix s.")
    cause: DeadOwnerKind
    request_id: str | None = Field(default=None, description="The client's request id "
                                   "(None for orphans and drift).")
    blocks: int = Field(ge=0, description="Blocks freed (a refusal: blocks the owner held).")
    block_ids: list[int] = Field(default_factory=list)
    reclaimed: bool
    refused: RefusalReason | None = None
    path: str = Field(default="", description="The engine's free path.")
    detail: str = ""


class ReclaimState(BaseModel):
    """The reclaim monitor in the engine's published state (present only when it is on)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    after_verdicts: int = Field(ge=1, description="Consecutive wedge verdicts before a "
                                                  "reclaim.")
    reclaims_total: int = Field(default=0, ge=0, description="Owners reclaimed.")
    reclaimed_blocks_total: dict[str, int] = Field(
        default_factory=dict, description="Blocks reclaimed, by cause (a dead-owner kind).")
    refused_total: dict[str, int] = Field(default_factory=dict,
                                          description="Reclaims refused, by reason.")
    recent: list[ReclaimEntry] = Field(default_factory=list, description=f"The latest "
                                       f"{MAX_LISTED} reclaims and refusals, oldest first.")
