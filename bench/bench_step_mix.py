"""Target 8: scheduler time per step with kvguard vs without, every step counted, a real mix.

Every step counted on a real mix (prefix hits, preemption, aborts, speculative decoding):
one engine with kvguard's hooks put in and taken out each round (ABBA), so no process
bias; pass-through wrappers on the same methods split the interception from kvguard's
work; once more with the opt-in checkpoint pace.

A round: 64 requests in 4 groups sharing a 64-token prefix, 96 output tokens each in a
160-block pool, 8 aborted at step 24, a draft model proposing 3 tokens per step. A step's
time is its ``schedule`` and ``update_from_output`` plus the ``add_request`` calls since
the step before (kvguard's admission hook, and a drained audit the checkpoint pace owes,
run there). Decoding is greedy so that every way takes the same steps (sampled runs
diverge between processes even with kvguard off: 70 vs 91 steps for one round), checked
with vLLM's counters. Each round runs the three ways in turn (ABC, CBA), the prefix cache
reset before each; reported: the mean of the per-round ratios with its 95 % interval, and,
in the first process, kvguard's own time per hook and session method (a clock at every
boundary). The what-if studies once run from here are results (``bench/results/what_if.md``).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Final

from harness import (
    RoundBudget,
    Worker,
    abba,
    kvguard_hooks,
    reply,
    save,
    set_hooks,
    stats,
    t_interval,
    time_steps,
    verdict_counts,
)

REQUESTS, GROUPS, OUTPUT_TOKENS, POOL_BLOCKS = 64, 4, 96, 160
ABORT_AT_STEP, ABORTED = 24, 8
COUNTERS = ("vllm:num_preemptions", "vllm:prefix_cache_hits",
            "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
"""vLLM's own counts of the work in a round (every side must show the same)."""
PROCESSES = int(os.environ.get("KVGUARD_BENCH_MIX_TOGGLE_PROCESSES", "2"))
MAX_ROUNDS = int(os.environ.get("KVGUARD_BENCH_MIX_TOGGLE_ROUNDS", "16"))
"""Rounds per process, each every way in turn."""
MIN_ROUNDS = 8
SECONDS = 100.0
"""Wall-time budget of one process's rounds past ``MIN_ROUNDS``
(``KVGUARD_BENCH_MIX_TOGGLE_SECONDS``): 16 rounds take 60-150 s on this VM."""
SELF_TIME_ROUNDS = 2
PACED_SECONDS = 40.0
"""The paced measurement's budget, one process (``KVGUARD_BENCH_MIX_PACED_SECONDS``)."""
PACED_INTERVAL = "10"
"""``KVGUARD_CHECKPOINT_MIN_INTERVAL_SECONDS`` of the paced measurement: a round takes 1-2 s
here, so at 1 s every drain would pass; at 10 s most are let go and audited later."""
MODES: Final = ("on", "bare", "off")
"""kvguard's hooks, :func:`passthrough` wrappers on the same methods, the engine's own."""


def passthrough(orig: Any) -> Any:
    """A wrapper of a kvguard hook's shape (a Python frame around the engine's call) that
    does no work: a step then pays the interception alone."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return orig(*args, **kwargs)
    return wrapper


def prompt(group: int, r: int, n: int = 96) -> list[int]:
    """A 64-token prefix per group, then a suffix of the request's own."""
    prefix = [4 + (group * 997 + i * 37) % 500 for i in range(64)]
    motif = [4 + (group * 131 + r * 17 + i * 29) % 500 for i in range(8)]
    return prefix + (motif * ((n - 64) // 8 + 1))[: n - 64]


def run_round(h: Any, seed: int) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0.0)
    rids = [f"r{seed}-{r}" for r in range(REQUESTS)]
    for r, rid in enumerate(rids):
        tokens = prompt(r % GROUPS, seed * 100 + r)
        h.engine.add_request(rid, TokensPrompt(prompt_token_ids=tokens), params)
    for _ in range(ABORT_AT_STEP):
        h.engine.step()
    h.engine.abort_request(rids[::REQUESTS // ABORTED][:ABORTED])
    h.run_to_completion()


def build_engine() -> Any:
    """The engine of the mix, with kvguard: the tiny Llama, a 160-block pool, a draft model."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from kvguard.chaos.harness import EngineHarness
    from kvguard.testing.engine import EngineSpec
    from kvguard.testing.tiny_model import make_draft_model, make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="kvguard-bench-mix-"))
    os.environ["KVGUARD_RUN_DIR"] = str(tmp / "run")
    return EngineHarness(EngineSpec(
        model_dir=make_tiny_model(tmp), num_gpu_blocks_override=POOL_BLOCKS,
        max_model_len=512, max_num_seqs=REQUESTS, max_num_batched_tokens=2048,
        kv_cache_memory_bytes=32 << 20,
        extra={"speculative_config": {"method": "draft_model",
                                      "model": str(make_draft_model(tmp)),
                                      "num_speculative_tokens": 3}}))


def toggle_worker(modes: tuple[str, ...]) -> None:
    """``run SEED MODE``: one round, its step times (us) and vLLM's counts of its work;
    ``verdicts``: what kvguard's drained audits said; ``selftime ROUNDS``: :func:`self_time`."""
    h = build_engine()
    hooks = kvguard_hooks(h.scheduler)
    samples: list[int] = []

    def set_mode(mode: str) -> None:
        set_hooks(hooks, mode == "on")
        if mode == "bare":
            for obj, name, _ in hooks:
                setattr(obj, name, passthrough(getattr(type(obj), name).__get__(obj)))
        time_steps(h.scheduler, samples, admission=True)

    for mode in modes:
        set_mode(mode)
        run_round(h, 0)  # warm-up, every way
    reply("ready")
    for line in sys.stdin:
        words = line.split()
        if words[0] == "verdicts":
            g = h.guard
            reply({"verdicts": verdict_counts(g), "drains_unaudited": g.pacer.drains_unaudited,
                   "double_frees": g.ledger.num_double_frees,
                   "hook_errors": dict(g.errors.by_hook)})
        elif words[0] == "selftime":
            set_mode("on")
            # Hooks taken out between drained rounds must leave kvguard's records true.
            reply(self_time(h, hooks, int(words[1])) | {"verdicts": verdict_counts(h.guard)})
        else:
            set_mode(words[2])
            samples.clear()
            h.engine.reset_prefix_cache()  # every way starts from the same pool state
            before = {k: h.vllm_metric(k) for k in COUNTERS}
            run_round(h, int(words[1]))
            reply({"us": [x / 1000 for x in samples],
                   "vllm": {k: h.vllm_metric(k) - before[k] for k in COUNTERS}})
    os._exit(0)


def self_time(h: Any, hooks: list[tuple[Any, str, Any]], rounds: int) -> dict[str, Any]:
    """kvguard's own time per hook and per session method, per step (us), over ``rounds``.

    A clock read at every boundary between kvguard and the engine charges each interval to
    the hook or method running (nested calls to the innermost); the clocks cost about
    0.1-0.3 us per boundary, inside the buckets."""
    pc = time.perf_counter_ns
    names = ["engine"]
    acc, calls = [0] * 64, [0] * 64
    cur = [-1, 0]

    def switch(to: int) -> None:
        now = pc()
        if cur[0] >= 0:
            acc[cur[0]] += now - cur[1]
        cur[0], cur[1] = to, now

    def bucketed(fn: Any, i: int) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            prev = cur[0]
            switch(i)
            calls[i] += 1
            try:
                return fn(*a, **k)
            finally:
                switch(prev)
        return run

    restore: list[tuple[Any, str, Any]] = []
    for o, n, f in hooks:
        for cell in f.__closure__ or ():  # the engine's method the hook calls
            c = cell.cell_contents
            if callable(c) and getattr(c, "__name__", None) == n and c is not f:
                cell.cell_contents = bucketed(c, 0)
                restore.append((cell, "cell", c))
                break
        names.append(f"hook {n}")
        setattr(o, n, bucketed(f, len(names) - 1))
        restore.append((o, n, f))
    g = h.guard
    for n in ("claim", "checkpoint_now", "publish", "on_admitted", "on_finished",
              "drain_blocker"):
        names.append(f"session {n}")
        setattr(g, n, bucketed(getattr(g, n), len(names) - 1))
        restore.append((g, n, None))
    online = g._online  # the online audit's monitor: its work on the steps that earned some
    if online is not None:
        names.append("session _online_step")  # the row's name in results before the split
        online._step = bucketed(online._step, len(names) - 1)
        restore.append((online, "_step", None))
    sched = h.scheduler
    steps = [0]
    schedule, update = sched.schedule, sched.update_from_output
    sched.schedule = bucketed(schedule, 0)
    counted_update = bucketed(update, 0)

    def update_counted(*a: Any, **k: Any) -> Any:
        steps[0] += 1
        return counted_update(*a, **k)
    sched.update_from_output = update_counted
    for r in range(rounds):
        run_round(h, 1000 + r)
    switch(-1)
    # The step counters first: they wrap the hooks' clocked wrappers, which the loop below
    # then replaces with the hooks themselves (the other order left the clocked ones on).
    sched.schedule, sched.update_from_output = schedule, update
    for o, n, f in restore:
        if n == "cell":
            o.cell_contents = f
        elif f is None:
            del o.__dict__[n]
        else:
            setattr(o, n, f)
    n_steps = max(steps[0], 1)
    rows = {names[i]: {"us_per_step": acc[i] / n_steps / 1000,
                       "calls_per_step": calls[i] / n_steps,
                       "us_per_call": acc[i] / max(calls[i], 1) / 1000}
            for i in range(1, len(names)) if calls[i]}
    return {"steps": n_steps, "engine_us_per_step": acc[0] / n_steps / 1000,
            "kvguard_us_per_step": sum(acc[1:]) / n_steps / 1000, "rows": rows}


def measure_toggle(env: dict[str, str], tmp: Path, modes: tuple[str, ...] = MODES, *,
                   processes: int = PROCESSES, seconds: float = SECONDS,
                   seconds_env: str = "KVGUARD_BENCH_MIX_TOGGLE_SECONDS") -> dict[str, Any]:
    """``modes`` in turn each round, in ``processes`` worker processes one after another;
    kvguard's own time per hook in the first when ``bare`` is among them (the full run)."""
    per_round, per_process = [], []
    us: dict[str, list[float]] = {m: [] for m in modes}
    split: dict[str, list[float]] = {"bare": [], "work": []}
    mismatched = unaudited = double_frees = 0
    breakdown: dict[str, Any] = {}
    verdicts: Counter[str] = Counter()
    hook_errors: Counter[str] = Counter()
    for p in range(processes):
        w = Worker(__file__, ["toggle", *modes], env, tmp / f"toggle-{p}.log")
        try:
            budget = RoundBudget(seconds_env, seconds, min_rounds=min(MIN_ROUNDS, MAX_ROUNDS),
                                 max_rounds=MAX_ROUNDS, step=2)
            seed = 500 + p * MAX_ROUNDS  # distinct per process up to the most rounds
            def ask(r: int, m: str, w: Worker = w, s: int = seed) -> Any:
                return w.ask(f"run {s + r} {m}")
            rounds = abba(budget, modes, ask)
            for got in rounds:
                mismatched += any(len(got[k]["us"]) != len(got["off"]["us"])
                                  or got[k]["vllm"] != got["off"]["vllm"] for k in modes)
                mean_of = {k: statistics.fmean(got[k]["us"]) for k in modes}
                per_round.append(mean_of["on"] / mean_of["off"])
                if "bare" in modes:
                    split["bare"].append(mean_of["bare"] / mean_of["off"])
                    split["work"].append(mean_of["on"] / mean_of["bare"])
            mine = {k: [x for got in rounds for x in got[k]["us"]] for k in modes}
            per_process.append(statistics.fmean(mine["on"]) / statistics.fmean(mine["off"]))
            for k in modes:
                us[k] += mine[k]
            out = w.ask("verdicts")
            verdicts.update(out["verdicts"])
            unaudited += out["drains_unaudited"]
            double_frees += out["double_frees"]
            hook_errors.update(out["hook_errors"])
            if p == 0 and "bare" in modes:
                breakdown = w.ask(f"selftime {SELF_TIME_ROUNDS}")
        finally:
            w.close()
    mean, half = t_interval(per_round)
    out = {"per_round_mean_ratio": per_round, "per_process_mean_ratio": per_process,
           "mean_ratio": mean, "interval_half": half, "rounds": len(per_round),
           "processes": processes, "rounds_mismatched": mismatched,
           "median_ratio": statistics.median(us["on"]) / statistics.median(us["off"]),
           "with_us": stats(us["on"]), "without_us": stats(us["off"]),
           "verdicts": dict(verdicts), "drains_unaudited": unaudited,
           "double_frees": double_frees, "hook_errors": dict(hook_errors),
           "self_time": breakdown}
    if "bare" in modes:
        (bare_mean, bare_half), (work_mean, work_half) = map(t_interval, split.values())
        out["floor"] = {"bare_mean_ratio": bare_mean, "bare_interval_half": bare_half,
                        "work_mean_ratio": work_mean, "work_interval_half": work_half,
                        "per_round_bare_ratio": split["bare"],
                        "per_round_work_ratio": split["work"], "bare_us": stats(us["bare"])}
    return out


def main() -> None:
    # One hash seed and plain request ids: vLLM iterates sets of request ids, and a random
    # id suffix would order the batches differently from round to round.
    os.environ.setdefault("VLLM_PLUGINS", "kvguard")
    env = {"PYTHONHASHSEED": "0", "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1"}
    tmp = Path(tempfile.mkdtemp(prefix="kvguard-bench-mix-"))
    toggle = measure_toggle(env, tmp)
    paced = measure_toggle(env | {"KVGUARD_CHECKPOINT_MIN_INTERVAL_SECONDS": PACED_INTERVAL},
                           tmp, ("on", "off"), processes=1, seconds=PACED_SECONDS,
                           seconds_env="KVGUARD_BENCH_MIX_PACED_SECONDS")
    print(f"same engine, hooks in/out: {toggle['mean_ratio']:.4f} +- "
          f"{toggle['interval_half']:.4f} over {toggle['rounds']} rounds "
          f"({toggle['rounds_mismatched']} with different work); checkpoint pace "
          f"{PACED_INTERVAL} s: {paced['mean_ratio']:.4f} +- {paced['interval_half']:.4f}")
    save("step_mix", {"target_mean_ratio": 1.02, "toggle": toggle,
                      "toggle_paced": paced | {"interval_seconds": float(PACED_INTERVAL)}})


if __name__ == "__main__":
    if sys.argv[1:3] == ["worker", "toggle"]:
        toggle_worker(tuple(sys.argv[3:]))
    else:
        main()
