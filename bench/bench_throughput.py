"""Target 7: end-to-end throughput with kvguard (its defaults) vs without, as a user runs it.

128 requests (shared 64-token prefix) through a tiny Llama, two engines in one process
stepped in turn with kvguard on one of them, roles swapped each pair, in 3 processes; the
interval is Student's t over the processes. The control row checks the measure on itself.

A repetition: 96 output tokens per request, a 256-block pool, up to 64 requests per step
(prefix hits, queueing, preemption); throughput is output tokens per second. This VM's
speed swings by about 10 % within a second, so the ``interleaved-*`` modes measure both
sides at the same moments: the two engines step in turn, each one's time the sum of its
own ``add_request`` and ``step`` calls (garbage collections charged to it), both checked to
do the same work; a pair's sample, the geometric mean of its two ratios, cancels a speed
difference between the engines. A process carries a bias its pairs cannot show, hence
several. ``interleaved-kv-events-sync`` is target 10's (``bench_kv_events.py``). Pairs are
added until the 95 % interval is within +-0.5 % or the mode's budget is spent.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final, NamedTuple

from harness import (
    Pairs,
    Worker,
    across_processes,
    kv_tap,
    kvguard_hooks,
    reply,
    save,
    set_hooks,
    set_kv_tap,
)

REQUESTS, PREFIX_TOKENS, SUFFIX_TOKENS, OUTPUT_TOKENS = 128, 64, 32, 96
POOL_BLOCKS, MAX_SEQS = 256, 64
TOKENS = REQUESTS * OUTPUT_TOKENS
"""Output tokens of one repetition."""
BUDGET_SECONDS = float(os.environ.get("KVGUARD_BENCH_THROUGHPUT_SECONDS", "90"))
"""Per mode; each of a mode's ``PROCESSES`` gets half."""
PROCESSES = int(os.environ.get("KVGUARD_BENCH_THROUGHPUT_PROCESSES", "3"))
MIN_PAIRS, MAX_PAIRS = 6, 400
MIN_INTERLEAVED_PAIRS = 10
"""An ``interleaved-*`` process stops for having reached the target's width no sooner
than this (an interval narrow early by chance does not end it); its budget spent, past
``MIN_PAIRS``: a slow hour gives a wider interval, not a longer run."""
RESULT = os.environ.get("KVGUARD_BENCH_THROUGHPUT_RESULT", "throughput")
"""The result file's name (``bench/results/RESULT.json``)."""
TARGET_HALF_WIDTH = 0.005
CONTROL_BURN_US = float(os.environ.get("KVGUARD_BENCH_THROUGHPUT_BURN_US", "70"))
"""The control's known cost: a busy wait per step of the treated engine (about 2 %)."""
MODES = ("interleaved-sync", "interleaved-async", "interleaved-control-sync",
         "interleaved-kv-events-sync")
DEFAULT_MODES = ("interleaved-control-sync", "interleaved-sync", "interleaved-async")
"""Two OpenAI servers in turn were a mode until 2fa85bf; their interval never resolved
(``bench/results/what_if.md``, ``throughput_server``)."""
SAME_HASH_SEED = {"PYTHONHASHSEED": "0"}
"""vLLM iterates sets of request ids: two hash seeds schedule differently."""


def prompts(seed: int) -> list[list[int]]:
    """Token ids: the shared prefix, then a suffix of the request's own (ids in 4..503)."""
    prefix = [4 + (i * 37) % 500 for i in range(PREFIX_TOKENS)]
    return [prefix + [4 + (seed * 7919 + r * 131 + i * 31) % 500 for i in range(SUFFIX_TOKENS)]
            for r in range(REQUESTS)]


def spec_for(model_dir: Path, scheduling: str) -> Any:
    from kvguard.testing.engine import EngineSpec
    from kvguard.testing.scheduling import Scheduling

    return EngineSpec(model_dir=model_dir, num_gpu_blocks_override=POOL_BLOCKS,
                      max_model_len=512, max_num_seqs=MAX_SEQS, max_num_batched_tokens=4096,
                      kv_cache_memory_bytes=32 << 20, scheduling=Scheduling(scheduling))


def warm_llm(scheduling: str, model_dir: str, kv_events: str | None = None) -> Any:
    """An ``LLM`` in this process (engine core too), warmed up; with ``kv_events`` (an
    endpoint), publishing KV events there as a router's engine does."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.config import KVEventsConfig

    from kvguard.testing.scheduling import Scheduling, requesting_async
    from kvguard.testing.warmup import warm_up_engine

    kwargs = spec_for(Path(model_dir), scheduling).engine_kwargs()
    kwargs.pop("async_scheduling", None)
    if kv_events:
        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=kv_events, topic="")
    if scheduling == Scheduling.ASYNC:
        with requesting_async():
            llm = LLM(**kwargs, async_scheduling=True)
    else:
        llm = LLM(**kwargs)
    warm_up_engine(llm.llm_engine)
    return llm


def _interleaved_repetition(llms: list[Any], hooks: list[Any], taps: list[Any], seed: int,
                            on: int, *, hooked: bool, burn_seconds: float,
                            tap_only: bool = False) -> dict[str, Any]:
    """One repetition on both engines, stepped in turn. Engine ``on`` is treated: kvguard's
    hooks in (``hooked``; else out on both), a busy wait of ``burn_seconds`` after each of
    its steps; with ``tap_only``, hooks in on both and only its KV-event tap in."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    for i, llm in enumerate(llms):
        set_hooks(hooks[i], hooked and (tap_only or i == on))
        if taps[i] is not None:
            set_kv_tap(taps[i], not tap_only or i == on)
        llm.reset_prefix_cache()  # neither side hits the blocks the other cached
    engines = [llm.llm_engine for llm in llms]
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0.0)
    pc = time.perf_counter
    seconds, gc_seconds = [0.0, 0.0], [0.0, 0.0]
    tokens, steps = [0, 0], [0, 0]
    current = [0]
    gc_started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = pc()
        else:
            gc_seconds[current[0]] += pc() - gc_started[0]

    gc.callbacks.append(on_gc)
    try:
        batch = [TokensPrompt(prompt_token_ids=p) for p in prompts(seed)]
        for i, engine in enumerate(engines):
            current[0] = i
            t = pc()
            for r, p in enumerate(batch):
                engine.add_request(f"rep{seed}-{r}", p, params)
            seconds[i] += pc() - t
        live = [True, True]
        k = 0
        while any(live):
            for i in ((0, 1) if k % 2 == 0 else (1, 0)):
                if not live[i]:
                    continue
                current[0] = i
                t = pc()
                outs = engines[i].step()
                live[i] = engines[i].has_unfinished_requests()
                if burn_seconds and i == on:
                    until = pc() + burn_seconds
                    while pc() < until:
                        pass
                seconds[i] += pc() - t
                steps[i] += 1
                tokens[i] += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
            k += 1
    finally:
        gc.callbacks.remove(on_gc)
    return {"seconds": seconds, "gc_seconds": gc_seconds, "tokens": tokens, "steps": steps}


def interleave_worker(scheduling: str, model_dir: str, kv_events: bool) -> None:
    """Two ``LLM``s with kvguard (``kv_events``: each publishing on an ``ipc://`` endpoint
    of its own); ``run SEED ON HOOKED BURN_US TAP_ONLY``: one repetition on both;
    ``clocked``: the KV-event tap's own time and its engine's over the timed repetitions."""
    from kvguard.testing.engine import scheduler_of

    sock_dir = tempfile.mkdtemp(prefix="kvguard-bench-kvev-")
    llms = [warm_llm(scheduling, model_dir, f"ipc://{sock_dir}/pub{i}" if kv_events else None)
            for i in range(2)]
    hooks = [kvguard_hooks(scheduler_of(llm.llm_engine)) for llm in llms]
    clock = [0]
    taps = [kv_tap(scheduler_of(llm.llm_engine), clock) for llm in llms]
    if not all(hooks) or (kv_events and not all(taps)):
        raise RuntimeError("kvguard's hooks (and KV-event taps) are not on both engines")
    reply("ready")
    treated = 0.0
    for line in sys.stdin:
        if line.strip() == "clocked":
            reply({"tap_seconds": clock[0] / 1e9, "treated_seconds": treated})
            continue
        _, seed, on, hooked, burn_us, tap_only = line.split()
        if seed == "0":
            clock[0] = 0  # the untimed warm-up repetitions
        out = _interleaved_repetition(llms, hooks, taps, int(seed), int(on),
                                      hooked=hooked == "1", tap_only=tap_only == "1",
                                      burn_seconds=float(burn_us) * 1e-6)
        treated += out["seconds"][int(on)] if tap_only == "1" and seed != "0" else 0.0
        reply(out)
    os._exit(0)


class Treatment(NamedTuple):
    """What the treated engine of an ``interleaved-*`` pair gets."""

    name: str
    hooked: bool
    """kvguard's hooks in (else out on both engines)."""
    burn_us: float
    """A busy wait after each of its steps (us)."""
    tap_only: bool = False
    """kvguard's hooks in on both engines, its KV-event tap on the treated one only."""


KVGUARD: Final = Treatment("kvguard", True, 0.0)
KV_TAP: Final = Treatment("kv-events tap", True, 0.0, tap_only=True)
CONTROLS: Final = (Treatment("null", False, 0.0), Treatment("burn", False, CONTROL_BURN_US))


def _interleaved_process(mode: str, scheduling: str, treatments: tuple[Treatment, ...],
                         model_dir: Path, log: Path, budget_seconds: float) -> dict[str, Pairs]:
    """One worker process: pairs of each treatment in turn until every treatment's interval
    is within the target's width (past ``MIN_INTERLEAVED_PAIRS``), or ``budget_seconds`` are
    spent (past ``MIN_PAIRS``)."""
    kv_events = any(t.tap_only for t in treatments)
    worker = Worker(__file__, ["interleave", scheduling, str(model_dir), str(int(kv_events))],
                    {**SAME_HASH_SEED, "KVGUARD_ENABLED": "1",
                     "KVGUARD_RUN_DIR": str(log.parent / f"run-{log.stem}")}, log)
    pairs = {t.name: Pairs(TOKENS, MIN_INTERLEAVED_PAIRS, TARGET_HALF_WIDTH) for t in treatments}

    def ask(seed: int, on: int, t: Treatment) -> Any:
        return worker.ask(f"run {seed} {on} {int(t.hooked)} {t.burn_us} {int(t.tap_only)}")

    try:
        for t in treatments:  # untimed: caches warm with each treatment on each engine
            for on in (0, 1):
                ask(0, on, t)
        started = time.monotonic()
        n = 0
        while n < MAX_PAIRS * len(treatments):
            t = treatments[n % len(treatments)]
            n += 1
            got = {on: ask(n * 2 + on, on, t)
                   for on in ((0, 1) if (n // len(treatments)) % 2 else (1, 0))}
            for out in got.values():
                if out["tokens"] != [TOKENS, TOKENS] or out["steps"][0] != out["steps"][1]:
                    raise RuntimeError(f"{mode}: the two engines did different work (tokens "
                                       f"{out['tokens']}, steps {out['steps']}; expected "
                                       f"{TOKENS} tokens each, equal steps)")
            pairs[t.name].add(got)
            fewest = min(len(p.ratios) for p in pairs.values())
            if n % len(treatments) == 0 and (
                    all(p.done() for p in pairs.values())
                    or (fewest >= MIN_PAIRS and time.monotonic() - started > budget_seconds)):
                break
        if kv_events:
            c = worker.ask("clocked")
            pairs[KV_TAP.name].clocked = c["tap_seconds"] / c["treated_seconds"]
    finally:
        worker.close()
    return pairs


def measure_interleaved(mode: str, model_dir: Path, log: Path) -> dict[str, Any]:
    """An ``interleaved-*`` mode: the control's two treatments in one process; kvguard (or
    its KV-event tap) in ``PROCESSES`` processes one after another, each with half the
    mode's budget, judged over them (:func:`harness.across_processes`)."""
    scheduling = mode.rsplit("-", 1)[1]
    if mode.startswith("interleaved-control-"):
        pairs = _interleaved_process(mode, scheduling, CONTROLS, model_dir, log,
                                     BUDGET_SECONDS)
        null, burn = pairs["null"].row(mode), pairs["burn"].row(mode)
        burn_s = CONTROL_BURN_US * 1e-6 * burn["steps_per_repetition"]
        for what, r in (("nothing", null), (f"a {CONTROL_BURN_US:.0f} us wait", burn)):
            _print(f"{mode}: {what}", r)
        # the ratio the wait alone gives: its share of the treated engine's time
        return {"mode": mode, "burn_us_per_step": CONTROL_BURN_US,
                "burn_expected_ratio": statistics.fmean((s - burn_s) / s
                                                        for s in burn["seconds_on"]),
                "null": null, "burn": burn}
    treated = KV_TAP if mode.startswith("interleaved-kv-events-") else KVGUARD
    per_process = []
    for k in range(PROCESSES):
        one = _interleaved_process(mode, scheduling, (treated,), model_dir,
                                   log.with_name(f"{log.stem}-{k}.log"), BUDGET_SECONDS / 2)
        per_process.append(one[treated.name].row(mode))
        if treated is KV_TAP:  # its own engine-thread time, directly (target 10)
            per_process[-1]["tap_clocked_share"] = one[treated.name].clocked
        _print(mode, per_process[-1])
    if len(per_process) == 1:  # KVGUARD_BENCH_THROUGHPUT_PROCESSES=1: its pairs' interval
        return per_process[0]
    row = across_processes(mode, per_process, TOKENS)
    if treated is KV_TAP:
        row["tap_clocked_shares"] = [r["tap_clocked_share"] for r in per_process]
    print(f"{mode}: over {PROCESSES} processes {row['mean_ratio']:.4f} +- "
          f"{row['ci95_half_width']:.4f} (process means "
          + ", ".join(f"{m:.4f}" for m in row["process_means"]) + ")", flush=True)
    return row


def _print(what: str, r: dict[str, Any]) -> None:
    extra = (f"; engine 0 / engine 1 time {r['engine_time_ratio']:.4f}; garbage collection "
             f"{100 * r['gc_share_on']:.2f} % treated, {100 * r['gc_share_off']:.2f} % not"
             if "gc_share_on" in r else "")
    print(f"{what}: mean throughput ratio {r['mean_ratio']:.4f} +- {r['ci95_half_width']:.4f} "
          f"(95 %, {r['pairs']} pairs); {r['tokens_per_second_on']:.0f} vs "
          f"{r['tokens_per_second_off']:.0f} tokens/s{extra}", flush=True)


def main() -> None:
    from kvguard.testing.tiny_model import make_tiny_model

    os.environ.setdefault("VLLM_PLUGINS", "kvguard")
    tmp = Path(tempfile.mkdtemp(prefix="kvguard-bench-tput-"))
    model_dir = make_tiny_model(tmp)
    raw = os.environ.get("KVGUARD_BENCH_THROUGHPUT_MODES", ",".join(DEFAULT_MODES))
    wanted = [m for m in raw.split(",") if m]
    if not wanted or any(m not in MODES for m in wanted):
        raise SystemExit(f"KVGUARD_BENCH_THROUGHPUT_MODES={raw!r}: name one or more of "
                         f"{', '.join(MODES)}, comma-separated")
    rows = [measure_interleaved(mode, model_dir, tmp / f"{mode}.log") for mode in wanted]
    save(RESULT, {"rows": rows, "target_mean_ratio": 0.99,
                  "target_ci95_half_width": TARGET_HALF_WIDTH,
                  "workload": {"requests": REQUESTS, "prefix_tokens": PREFIX_TOKENS,
                               "suffix_tokens": SUFFIX_TOKENS,
                               "output_tokens": OUTPUT_TOKENS,
                               "pool_blocks": POOL_BLOCKS, "max_num_seqs": MAX_SEQS},
                  "budget_seconds_per_mode": BUDGET_SECONDS})


if __name__ == "__main__":
    if len(sys.argv) > 5 and sys.argv[1:3] == ["worker", "interleave"]:
        interleave_worker(sys.argv[3], sys.argv[4], sys.argv[5] == "1")
    else:
        main()
