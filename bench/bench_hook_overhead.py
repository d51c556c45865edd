"""Target 1: the real scheduler's time per step with kvguard vs without, alternating.

Three real in-process engines (kvguard with its online audit, kvguard without it, and
none) run 64 concurrent requests each in turn, round after round; the scheduler's time per
step is compared within each round, and the median of the per-round ratios is judged by
its distribution-free 95 % interval.

A step's time is ``Scheduler.schedule`` + ``update_from_output``, the same wrapper on all
three engines outside kvguard's hooks; only steps with all 64 requests running count, and
the order rotates per round (each engine runs alone with warm caches, as in a server).
"""

from __future__ import annotations

import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from harness import RoundBudget, save, stats, time_steps

CONCURRENCY = 64
ROUNDS = int(os.environ.get("KVGUARD_BENCH_ROUNDS", "40"))
"""Most rounds; fewer when the rounds' wall-time budget is spent first."""
MIN_ROUNDS = 12
ROUNDS_SECONDS = 120.0
"""Wall-time budget of the timed rounds (``KVGUARD_BENCH_HOOK_SECONDS``): 40 rounds take
about 100 s on this VM at its fast hours and 250 s at its slow ones."""
MAX_TOKENS = 96


def run_round(h: Any, seed: int) -> None:
    from kvguard.chaos.harness import prompt

    for i in range(CONCURRENCY):
        h.add(prompt(seed * 1000 + i, 32), max_tokens=MAX_TOKENS)
    h.run_to_completion()


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_PLUGINS", "kvguard")
    from kvguard.chaos.harness import EngineHarness
    from kvguard.testing.engine import EngineSpec, build_engine, scheduler_of
    from kvguard.testing.tiny_model import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="kvguard-bench-"))
    os.environ["KVGUARD_RUN_DIR"] = str(tmp / "run")
    spec = EngineSpec(model_dir=make_tiny_model(tmp), num_gpu_blocks_override=1024,
                      max_model_len=512, max_num_seqs=CONCURRENCY,
                      max_num_batched_tokens=4096, kv_cache_memory_bytes=32 << 20)
    on = EngineHarness(spec)
    assert on.guard.online is not None, "the online audit is on by default"
    os.environ["KVGUARD_ONLINE_AUDIT"] = "0"
    hooks_only = EngineHarness(spec)
    del os.environ["KVGUARD_ONLINE_AUDIT"]
    assert hooks_only.guard.online is None
    os.environ["KVGUARD_ENABLED"] = "0"
    off_engine = build_engine(spec)
    del os.environ["KVGUARD_ENABLED"]
    assert getattr(scheduler_of(off_engine), "_kvguard", None) is None

    class Off:  # the same driving interface, no guard
        engine = off_engine
        _n = 0
        add = EngineHarness.add
        step_until = EngineHarness.step_until
        run_to_completion = EngineHarness.run_to_completion

    off: Any = Off()
    samples_on: list[int] = []
    samples_hooks: list[int] = []
    samples_off: list[int] = []
    for sched, samples in ((on.scheduler, samples_on), (hooks_only.scheduler, samples_hooks),
                           (scheduler_of(off_engine), samples_off)):
        # only steps with all 64 requests running
        def full(s: Any = sched) -> bool:
            return len(s.running) == CONCURRENCY
        time_steps(sched, samples, counts=full)
    engines = [(on, samples_on), (hooks_only, samples_hooks), (off, samples_off)]
    for h, _ in engines:  # warm-up
        run_round(h, 0)
    for _, samples in engines:
        samples.clear()
    online = on.guard.online
    busy0 = online.stats.busy_seconds_total
    sweeps0 = online.stats.sweeps_total
    per_round = []
    budget = RoundBudget("KVGUARD_BENCH_HOOK_SECONDS", ROUNDS_SECONDS, min_rounds=MIN_ROUNDS,
                         max_rounds=ROUNDS, step=3)  # each engine first as often
    r = 0
    while budget.more(r):
        r += 1
        marks = [len(samples) for _, samples in engines]
        for h, _ in engines[r % 3:] + engines[:r % 3]:
            run_round(h, r)
        meds = [statistics.median(samples[m:])
                for (_, samples), m in zip(engines, marks, strict=True)]
        per_round.append((meds[0] / meds[2], meds[1] / meds[2]))
    s_on = stats([x / 1000 for x in samples_on])
    s_hooks = stats([x / 1000 for x in samples_hooks])
    s_off = stats([x / 1000 for x in samples_off])
    ratio = s_on["median"] / s_off["median"]
    ratio_hooks = s_hooks["median"] / s_off["median"]
    mean_ratio = s_on["mean"] / s_off["mean"]
    st = online.stats
    audit_s = st.busy_seconds_total - busy0
    sched_s = sum(samples_on) / 1e9
    print(f"with kvguard + online audit {s_on['median']:.1f} us/step (ratio {ratio:.3f}, "
          f"mean ratio {mean_ratio:.3f}); hooks only {s_hooks['median']:.1f} us/step (ratio "
          f"{ratio_hooks:.3f}); without {s_off['median']:.1f} us/step")
    print(f"online audit: {st.sweeps_total - sweeps0} sweeps of {on.num_usable()} blocks, "
          f"last {st.last_sweep_steps} steps / {st.last_sweep_seconds * 1000:.1f} ms; audit "
          f"time {audit_s * 1000:.1f} ms = {audit_s / sched_s:.4f} of the measured scheduler "
          f"time (budget {online.opts.budget_fraction}); worst-case detection "
          f"{3 * st.last_sweep_steps} steps / {3 * st.last_sweep_seconds * 1000:.0f} ms")
    save("hook_overhead", {"with_us": s_on, "hooks_only_us": s_hooks, "without_us": s_off,
                           "ratio": ratio, "ratio_hooks_only": ratio_hooks,
                           "mean_ratio": mean_ratio,
                           "ratio_per_round": [r[0] for r in per_round],
                           "ratio_hooks_only_per_round": [r[1] for r in per_round],
                           "target_ratio": 1.02, "concurrency": CONCURRENCY, "rounds": r,
                           "rounds_seconds": budget.spent(), "max_rounds": ROUNDS,
                           "online": {"budget_fraction": online.opts.budget_fraction,
                                      "sweeps": st.sweeps_total - sweeps0,
                                      "pool_blocks": on.num_usable(),
                                      "sweep_steps": st.last_sweep_steps,
                                      "sweep_seconds": st.last_sweep_seconds,
                                      "audit_seconds": audit_s,
                                      "audit_share_of_scheduler_time": audit_s / sched_s,
                                      "detection_latency_steps": 3 * st.last_sweep_steps,
                                      "detection_latency_seconds": 3 * st.last_sweep_seconds},
                           "events": dict(on.guard.ledger.num_events)})
    os._exit(0)
