"""What an audit found: leak findings and the pool split into block states."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvguard.core.types import BlockState, Evidence, FinishReason, LeakCause, LeakPath, RequestId

MAX_BLOCK_IDS_PER_FINDING = 32
"""A finding lists at most this many block ids (the count is always exact)."""


@dataclass(slots=True)
class Finding:
    """One leak cause for one request (or for the unowned blocks of one path)."""

    cause: LeakCause
    path: LeakPath
    blocks: int
    """How many blocks this finding covers."""
    block_ids: list[int] = field(default_factory=list)
    """Up to ``MAX_BLOCK_IDS_PER_FINDING`` of them, for a debugger."""
    request_id: RequestId | None = None
    client_request_id: str | None = None
    finish_reason: FinishReason | None = None
    held_for_seconds: float | None = None
    """Since the request finished (``None`` when no request is known)."""
    evidence: Evidence = Evidence.DRAINED
    detail: str = ""
    """One sentence of evidence, e.g. "ref_cnt 2 but 1 known owner"."""

    def add_block(self, block_id: int) -> None:
        self.blocks += 1
        if len(self.block_ids) < MAX_BLOCK_IDS_PER_FINDING:
            self.block_ids.append(block_id)


@dataclass(slots=True)
class PoolStates:
    """Usable blocks by state; the five counts sum to ``capacity``."""

    capacity: int
    counts: dict[BlockState, int] = field(
        default_factory=lambda: {s: 0 for s in BlockState}
    )

    def __getitem__(self, state: BlockState) -> int:
        return self.counts[state]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def saturation_ratio(self) -> float:
        return self.counts[BlockState.CACHED] / self.capacity if self.capacity else 0.0


@dataclass(slots=True)
class Reconciliation:
    """The result of comparing the ledger with a pool snapshot."""

    states: PoolStates
    findings: list[Finding]
    finished_requests_holding: int
    """Finished requests that still hold blocks now (leaks or legitimate delayed frees)."""
    num_free_reported: int
    num_free_observed: int
    """Blocks with ref count 0 in the snapshot; must equal ``num_free_reported``."""

    def leaked_blocks_by_cause(self) -> dict[LeakCause, int]:
        out = {c: 0 for c in LeakCause}
        for f in self.findings:
            out[f.cause] += f.blocks
        return out
