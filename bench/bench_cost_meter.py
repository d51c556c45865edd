"""kvguard's live cost meter (``kvguard_cost_*``) against the step-mix benchmark's clocks.

The step mix again, reading kvguard's own live meter (``kvguard_cost_*``): what an
operator sees must fall inside target 8's interval.

Rounds alternate (AB BA) between the meter with every step metered and the benchmark's
own clocks at every hook boundary (``bench_step_mix.self_time``, meter off); reported: both
per-step self times and the scheduler ratio each implies. Then, per scheduling mode,
target 7's workload through ``LLM.generate`` with every step metered: kvguard's own time
as a share of wall time, the direct part of the end-to-end cost.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import MARK, RoundBudget, abba, kvguard_hooks, reply, save

ROUNDS_MIN, ROUNDS_MAX = 4, 12
SECONDS = 60.0
"""Wall-time budget past the minimum (``KVGUARD_BENCH_METER_SECONDS``)."""


DIRECT_REPETITIONS = 4
"""Repetitions of target 7's workload per scheduling mode for the direct cost."""


def direct_worker(scheduling: str) -> None:
    """Target 7's workload with every step metered: kvguard's own time against the
    repetitions' wall time."""
    import bench_throughput as tput
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvguard.testing.engine import scheduler_of
    from kvguard.testing.tiny_model import make_tiny_model
    from kvguard.vllm_plugin.guard import guard_of

    llm = tput.warm_llm(scheduling, str(make_tiny_model(Path(tempfile.mkdtemp()))))
    g = guard_of(scheduler_of(llm.llm_engine))
    assert g is not None, "kvguard is not attached to the engine"
    m = g.meter
    s0, c0, n0 = m.self_ns_total, m.scheduler_ns_total, m.steps_total
    wall = 0.0
    for seed in range(1, DIRECT_REPETITIONS + 1):
        llm.reset_prefix_cache()
        batch = [TokensPrompt(prompt_token_ids=p) for p in tput.prompts(seed)]
        params = SamplingParams(max_tokens=tput.OUTPUT_TOKENS, ignore_eos=True, temperature=0.0)
        t0 = time.perf_counter()
        llm.generate(batch, params, use_tqdm=False)
        wall += time.perf_counter() - t0
    reply({"scheduling": scheduling, "steps": m.steps_total - n0, "wall_s": wall,
           "self_s": (m.self_ns_total - s0) / 1e9,
           "scheduler_s": (m.scheduler_ns_total - c0) / 1e9, "hook_errors": g.errors.total})
    os._exit(0)


def direct(scheduling: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "direct", scheduling], text=True,
                         capture_output=True, check=True,
                         env={**os.environ, "KVGUARD_COST_SAMPLE_EVERY_STEPS": "1",
                              "KVGUARD_RUN_DIR": tempfile.mkdtemp(prefix="kvguard-meter-")})
    line = next(x for x in out.stdout.splitlines() if x.startswith(MARK))
    row: dict[str, Any] = json.loads(line[len(MARK):])
    row["self_share_of_wall"] = row["self_s"] / row["wall_s"]
    row["self_share_of_scheduler"] = row["self_s"] / row["scheduler_s"]
    print(f"direct cost, {scheduling}: kvguard {100 * row['self_share_of_wall']:.2f} % of "
          f"wall time, {100 * row['self_share_of_scheduler']:.1f} % of scheduler time",
          flush=True)
    return row


def main() -> None:
    import bench_step_mix as mix

    os.environ.setdefault("VLLM_PLUGINS", "kvguard")
    h = mix.build_engine()
    g = h.guard
    hooks = kvguard_hooks(h.scheduler)

    def meter(every: int) -> None:
        g.config = dataclasses.replace(g.config, cost_sample_every_steps=every)

    def metered(r: int) -> dict[str, float]:
        meter(1)
        m = g.meter
        s0, c0, n0 = m.self_ns_total, m.scheduler_ns_total, m.steps_total
        mix.run_round(h, 100 + r)
        meter(0)
        n = m.steps_total - n0
        return {"steps": n, "self_us": (m.self_ns_total - s0) / 1e3 / n,
                "scheduler_us": (m.scheduler_ns_total - c0) / 1e3 / n}

    def clocked(r: int) -> dict[str, float]:
        st = mix.self_time(h, hooks, 1)
        return {"steps": st["steps"], "self_us": st["kvguard_us_per_step"],
                "engine_us": st["engine_us_per_step"],
                "hook_calls": sum(v["calls_per_step"] for k, v in st["rows"].items()
                                  if k.startswith("hook "))}

    mix.run_round(h, 0)  # warm
    budget = RoundBudget("KVGUARD_BENCH_METER_SECONDS", SECONDS, min_rounds=ROUNDS_MIN,
                         max_rounds=ROUNDS_MAX, step=2)
    ways = {"meter": metered, "clocks": clocked}
    rounds = abba(budget, tuple(ways), lambda r, way: ways[way](r))
    r = len(rounds)
    meter_rows = [x["meter"] for x in rounds]
    clock_rows = [x["clocks"] for x in rounds]

    def pooled(rows: list[dict[str, float]], key: str) -> float:
        return sum(x[key] * x["steps"] for x in rows) / sum(x["steps"] for x in rows)

    m_self, m_sched = pooled(meter_rows, "self_us"), pooled(meter_rows, "scheduler_us")
    c_self, c_engine = pooled(clock_rows, "self_us"), pooled(clock_rows, "engine_us")
    diff = m_self / c_self - 1
    save("cost_meter", {
        "rounds": r, "meter": meter_rows, "clocks": clock_rows,
        "meter_self_us_per_step": m_self, "meter_scheduler_us_per_step": m_sched,
        "meter_ratio": m_sched / (m_sched - m_self),
        "clocks_self_us_per_step": c_self, "clocks_engine_us_per_step": c_engine,
        "clocks_ratio": (c_engine + c_self) / c_engine,
        "hook_calls_per_step": pooled(clock_rows, "hook_calls"),
        "relative_difference": diff,
        "hook_errors": g.errors.total,
        "direct": [direct(mode) for mode in ("sync", "async")]})
    print(f"meter {m_self:.1f} us/step ({m_sched / (m_sched - m_self):.3f}x), clocks "
          f"{c_self:.1f} us/step ({(c_engine + c_self) / c_engine:.3f}x): {100 * diff:+.1f} %",
          flush=True)
    os._exit(0)  # vLLM's engine threads would hold the interpreter open


if __name__ == "__main__":
    if sys.argv[1:2] == ["direct"]:
        direct_worker(sys.argv[2])
    else:
        main()
