"""Turn a reconciliation into a verdict and a human explanation."""

from __future__ import annotations

from kvguard.core.findings import Finding, Reconciliation
from kvguard.core.types import LeakCause, LeakPath, Verdict

SATURATION_RATIO_DEFAULT = 0.8
"""Cached blocks at or above this share of capacity make a clean pool ``saturated``."""

_NEXT_STEP: dict[LeakCause, str] = {
    LeakCause.FINISHED_REQUEST: (
        "A finished request kept its block references: a block-reference transition on "
        "the {path} path did not release them. Fix the free on that path; restarting the "
        "engine only hides it."
    ),
    LeakCause.ORPHAN: (
        "Blocks are referenced but no request owns them: a reference was taken outside a "
        "request's block table ({path}). Look for code that bumps ref_cnt directly "
        "(connectors bound to the pool, copy-on-write, rollback of a failed allocation)."
    ),
    LeakCause.REFCOUNT_DRIFT: (
        "Ref counts disagree with the known owners: some path changes ref_cnt without the "
        "matching acquire/release."
    ),
    LeakCause.DOUBLE_FREE: (
        "Blocks were released more often than acquired ({path}): a block may now be handed "
        "to two requests at once (KV corruption). Treat as urgent."
    ),
}

_PATH_WORDS: dict[LeakPath, str] = {
    LeakPath.ABORT: "abort/cancel",
    LeakPath.DELAYED_FREE: "delayed free (KV transfer completion never arrived)",
    LeakPath.DEFERRED_FREE: "deferred free",
    LeakPath.PREEMPTION: "preemption",
    LeakPath.ERROR: "error",
    LeakPath.FINISH: "normal finish",
    LeakPath.ROLLBACK: "allocation rollback",
    LeakPath.PREFIX_HIT: "prefix hit",
    LeakPath.REMOTE_KV_WAIT: "waiting for remote KV (P/D decode side: the transfer never "
                             "completed)",
    LeakPath.UNKNOWN: "unknown",
}


def decide(
    rec: Reconciliation, *, saturation_ratio: float = SATURATION_RATIO_DEFAULT
) -> tuple[Verdict, str]:
    """The verdict of a drained checkpoint and its explanation (what, and what next)."""
    if rec.findings:
        return Verdict.LEAK, _explain_leak(rec)
    s = rec.states
    if s.capacity and s.saturation_ratio >= saturation_ratio:
        return Verdict.SATURATED, (
            f"The prefix cache is saturated: {s.cached} of {s.capacity} "
            "blocks hold "
            f"evictable cached prefixes ({s.saturation_ratio:.0%}) and no request holds a block "
            "it should not. This is the cache working as designed, not a leak: cached blocks "
            "are reclaimed on demand. Nothing to do; watch kvguard_leaked_blocks instead of "
            "KV usage for leaks."
        )
    return Verdict.CLEAN, (
        f"The pool is clean: all {s.capacity} usable blocks are free "
        f"({s.free}) or cached ({s.cached}), "
        "every reference is "
        "accounted for. Nothing to do."
    )


def decide_online(
    rec: Reconciliation, *, sweep_steps: int, sweep_seconds: float,
    saturation_ratio: float = SATURATION_RATIO_DEFAULT,
) -> tuple[Verdict, str]:
    """The verdict of an online sweep: ownership only, under load."""
    head = (f"Online audit under load (no drain needed): every block was judged between "
            f"engine steps over a sweep of {sweep_steps} steps ({sweep_seconds:.2f} s); a "
            "finding is reported only after two consecutive sweeps saw it. It judges block "
            "ownership only: allocator and device memory wait for a drained checkpoint.\n")
    verdict, text = decide(rec, saturation_ratio=saturation_ratio)
    if verdict is Verdict.CLEAN:
        c = rec.states
        text = (f"No leak: every referenced block belongs to a live request or to a transfer "
                f"within its bound ({c.active} active, {c.held_by_finished} held by "
                f"transfers, {c.free} free, {c.cached} cached of {c.capacity}). Nothing to do.")
    return verdict, head + text


def skipped_explanation(reason: str) -> str:
    return (
        f"No verdict: the engine was not drained ({reason}). A residual taken while work is in "
        "flight is not evidence. kvguard checks again at the next drained moment."
    )


def _explain_leak(rec: Reconciliation) -> str:
    total = rec.leaked_blocks()
    shared = sum(1 for f in rec.findings if f.shared_blocks)
    lines = [f"{total} block(s) leaked in {len(rec.findings)} finding(s)."
             + (f" {shared} finding(s) share prefix-cached blocks with another; each block is "
                "counted once." if shared else "")]
    for f in rec.findings[:5]:
        lines.append("- " + describe_finding(f))
    if len(rec.findings) > 5:
        lines.append(f"- ... and {len(rec.findings) - 5} more (see leaks)")
    seen: set[LeakCause] = set()
    for f in rec.findings:
        if f.cause not in seen:
            seen.add(f.cause)
            lines.append("Next: " + _NEXT_STEP[f.cause].format(path=_PATH_WORDS[f.path]))
    return "\n".join(lines)


def describe_finding(f: Finding) -> str:
    """One sentence: "request X finished (aborted) 12.0 s ago and still holds 5 blocks"."""
    who = f.client_request_id or f.request_id
    if f.cause is LeakCause.FINISHED_REQUEST:
        reason = f.finish_reason.value if f.finish_reason else "unknown"
        ago = f" {f.held_for_seconds:.1f} s ago" if f.held_for_seconds is not None else ""
        shared = f" ({f.shared_blocks} shared with another finding)" if f.shared_blocks else ""
        return (f"request {who} finished ({reason}){ago} and still holds {f.blocks} block(s)"
                f"{shared} [path: {_PATH_WORDS[f.path]}]")
    if f.cause is LeakCause.DOUBLE_FREE:
        by = f" by request {who}" if who else ""
        return f"{f.blocks} block(s) double-freed{by} [path: {_PATH_WORDS[f.path]}]: {f.detail}"
    if f.cause is LeakCause.REFCOUNT_DRIFT:
        return f"{f.blocks} block(s) with ref-count drift: {f.detail}"
    return f"{f.blocks} orphaned block(s) [path: {_PATH_WORDS[f.path]}]: {f.detail}"

