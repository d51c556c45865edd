"""Target 8: scheduler time per step with kvguard vs without, every step counted, a real mix.

Target 1 (``bench_hook_overhead.py``) times the steady state: only steps with all 64
requests running. Here every step counts (admission, chunked prefills, finishing, the
drained checkpoint each round ends with), on a workload with the paths where kvguard
does more work:

- prefix hits: 4 groups of 16 requests share a 64-token prefix;
- preemption: 64 requests of up to 96 + 96 tokens do not fit a 160-block pool;
- aborts: 8 requests are aborted mid-decode, at step 24 of each round;
- speculative decoding: a draft model (the tiny draft, 3 tokens per step), so every
  step allocates lookahead slots for the drafts.

Decoding is greedy, so that both engines take exactly the same steps and the per-step
mean compares the same batches. Sampled runs diverge between two processes even with
kvguard off on both (measured: 70 vs 91 steps for the same round; the batch order and
the CPU kernels' float sums change which token a request draws), so a per-step mean
would compare different work. Greedy costs nothing kvguard hooks: on these dummy
weights the target accepts every draft, and a rejected draft only rolls vLLM's token
counters back (``Scheduler.update_from_output``), it frees no block.

Two real in-process engines, each in a worker process of its own (kvguard with its
defaults, and one built with ``KVGUARD_ENABLED=0``; vLLM 0.32's CPU build cannot build a
second engine with speculative decoding in one process, ``draft_model`` or ``ngram``),
both alive and warm, the same timing wrapper on both, outside kvguard's hooks; rounds
alternate the order (ABBA). A process carries a bias of its own that rounds cannot
cancel (two kvguard-off processes measured 1.09x and 0.95x against each other), so this
is repeated over ``PAIRS`` fresh process pairs. Reported: the mean over pairs of each
pair's ratio of mean step times, with its 95 % interval (the criterion, target <= 1.02:
a pass needs the interval's upper end within it, a miss its lower end beyond it), the
pooled ratios of means and medians, the per-round ratios, and the slowest steps of each
engine with what kvguard did in them, which is what makes a mean exceed a median.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import Worker, reply, save, stats, t_interval

PAIRS = int(os.environ.get("KVGUARD_BENCH_MIX_PAIRS", "3"))
"""Process pairs: each process carries a bias of its own (memory layout, thread placement;
measured: 1.09x and 0.95x between two kvguard-off processes over 8 rounds), which rounds
within one pair cannot cancel, so the criterion is the mean over pairs with its interval."""
ROUNDS = int(os.environ.get("KVGUARD_BENCH_MIX_ROUNDS", "6"))
"""Rounds per process pair, alternating the order (ABBA)."""
REQUESTS = 64
GROUPS = 4
OUTPUT_TOKENS = 96
ABORT_AT_STEP = 24
ABORTED = 8
POOL_BLOCKS = 160


GC_IN_STEPS = {"ns": 0, "collections": 0, "start": 0, "in_step": 0}
"""Garbage-collection pauses that fall inside timed steps (``gc.callbacks``): both sides
pay them, kvguard's side for its own objects too."""


def _on_gc(phase: str, info: dict[str, int]) -> None:
    g = GC_IN_STEPS
    if phase == "start":
        g["start"] = time.perf_counter_ns()
    elif g["in_step"]:
        g["ns"] += time.perf_counter_ns() - g["start"]
        g["collections"] += 1


def timed(sched: Any, samples: list[int], tags: list[str], guard: Any) -> None:
    """Time every ``schedule`` + ``update_from_output`` pair; tag what kvguard did in it."""
    schedule, update = sched.schedule, sched.update_from_output
    acc = [0]

    def marks() -> tuple[int, int]:
        if guard is None:
            return 0, 0
        return len(guard.reports), guard.online.stats.sweeps_total if guard.online else 0

    def schedule_timed(*a: Any, **k: Any) -> Any:
        GC_IN_STEPS["in_step"] = 1
        t = time.perf_counter_ns()
        try:
            return schedule(*a, **k)
        finally:
            acc[0] = time.perf_counter_ns() - t
            GC_IN_STEPS["in_step"] = 0

    def update_timed(*a: Any, **k: Any) -> Any:
        before = marks()
        GC_IN_STEPS["in_step"] = 1
        t = time.perf_counter_ns()
        try:
            return update(*a, **k)
        finally:
            samples.append(acc[0] + time.perf_counter_ns() - t)
            GC_IN_STEPS["in_step"] = 0
            after = marks()
            tags.append("checkpoint" if after[0] != before[0] else
                        "sweep" if after[1] != before[1] else "")

    sched.schedule, sched.update_from_output = schedule_timed, update_timed


def prompt(group: int, r: int, n: int = 96) -> list[int]:
    """A 64-token prefix per group, then a suffix of the request's own."""
    prefix = [4 + (group * 997 + i * 37) % 500 for i in range(64)]
    motif = [4 + (group * 131 + r * 17 + i * 29) % 500 for i in range(8)]
    return prefix + (motif * ((n - 64) // 8 + 1))[: n - 64]


def run_round(h: Any, seed: int) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rids = []
    for r in range(REQUESTS):
        rid = f"r{seed}-{r}"
        # Greedy: both sides take the same steps (module docstring).
        params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0.0)
        h.engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt(r % GROUPS,
                                                                       seed * 100 + r)),
                             params)
        rids.append(rid)
    for _ in range(ABORT_AT_STEP):
        h.engine.step()
    h.engine.abort_request(rids[::REQUESTS // ABORTED][:ABORTED])
    h.run_to_completion()


def worker(enabled: str) -> None:
    """One side in this process: a real engine, kvguard on or off; a round per ``run SEED``,
    answered with its step times (us) and what kvguard did in each step."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from kvguard.chaos.harness import EngineHarness
    from kvguard.demo.engine import EngineSpec, build_engine, scheduler_of
    from kvguard.demo.tiny_model import make_draft_model, make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="kvguard-bench-mix-"))
    os.environ["KVGUARD_RUN_DIR"] = str(tmp / "run")
    spec = EngineSpec(model_dir=make_tiny_model(tmp), num_gpu_blocks_override=POOL_BLOCKS,
                      max_model_len=512, max_num_seqs=REQUESTS, max_num_batched_tokens=2048,
                      kv_cache_memory_bytes=32 << 20,
                      extra={"speculative_config": {"method": "draft_model",
                                                    "model": str(make_draft_model(tmp)),
                                                    "num_speculative_tokens": 3}})
    h: Any
    guard = None
    if enabled == "on":
        h = EngineHarness(spec)
        guard = h.guard
        sched = h.scheduler
    else:
        os.environ["KVGUARD_ENABLED"] = "0"
        engine = build_engine(spec)
        sched = scheduler_of(engine)
        assert getattr(sched, "_kvguard", None) is None

        class Off:  # the same driving interface, no guard
            _n = 0
            add = EngineHarness.add
            step_until = EngineHarness.step_until
            run_to_completion = EngineHarness.run_to_completion
            vllm_metric = EngineHarness.vllm_metric

        h = Off()
        h.engine = engine
    samples: list[int] = []
    tags: list[str] = []
    timed(sched, samples, tags, guard)
    gc.callbacks.append(_on_gc)
    run_round(h, 0)  # warm-up
    events0 = dict(guard.ledger.num_events) if guard else {}
    reply("ready")
    for line in sys.stdin:
        if line.startswith("summary"):
            m = h.vllm_metric
            reply({"events": {e: n - events0.get(e, 0)
                              for e, n in (guard.ledger.num_events.items() if guard else ())},
                   "vllm": {k: m(k) for k in ("vllm:num_preemptions",
                                              "vllm:prefix_cache_hits",
                                              "vllm:spec_decode_num_draft_tokens",
                                              "vllm:spec_decode_num_accepted_tokens")}})
            continue
        samples.clear()
        tags.clear()
        GC_IN_STEPS["ns"] = GC_IN_STEPS["collections"] = 0
        run_round(h, int(line.split()[1]))
        reply({"us": [x / 1000 for x in samples], "tags": tags,
               "gc_us": GC_IN_STEPS["ns"] / 1000, "gc_collections": GC_IN_STEPS["collections"]})
    os._exit(0)


def _start_pair(env: dict[str, str], tmp: Path, pair: int) -> dict[str, Worker]:
    """Both sides of one process pair, built at once (one per core)."""
    sides: dict[str, Worker] = {}
    errors: list[BaseException] = []

    def start(k: str) -> None:
        try:
            sides[k] = Worker(__file__, [k], env, tmp / f"{k}-{pair}.log")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(k,)) for k in ("on", "off")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for w in sides.values():
            w.close()
        raise errors[0]
    return sides


def main() -> None:
    os.environ.setdefault("VLLM_PLUGINS", "kvguard")
    tmp = Path(tempfile.mkdtemp(prefix="kvguard-bench-mix-"))
    # One hash seed for both: vLLM iterates sets of request ids, so two processes with
    # different seeds schedule differently (measured: 25 % more steps on one side).
    # And the request ids vLLM gives the engine without its random 8-character suffix,
    # which would order the batches differently on the two sides.
    same = {"PYTHONHASHSEED": "0", "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1"}
    us: dict[str, list[float]] = {"on": [], "off": []}
    tags: dict[str, list[str]] = {"on": [], "off": []}
    per_round: list[dict[str, float]] = []
    per_pair: list[float] = []
    gc_us: dict[str, float] = {"on": 0.0, "off": 0.0}
    gc_n: dict[str, int] = {"on": 0, "off": 0}
    vllm: dict[str, dict[str, float]] = {"on": {}, "off": {}}
    events: dict[str, int] = {}
    for pair in range(PAIRS):
        sides = _start_pair(same, tmp, pair)
        pair_us: dict[str, list[float]] = {"on": [], "off": []}
        try:
            for r in range(1, ROUNDS + 1):
                seed = pair * ROUNDS + r
                got: dict[str, list[float]] = {}
                for k in (("on", "off") if seed % 2 else ("off", "on")):
                    out = sides[k].ask(f"run {seed}")
                    assert isinstance(out, dict)
                    got[k] = out["us"]
                    pair_us[k] += out["us"]
                    gc_us[k] += out["gc_us"]
                    gc_n[k] += out["gc_collections"]
                    tags[k] += out["tags"]
                per_round.append({
                    "pair": float(pair),
                    "mean_ratio": statistics.fmean(got["on"]) / statistics.fmean(got["off"]),
                    "median_ratio": statistics.median(got["on"]) / statistics.median(got["off"]),
                    "steps_on": float(len(got["on"])), "steps_off": float(len(got["off"]))})
            for k in sides:
                summary = sides[k].ask("summary")
                assert isinstance(summary, dict)
                for name, value in summary["vllm"].items():
                    vllm[k][name] = vllm[k].get(name, 0.0) + value
                for name, n in summary["events"].items():
                    events[name] = events.get(name, 0) + n
        finally:
            for w in sides.values():
                w.close()
        per_pair.append(statistics.fmean(pair_us["on"]) / statistics.fmean(pair_us["off"]))
        for k in us:
            us[k] += pair_us[k]
    s = {k: stats(v) for k, v in us.items()}
    mean_ratio = s["on"]["mean"] / s["off"]["mean"]
    median_ratio = s["on"]["median"] / s["off"]["median"]
    # What the slowest 1 % of steps are, and how much of the total they carry.
    tails = {}
    for k in us:
        order = sorted(range(len(us[k])), key=us[k].__getitem__, reverse=True)
        top = order[: max(1, len(order) // 100)]
        kinds: dict[str, int] = {}
        for i in top:
            kind = tags[k][i] or "plain"
            kinds[kind] = kinds.get(kind, 0) + 1
        ckpt = [us[k][i] for i, t in enumerate(tags[k]) if t == "checkpoint"]
        tails[k] = {"slowest_1pct_share_of_time": sum(us[k][i] for i in top) / sum(us[k]),
                    "slowest_1pct_kinds": kinds, "checkpoint_steps": len(ckpt),
                    "checkpoint_us": stats(ckpt or [0.0]),
                    "checkpoint_share_of_time": sum(ckpt) / sum(us[k])}
    pair_mean, pair_half = t_interval(per_pair)
    print(f"every step: mean {s['on']['mean']:.1f} vs {s['off']['mean']:.1f} us "
          f"(ratio {mean_ratio:.4f}); median ratio {median_ratio:.4f}; steps "
          f"{len(us['on'])} vs {len(us['off'])}; per process pair {per_pair} "
          f"(mean {pair_mean:.4f} +- {pair_half:.4f}); gc inside steps "
          f"{ {k: round(gc_us[k] / sum(us[k]), 4) for k in us} } of the time, {gc_n} "
          f"collections; {events}; {vllm}")
    save("step_mix", {
        "with_us": s["on"], "without_us": s["off"], "mean_ratio": mean_ratio,
        "median_ratio": median_ratio, "per_round": per_round, "tails": tails,
        "rounds": ROUNDS * PAIRS, "pairs": PAIRS, "rounds_per_pair": ROUNDS,
        "per_pair_mean_ratio": per_pair,
        "gc_share_of_time": {k: gc_us[k] / sum(us[k]) for k in us}, "gc_collections": gc_n,
        "pair_mean_ratio": pair_mean,
        "pair_interval_half": pair_half, "target_mean_ratio": 1.02, "events": events,
        "vllm_on": vllm["on"], "vllm_off": vllm["off"]})


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(sys.argv[2])
    else:
        main()
