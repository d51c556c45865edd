"""The what-if studies of target 8's miss, as results: each answered a question once and
is not part of the default run. Their rows are judged here from the committed results and
written to ``bench/results/what_if.md`` (``python bench/run_all.py --render``).

Each result names the commit whose bench code measured it (``bench_code_commit``): run
that commit's command (``command``) in a checkout of it to measure it again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Final

from harness import against, kept_true, t_interval, verdicts

RESULTS = Path(__file__).resolve().parent / "results"

def against_shipped(t: dict[str, Any], key: str, name: str) -> str:
    """A what-if's ratios, as measured in the same rounds as kvguard as it ships: its own
    to the engine alone, kvguard's, and its own to kvguard's per round."""
    w = t[key]
    return (f"{name} **{w['mean_ratio']:.3f}x** +- {w['interval_half']:.3f}; kvguard as it "
            f"ships {t['mean_ratio']:.3f}x +- {t['interval_half']:.3f}; {name} / as it ships "
            f"{w['vs_shipped_mean_ratio']:.3f}x +- {w['vs_shipped_interval_half']:.3f} (95 %, "
            f"the same {t['rounds']} rounds in {t['processes']} processes, the three ways in "
            f"turn)")


def seam_row_of(t: dict[str, Any], target: float) -> list[str]:
    """The seam row from the result ``t`` of ``bench_step_mix.py seam``."""
    s = t["seam"]
    v = verdicts(t)
    valid = not v.get("leak", 0) and not t["rounds_mismatched"]
    mean, half = s["mean_ratio"], s["interval_half"]
    side = against(mean, half, target)
    rows = t["self_time"].get("rows", {})
    pool = sum(r["us_per_step"] for k, r in rows.items()
               if k in ("hook get_new_blocks", "hook touch", "hook free_blocks",
                        "hook unpin_blocks"))
    shipped = t["self_time"].get("kvguard_us_per_step", 0.0)
    return [
        f"| 8 (what-if) | the same on one engine, {t['machine']['date']}: kvguard without "
        f"its block-pool hooks, each request's references released at its free from the "
        f"block table its claims read (ownership from vLLM's tables at the lifecycle events "
        f"only: the redesign earlier notes proposed; it cannot name an orphan or a double "
        f"free on its path) | {against_shipped(t, 'seam', 'lifecycle-only')}; the pool "
        f"hooks it takes out are {pool:.1f} of kvguard's "
        f"{shipped:.1f} us per step (clocked); drained verdicts "
        + ", ".join(f"{k} {n}" for k, n in sorted(v.items()))
        + " | " + ("measured (a lower bound for that design: "
                   + (f"{side} the target's {target:.2f}x" if side else "not resolved")
                   + ")" if valid else "**not valid** (a leak verdict or different work)")
        + " |"]


_GROUP_WORDS: Final = {"life": "the request lifecycle (admit, preempt, finish, free; the "
                               "claims run there)",
                       "pool": "the block pool's events (allocate, prefix hit, free)",
                       "stepend": "the step end (drain checks, drained checkpoints, the "
                                  "online audit, publishing)"}


def groups_row_of(t: dict[str, Any], target: float) -> list[str]:
    """The groups row from the result ``t`` of ``bench_step_mix.py groups``."""
    m = t["modes"]
    v = dict(t["verdicts"])
    valid = kept_true(t)
    parts = [f"{_GROUP_WORDS.get(k, k)} alone **{m[k]['mean_ratio']:.3f}x** +- "
             f"{m[k]['interval_half']:.3f}" for k in m if k != "on"]
    sides = [against(m[k]["mean_ratio"], m[k]["interval_half"], target)
             for k in m if k != "on"]
    summed = 1 + sum(m[k]["mean_ratio"] - 1 for k in m if k != "on")
    return [
        f"| 8 (by hook group) | the same on one engine, {t['machine']['date']}: kvguard "
        f"whole, each group of its hooks alone, and none, each round every way in turn, "
        f"a fresh ledger each round; no clock in kvguard's code | whole "
        f"**{m['on']['mean_ratio']:.3f}x** +- {m['on']['interval_half']:.3f}; "
        + "; ".join(parts)
        + f" (95 %, {t['rounds']} rounds in {t['processes']} processes; the groups' "
        f"shares add up to {summed:.3f}x); drained verdicts "
        + ", ".join(f"{k} {n}" for k, n in sorted(v.items()))
        + " | " + ((f"measured (each group alone against the target's {target:.2f}x: "
                    f"within {sides.count('within')}, beyond {sides.count('beyond')}, "
                    f"not resolved {sides.count(None)})") if valid
                   else "**not valid** (a verdict other than clean or saturated, an "
                        "unmatched release, a hook error, or different work)")
        + " |"]


def batched_row_of(t: dict[str, Any], target: float) -> list[str]:
    """The batched row from the result ``t`` of ``bench_step_mix.py batched``."""
    b = t["batched"]
    v = verdicts(t)
    valid = kept_true(t)
    mean, half = b["mean_ratio"], b["interval_half"]
    side = against(mean, half, target)
    return [
        f"| 8 (what-if, batched) | the same on one engine, {t['machine']['date']}: "
        f"allocations and prefix hits read once per step from the batch vLLM builds "
        f"(`SchedulerOutput`: each scheduled request's new block ids, already named) "
        f"instead of from the pool, so no allocation hook and no claim at finish or "
        f"preemption; frees, lifecycle hooks and drained audits as they ship (FCFS only: "
        f"a block allocated and freed inside one `schedule` call, or an allocation no "
        f"batch lists, would need more) | {against_shipped(t, 'batched', 'batched')}; "
        f"releases of a block not held {t['double_frees']}; drained verdicts "
        + ", ".join(f"{k} {n}" for k, n in sorted(v.items()))
        + " | " + ("measured ("
                   + (f"{side} the target's {target:.2f}x" if side else "not resolved")
                   + ")" if valid else "**not valid** (a verdict other than clean or "
                   "saturated, an unmatched release, a hook error, or different work)")
        + " |"]


def compiled_row_of(d: dict[str, Any], target: float) -> list[str]:
    """The compiled row from the result ``d`` of ``bench_compiled.py``."""
    ran_compiled = all(x == ".so" for x in d["loaded"]["compiled"].values())
    ran_interpreted = all(x == ".py" for x in d["loaded"]["interpreted"].values())
    v = dict(d["verdicts"])
    valid = ran_compiled and ran_interpreted and not d["rounds_mismatched"] and not v.get("leak")
    a, b = d["sides"]["interpreted"], d["sides"]["compiled"]
    mean, half = d["self_ratio_mean"], d["self_ratio_interval_half"]
    side = against(b["implied_ratio"], 0.0, target)
    modules = ", ".join(f"`{m.removeprefix('kvguard/')}`" for m in d["compiled_modules"])
    return [
        f"| 8 (compiled) | the same mix on one engine build, {d['machine']['date']}: "
        f"kvguard's {modules} compiled to C by mypyc (the same typed source) against the "
        f"same code interpreted, two processes stepped in turn (ABBA), every step metered "
        f"by kvguard's live cost meter | kvguard's own time per step, compiled / "
        f"interpreted **{mean:.3f}x** +- {half:.3f} (95 %, {d['rounds']} rounds in "
        f"{d['processes']} process pairs: "
        + ", ".join(f"{x:.3f}" for x in d["per_process_self_ratio"])
        + f"); {b['self_us']['mean']:.1f} vs {a['self_us']['mean']:.1f} us per step of "
        f"{b['scheduler_us']['mean']:.0f} and {a['scheduler_us']['mean']:.0f} us of "
        f"scheduler time: {100 * b['share_of_scheduler']:.1f} vs "
        f"{100 * a['share_of_scheduler']:.1f} %, the ratio target 8 states "
        f"{b['implied_ratio']:.3f}x vs {a['implied_ratio']:.3f}x; compile "
        f"{d['compile_seconds'] / 60:.1f} min; drained verdicts "
        + ", ".join(f"{k} {n}" for k, n in sorted(v.items()))
        + " | " + (f"measured (compiled, {side} the target's {target:.2f}x)" if valid
                   else "**not valid** (the compiled side did not run compiled modules, "
                        "the sides did different work, or an audit said leak)")
        + " |"]


def before_after_row_of(d: dict[str, Any]) -> list[str]:
    """Target 1 across a change (``compare_revisions.py``): not worse when neither of the
    after revision's per-round medians (online audit on, hooks only) is more than 0.01
    above the before revision's."""
    b, a = d["summary"]["before"], d["summary"]["after"]
    keys = ("per_round_median", "hooks_only_per_round_median")
    worse = any(a[k] - b[k] > 0.01 for k in keys)
    return [f"| 1 (before/after) | target 1 across a change | `{b['revision'][:10]}` -> "
            f"`{a['revision'][:10]}`, "
            f"{d['pairs']} process pairs of {d['rounds_per_process']} rounds: median "
            f"{b['per_round_median']:.3f}x -> **{a['per_round_median']:.3f}x** (audit on), "
            f"{b['hooks_only_per_round_median']:.3f}x -> "
            f"{a['hooks_only_per_round_median']:.3f}x (hooks only) | "
            f"{'**fail**' if worse else '**pass**'} (not worse) |"]


STUDIES: Final = (
    ("step_mix_seam", seam_row_of,
     "Ownership read from vLLM's tables at the lifecycle events only, no block-pool hooks"),
    ("step_mix_batched", batched_row_of,
     "Allocations read once per step from `SchedulerOutput` instead of the pool"),
    ("step_mix_groups", groups_row_of, "kvguard's cost split by hook group"),
    ("compiled", compiled_row_of, "The ledger and hooks compiled to C by mypyc"),
)


def _load(name: str) -> dict[str, Any]:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else {}  # type: ignore[no-any-return]


def summaries() -> list[str]:
    """One line per study for BENCHMARKS.md: the question and its headline figure."""
    out = []
    for name, _, question in STUDIES:
        d = _load(name)
        if not d:
            continue
        if name == "step_mix_groups":
            m = d["modes"]
            figure = (f"whole {m['on']['mean_ratio']:.3f}x; alone: " + ", ".join(
                f"{k} {m[k]['mean_ratio']:.3f}x" for k in m if k != "on"))
        elif name == "compiled":
            figure = (f"kvguard's own time compiled / interpreted "
                      f"{d['self_ratio_mean']:.3f}x +- {d['self_ratio_interval_half']:.3f}")
        else:
            w = d[name.removeprefix("step_mix_")]
            figure = (f"{w['mean_ratio']:.3f}x +- {w['interval_half']:.3f} against "
                      f"{d['mean_ratio']:.3f}x as shipped")
        out.append(f"{question}: {figure} ({d['machine']['date'][:10]}).")
    pairs = _load("step_mix_pairs")
    if pairs:
        out.append(f"Target 8 on two engines in {pairs['pairs']} process pairs (the earlier "
                   f"design, before the one-engine measure): {pairs['pair_mean_ratio']:.3f}x "
                   f"+- {pairs['pair_interval_half']:.3f} ({pairs['machine']['date'][:10]}).")
    long = _load("throughput_long")
    for row in long.get("rows", []):
        out.append(f"Target 7 on one engine, kvguard's hooks in and out per repetition, a "
                   f"{long['budget_seconds_per_mode'] / 60:.0f}-minute run: "
                   f"{row['mean_ratio']:.3f}x +- {row['ci95_half_width']:.3f} "
                   f"({row['pairs']} pairs, {long['machine']['date'][:10]}).")
    out += _repeat_lines()
    ba = _load("hook_overhead_before_after")
    if ba:
        s = ba["summary"]
        out.append(f"Target 1 before and after a change of the ledger: median "
                   f"{s['before']['per_round_median']:.3f}x -> "
                   f"{s['after']['per_round_median']:.3f}x ({ba['machine']['date'][:10]}).")
    return out


def _repeat_lines() -> list[str]:
    """Target 7's interleaved modes run again, one process after another: how far one
    process's mean lies from the next, against the interval each claims from its pairs."""
    d = _load("throughput_repeat")
    by_mode: dict[str, list[dict[str, Any]]] = {}
    for row in d.get("rows", []):
        by_mode.setdefault(row["mode"], []).append(row)
    out = []
    for mode, rows in by_mode.items():
        mean, half = t_interval([r["mean_ratio"] for r in rows])
        claimed = max(r["ci95_half_width"] for r in rows)
        out.append(f"Target 7, {mode} in {len(rows)} processes one after another: "
                   f"{mean:.4f}x +- {half:.4f} over the processes, each claiming up to "
                   f"+- {claimed:.4f} from its own pairs ({d['machine']['date'][:10]}).")
    return out


def render() -> str:
    """``bench/results/what_if.md``: each study's full row, its verdict and how to rerun it."""
    lines = ["# What-if studies (results, not run by default)", "",
             "Generated by `bench/run_all.py --render` from the results beside this file. "
             "Rerun one: `git worktree add /tmp/kvguard-at COMMIT && cd /tmp/kvguard-at && "
             "COMMAND` with the commit and command it names.", ""]
    studies = [(name, fn) for name, fn, _ in STUDIES]
    for name, fn in [*studies, ("hook_overhead_before_after", None),
                     ("step_mix_pairs", None), ("throughput_long", None),
                     ("throughput_repeat", None)]:
        d = _load(name)
        if not d:
            continue
        if fn is not None:
            rows = fn(d, 1.02)
        elif name == "hook_overhead_before_after":
            rows = before_after_row_of(d)
        elif name == "step_mix_pairs":
            rows = [f"| 8 | {d['pairs']} process pairs of {d['rounds_per_pair']} rounds | "
                    f"**{d['pair_mean_ratio']:.3f}x** +- {d['pair_interval_half']:.3f} "
                    "(pairs " + ", ".join(f"{x:.3f}" for x in d["per_pair_mean_ratio"])
                    + ") | measured |"]
        else:
            rows = [f"| 7 | {r['mode']} | **{r['mean_ratio']:.4f}x** +- "
                    f"{r['ci95_half_width']:.4f} ({r['pairs']} pairs) | measured |"
                    for r in d["rows"]]
        r = d.get("reproduce", {})
        lines += [f"## {name}", "", f"Measured {d['machine']['date']} by "
                  f"`{r.get('command', '?')}` at commit `{r.get('commit', '?')}`.", "",
                  "| row | what | measured | verdict |", "|---|---|---|---|", *rows, ""]
    return "\n".join(lines)
