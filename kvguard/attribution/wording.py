"""What people read: byte amounts, the next step per boundary, the summary paragraph."""

from __future__ import annotations

from kvguard.core.report import AttributionReport, AttributionStatus, Boundary

_MIB = 1 << 20
_GIB = 1 << 30

NEXT_STEP: dict[Boundary, str] = {
    Boundary.TENSOR: (
        "Find the live-tensor owner: outputs or logits kept in a list, closures and "
        "callbacks holding tensors, autograd graphs (inference without no_grad). A memory "
        "snapshot (KVGUARD_SNAPSHOT_DIR) names the allocating stacks."),
    Boundary.ALLOCATOR_CACHE: (
        "Nothing: not a leak, the allocator reuses these pages. If another process needs "
        "them, KVGUARD_EMPTY_CACHE_AT_CHECKPOINT=1 returns them at drained checkpoints "
        "(never on every step)."),
    Boundary.FRAGMENTATION: (
        "Collect size evidence (a memory snapshot's segments and split blocks, which "
        "request shapes vary); only then try allocator options such as "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True. They follow evidence; they are "
        "not an OOM cure."),
    Boundary.OUTSIDE_FRAMEWORK: (
        "A lead, not an attribution: look outside PyTorch (nvidia-smi "
        "--query-compute-apps=pid,used_memory for other processes, NCCL communicators and "
        "buffers, CUDA graphs captured after warm-up, libraries calling cudaMalloc "
        "directly). PyTorch's memory history cannot see these."),
    Boundary.KV_POOL: (
        "Fix the block-reference transition on the exit path named in the leaks above; "
        "restarting the engine only hides it."),
    Boundary.HOST_SWAP: (
        "The host does not fit this workload: lower concurrency or the KV budget, load one "
        "model stage at a time (move finished stages to the meta device, then empty the "
        "cache), or add memory. Do not size by the process footprint."),
    Boundary.PROCESS_MEMORY: (
        "Find the live owner in the process: a list or cache keeping engine outputs, "
        "arrays or tensors, callbacks, closures. Compare tracemalloc snapshots (or "
        "gc.get_objects by type) at two drained checkpoints; memray for native "
        "allocations."),
    Boundary.TRANSIENT_PEAK: (
        "Lower the concurrency limit (max_num_seqs, max_num_batched_tokens) or leave more "
        "headroom for the peak; nothing is held afterwards, so there is no owner to find."),
}


def fmt_bytes(n: int | None) -> str:
    """``1.5 GiB``, ``412.0 MiB``, ``12 KiB``; ``?`` when unknown."""
    if n is None:
        return "?"
    sign = "-" if n < 0 else ""
    a = abs(n)
    if a >= _GIB:
        return f"{sign}{a / _GIB:.2f} GiB"
    if a >= _MIB:
        return f"{sign}{a / _MIB:.1f} MiB"
    if a >= 1024:
        return f"{sign}{a // 1024} KiB"
    return f"{sign}{a} B"


def fmt_delta(n: int | None) -> str:
    """``+412.0 MiB`` / ``-3.0 MiB`` / ``?``."""
    if n is None:
        return "?"
    return ("+" if n >= 0 else "") + fmt_bytes(n)


def summary(a: AttributionReport) -> str:
    """The attribution paragraph of a checkpoint's explanation."""
    head = "Memory attribution: "
    if a.status is AttributionStatus.UNAVAILABLE:
        return head + "unavailable (" + "; ".join(a.errors or ["no probe"]) + ")."
    lines: list[str] = []
    if a.status is AttributionStatus.WARMING_UP:
        lines.append(head + f"warm-up checkpoint; the baseline is taken after "
                     f"{a.warmup_checkpoints_left} more drained checkpoint(s).")
    elif a.status is AttributionStatus.BASELINE:
        lines.append(head + "this checkpoint is the baseline; later drained checkpoints "
                     "are compared with it.")
    elif not a.findings:
        lines.append(head + f"no boundary moved by {fmt_bytes(a.min_delta_bytes)} or more "
                     f"since baseline checkpoint #{a.baseline_checkpoint_id}.")
    else:
        lines.append(head + f"compared with baseline checkpoint #{a.baseline_checkpoint_id}:")
    for f in a.findings:
        lines.append(f"- {f.boundary.value} ({f.strength.value.replace('_', ' ')}, "
                     f"{fmt_delta(f.delta_bytes)}): {f.evidence} Next: {f.next_step}")
    if a.snapshot_path:
        lines.append(f"Memory snapshot: {a.snapshot_path}")
    elif a.snapshot_note:
        lines.append(f"Memory snapshot: {a.snapshot_note}")
    return "\n".join(lines)
