"""What vLLM's own state says after a scenario: the ground truth kvguard is scored against.

Read straight from the real engine, never from kvguard: every block's ``ref_cnt`` and
free-queue membership, the per-request block tables (``req_to_blocks``), the pool's own
free count and vLLM's KV usage (``BlockPool.get_usage()``, the value of the
``vllm:kv_cache_usage_perc`` gauge, read now rather than at the last step), plus
vLLM's counters for the paths a scenario must have taken (preemptions, speculative
drafts and accepts) and the finish statuses vLLM gave each request (recorded by the
chaos scheduler).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvguard.core.report import CheckpointReport


@dataclass(frozen=True, slots=True)
class PoolTruth:
    """The pool after the drain, as vLLM holds it. Block ids exclude the null block.

    ``wrong_blocks``: every block whose state is not that of an idle pool: ``ref_cnt``
    other than 0, or ``ref_cnt`` 0 outside the free queue, or ``ref_cnt`` > 0 inside it.
    At a drained moment these are exactly the leaked (or double-freed) blocks.
    """

    capacity: int
    referenced: frozenset[int]
    """``ref_cnt > 0``."""
    negative: frozenset[int]
    """``ref_cnt < 0`` (freed more often than taken)."""
    unreachable: frozenset[int]
    """``ref_cnt == 0`` but not in the free queue."""
    in_queue_referenced: frozenset[int]
    tables: dict[str, list[int]]
    """Request id -> block ids still in vLLM's block tables (all KV groups)."""
    num_free_reported: int
    usage_perc: float
    """vLLM's ``BlockPool.get_usage()`` (what ``vllm:kv_cache_usage_perc`` exports), 0..1."""

    @property
    def wrong_blocks(self) -> frozenset[int]:
        return self.referenced | self.negative | self.unreachable | self.in_queue_referenced

    @property
    def usage_blocks(self) -> float:
        """vLLM's usage in blocks (``usage * capacity``)."""
        return self.usage_perc * self.capacity


def read_pool_truth(scheduler: Any) -> PoolTruth:
    """Read the pool of a (drained) in-process engine, on its scheduler thread."""
    kvm = scheduler.kv_cache_manager
    pool = kvm.block_pool
    null = getattr(pool, "null_block", None)
    nulls = {null.block_id} if null is not None else set()
    ref: set[int] = set()
    neg: set[int] = set()
    unreachable: set[int] = set()
    queued_ref: set[int] = set()
    for b in pool.blocks:
        if b.block_id in nulls:
            continue
        in_queue = b.prev_free_block is not None
        if b.ref_cnt > 0:
            ref.add(b.block_id)
            if in_queue:
                queued_ref.add(b.block_id)
        elif b.ref_cnt < 0:
            neg.add(b.block_id)
        elif not in_queue:
            unreachable.add(b.block_id)
    tables: dict[str, list[int]] = {}
    coord = getattr(kvm, "coordinator", None)
    for mgr in getattr(coord, "single_type_managers", ()) or ():
        for rid, blocks in mgr.req_to_blocks.items():
            ids = [b.block_id for b in blocks if not b.is_null]
            if ids:
                tables.setdefault(str(rid), []).extend(ids)
    return PoolTruth(
        capacity=int(pool.num_gpu_blocks) - len(nulls), referenced=frozenset(ref),
        negative=frozenset(neg), unreachable=frozenset(unreachable),
        in_queue_referenced=frozenset(queued_ref), tables=tables,
        num_free_reported=int(pool.get_num_free_blocks()),
        usage_perc=float(pool.get_usage()))


def metric_value(metrics: Iterable[Any], name: str) -> float | None:
    """Sum of one vLLM metric's values over its label sets (None: not exported)."""
    found = [float(m.value) for m in metrics
             if getattr(m, "name", None) == name and getattr(m, "value", None) is not None]
    return sum(found) if found else None


@dataclass(frozen=True, slots=True)
class ReportBlocks:
    """What a kvguard report says was leaked: the union of its findings' block ids and the
    distinct count the report states itself (``leaked_blocks``)."""

    block_ids: frozenset[int]
    stated_count: int
    per_finding: list[int] = field(default_factory=list)


def report_blocks(report: CheckpointReport) -> ReportBlocks:
    ids: set[int] = set()
    for lk in report.leaks:
        ids.update(lk.block_ids)
    return ReportBlocks(block_ids=frozenset(ids), stated_count=report.leaked_blocks,
                        per_finding=[lk.blocks for lk in report.leaks])


def disagreement(report: CheckpointReport, truth: PoolTruth) -> str:
    """Why kvguard's report contradicts the pool, or "" when block ids and counts agree.

    The report must name exactly the pool's wrong blocks (union of its findings' block
    ids), state their distinct count, and its pool states must match the pool's own free
    count; vLLM's own usage must count the referenced blocks.
    """
    got = report_blocks(report)
    want = truth.wrong_blocks
    if got.block_ids != want:
        missing, extra = sorted(want - got.block_ids), sorted(got.block_ids - want)
        return (f"leaked block ids differ from the pool's: missing {missing}, "
                f"not leaked in the pool {extra}")
    if got.stated_count != len(want):
        return f"report states {got.stated_count} leaked blocks, the pool has {len(want)}"
    p = report.pool
    # An online report's pool states are counted over a sweep under load, not at one
    # instant: only a drained report's states can be held against the pool now.
    if p is not None and report.drained \
            and p.free + p.cached != truth.num_free_reported - len(truth.negative):
        return (f"report's free+cached {p.free + p.cached} != the pool's free count "
                f"{truth.num_free_reported} minus {len(truth.negative)} negative")
    usage = truth.usage_blocks
    if not truth.negative and round(usage) != len(truth.referenced - truth.in_queue_referenced):
        return (f"vLLM's KV usage says {usage:.1f} blocks in use, the pool has "
                f"{len(truth.referenced)} referenced")
    return ""
