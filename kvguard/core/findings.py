"""What an audit found: leak findings and the pool split into block states."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvguard.core.report import PoolReport
from kvguard.core.types import Evidence, FinishReason, LeakCause, LeakPath, RequestId

MAX_BLOCK_IDS_PER_FINDING = 32
"""A finding lists at most this many block ids (the count is always exact)."""


@dataclass(slots=True)
class Finding:
    """One leak cause for one request (or for the unowned blocks of one path)."""

    cause: LeakCause
    path: LeakPath
    blocks: int
    """How many blocks this finding covers. A block shared through the prefix cache by
    several leaking requests is in each of their findings: sum ``blocks`` over findings
    and it is counted more than once (use ``Reconciliation.leaked_blocks``)."""
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
    shared_blocks: int = 0
    """How many of this finding's blocks are also in another finding of the same audit
    (set by ``Reconciliation``); ``0 <= shared_blocks <= blocks``."""
    all_block_ids: set[int] = field(default_factory=set)
    """Every block id of this finding (``block_ids`` is truncated; this is not). Empty for a
    pool-level finding that only knows a count."""

    def add_block(self, block_id: int) -> None:
        if block_id in self.all_block_ids:
            return  # one block is one block, however many of its references a path holds
        self.all_block_ids.add(block_id)
        self.blocks += 1
        if len(self.block_ids) < MAX_BLOCK_IDS_PER_FINDING:
            self.block_ids.append(block_id)

    @property
    def unidentified_blocks(self) -> int:
        """Blocks this finding counts without knowing their ids (pool-level count mismatches)."""
        return max(0, self.blocks - len(self.all_block_ids))


@dataclass(slots=True)
class Reconciliation:
    """The result of comparing the ledger with a pool snapshot."""

    states: PoolReport
    """Usable blocks by state, and the engine's own free count: the report's ``pool``."""
    findings: list[Finding]
    finished_requests_holding: int
    """Finished requests that still hold blocks now (leaks or legitimate delayed frees)."""
    num_free_observed: int
    """Blocks with ref count 0 in the snapshot; must equal ``num_free_reported``."""

    @property
    def num_free_reported(self) -> int:
        """The engine's own free-block count (cached blocks included)."""
        return self.states.num_free_reported

    def __post_init__(self) -> None:
        mark_shared_blocks(self.findings)

    def leaked_blocks_by_cause(self) -> dict[LeakCause, int]:
        """Distinct leaked blocks per cause: a block in several findings counts once.

        A block is judged under one cause per audit, so these sum to ``leaked_blocks()``.
        """
        return {c: distinct_blocks([f for f in self.findings if f.cause is c])
                for c in LeakCause}

    def leaked_blocks(self) -> int:
        """Distinct leaked blocks over every finding: what the pool lost (x block size =
        the memory)."""
        return distinct_blocks(self.findings)


def distinct_blocks(findings: list[Finding]) -> int:
    """Blocks named by ``findings``, each once, plus the blocks they count without ids."""
    ids: set[int] = set()
    for f in findings:
        ids |= f.all_block_ids
    return len(ids) + sum(f.unidentified_blocks for f in findings)


def mark_shared_blocks(findings: list[Finding]) -> None:
    """Set each finding's ``shared_blocks``: its blocks that another finding names too."""
    seen: dict[int, int] = {}
    for f in findings:
        for b in f.all_block_ids:
            seen[b] = seen.get(b, 0) + 1
    for f in findings:
        f.shared_blocks = sum(1 for b in f.all_block_ids if seen[b] > 1)
