"""Target 1: the real scheduler's time per step with kvguard vs without, alternating.

Two real in-process engines side by side, one with kvguard attached and one
built with ``KVGUARD_ENABLED=0``. Each round runs 64 concurrent requests to
completion on one engine, then on the other; per step, the time spent in
``Scheduler.schedule`` + ``Scheduler.update_from_output`` is measured (the same
timing wrapper on both, outside kvguard's hooks, so kvguard's cost is inside).
Only steps with all 64 requests running count.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from common import save, stats

CONCURRENCY = 64
ROUNDS = 6
MAX_TOKENS = 96


def timed(sched: Any, samples: list[int]) -> None:
    schedule, update = sched.schedule, sched.update_from_output
    acc = [0]

    def schedule_timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter_ns()
        try:
            return schedule(*a, **k)
        finally:
            acc[0] = time.perf_counter_ns() - t

    def update_timed(*a: Any, **k: Any) -> Any:
        t = time.perf_counter_ns()
        try:
            return update(*a, **k)
        finally:
            if len(sched.running) == CONCURRENCY:
                samples.append(acc[0] + time.perf_counter_ns() - t)

    sched.schedule, sched.update_from_output = schedule_timed, update_timed


def run_round(h: Any, seed: int) -> None:
    from kvguard.chaos.harness import prompt

    for i in range(CONCURRENCY):
        h.add(prompt(seed * 1000 + i, 32), max_tokens=MAX_TOKENS)
    h.run_to_completion()


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_PLUGINS", "kvguard")
    from kvguard.chaos.harness import EngineHarness
    from kvguard.demo.engine import EngineSpec, build_engine, scheduler_of
    from kvguard.demo.tiny_model import make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="kvguard-bench-"))
    os.environ["KVGUARD_RUN_DIR"] = str(tmp / "run")
    spec = EngineSpec(model_dir=make_tiny_model(tmp), num_gpu_blocks_override=1024,
                      max_model_len=512, max_num_seqs=CONCURRENCY,
                      max_num_batched_tokens=4096, kv_cache_memory_bytes=32 << 20)
    on = EngineHarness(spec)
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
    samples_off: list[int] = []
    timed(on.scheduler, samples_on)
    timed(scheduler_of(off_engine), samples_off)
    run_round(on, 0)  # warm-up both
    run_round(off, 0)
    samples_on.clear()
    samples_off.clear()
    per_round = []
    for r in range(1, ROUNDS + 1):
        a0, b0 = len(samples_on), len(samples_off)
        first, second = (on, off) if r % 2 else (off, on)
        run_round(first, r)
        run_round(second, r)
        per_round.append(statistics.median(samples_on[a0:]) / statistics.median(samples_off[b0:]))
    s_on = stats([x / 1000 for x in samples_on])
    s_off = stats([x / 1000 for x in samples_off])
    ratio = s_on["median"] / s_off["median"]
    print(f"with kvguard {s_on['median']:.1f} us/step, without {s_off['median']:.1f} us/step, "
          f"ratio {ratio:.3f} (per round {[round(x, 3) for x in per_round]})")
    save("hook_overhead", {"with_us": s_on, "without_us": s_off, "ratio": ratio,
                           "ratio_per_round": per_round, "target_ratio": 1.02,
                           "concurrency": CONCURRENCY, "rounds": ROUNDS,
                           "events": dict(on.guard.ledger.num_events)})
    os._exit(0)
