"""Render checkpoint reports as plain text for people (``kvguard report``, ``kvguard demo``)."""

from __future__ import annotations

import time

from kvguard.core.report import CheckpointReport
from kvguard.kv_events.verdict import KvEventsCheck
from kvguard.transport.state import EngineState

_BAR = 30


def _bar(n: int, total: int) -> str:
    if total <= 0:
        return ""
    return "#" * max(1 if n else 0, round(_BAR * n / total))


def render_report(r: CheckpointReport) -> str:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r.taken_at))
    kind = "online audit" if r.evidence.value == "online" else "checkpoint"
    out = [f"engine {r.engine}  {kind} #{r.checkpoint_id}  {when}  "
           f"verdict: {r.verdict.value.upper()}"]
    if r.skip_reason:
        out.append(f"  not drained: {r.skip_reason}")
    if r.pool is not None:
        p = r.pool
        out.append(f"  pool: {p.capacity} usable blocks (engine reports {p.num_free_reported} "
                   "free incl. cached)")
        for state, n in p.by_state().items():
            out.append(f"    {state.value:<17}{n:>7}  {_bar(n, p.capacity)}")
    if r.leaks:
        out.append(f"  leaks: {r.leaked_blocks} distinct block(s)")
        out.append(f"    {'REQUEST':<28}{'CAUSE':<18}{'PATH':<14}{'REASON':<10}"
                   f"{'BLOCKS':>7}{'SHARED':>8}  HELD FOR")
        for leak in r.leaks:
            who = leak.client_request_id or leak.request_id or "-"
            held = f"{leak.held_for_seconds:.1f} s" if leak.held_for_seconds is not None else "-"
            reason = leak.finish_reason.value if leak.finish_reason else "-"
            out.append(f"    {who[:27]:<28}{leak.cause.value:<18}{leak.path.value:<14}"
                       f"{reason:<10}{leak.blocks:>7}{leak.shared_blocks:>8}  {held}")
    out.append("")
    out.extend("  " + line for line in r.explanation.splitlines())
    return "\n".join(out)


def render_state(s: EngineState) -> str:
    engine = f"{s.engine_kind} {s.engine_version or '?'}"
    head = (f"== {s.engine} (pid {s.pid}, kvguard {s.kvguard_version}, {engine}) "
            f"checkpoints: {dict(sorted(s.checkpoints_total.items())) or 'none yet'}, "
            f"hook errors: {s.hook_errors_total}")
    lines = [head]
    if s.faults_enabled:
        lines.append(f"   FAULT INJECTION ENABLED: {', '.join(s.faults_enabled)}")
    if s.online is not None and s.online.sweeps_total:
        o = s.online
        lines.append(f"   online audit: {o.sweeps_total} sweeps, the last {o.last_sweep_steps} "
                     f"steps ({o.last_sweep_seconds:.2f} s); detection within "
                     f"{o.detection_latency_steps} steps ({o.detection_latency_seconds:.2f} s); "
                     f"{o.audit_seconds_total:.3f} s spent in all")
    c = s.cost
    if c is not None and c.sampled_steps_total and c.scheduler_seconds_total > 0:
        share = c.self_seconds_total / c.scheduler_seconds_total
        lines.append(f"   kvguard's own cost: {100 * share:.1f} % of scheduler time "
                     f"({1 / (1 - share) if share < 1 else float('inf'):.3f}x), metered over "
                     f"{c.sampled_steps_total} steps ({c.window_steps} in every "
                     f"{c.sample_every_steps})")
    if s.hooks_missing:
        lines.append(f"   hooks missing in this vLLM: {', '.join(s.hooks_missing)}")
    r = s.latest_report
    lines.append(render_report(r) if r is not None else
                 "   no checkpoint yet: the engine has not drained since it started")
    return "\n".join(lines)


def render_kv_events(engine: str, check: KvEventsCheck | None) -> str:
    """One engine's KV-event mirror check (``kvguard kv-events``)."""
    if check is None:
        return f"== {engine}: no KV-event mirror check (the engine publishes no KV events)"
    out = [f"== {engine}: KV-event mirror {check.verdict.value.upper()}"]
    if check.seq is not None:
        out.append(f"   at batch {check.seq} (checkpoint #{check.checkpoint_id}): pool "
                   f"{check.pool_blocks} block(s), mirror {check.mirror_blocks}; "
                   f"{check.stale_blocks} stale, {check.missing_blocks} missing")
    if check.first_stale:
        out.append(f"   first stale: {' '.join(check.first_stale)}")
    if check.first_missing:
        out.append(f"   first missing: {' '.join(check.first_missing)}")
    out.append(f"   {check.explanation}")
    return "\n".join(out)
