"""Target 7: end-to-end throughput with kvguard (its defaults) vs without, as a user runs it.

The workload (per repetition): 128 requests of a 64-token prefix shared by all plus a
32-token suffix of their own, 96 output tokens each (``ignore_eos``), on the tiny Llama
with a 256-block pool of 32 tokens and up to 64 requests scheduled per step, so prefix
hits, queueing and preemption all happen. Throughput is output tokens per second of
wall time, from the first request added to the last one finished.

This VM's speed swings by about 10 % within a second (one repetition, about 1 s, run 20
times in a row on one engine: a coefficient of variation of 10-12 %, in the process's
CPU time as much as in the wall, with one OMP thread or two), so two sides measured one
after the other differ by more than kvguard costs. The default modes therefore measure
both sides at the same moments:

- ``interleaved-sync`` / ``interleaved-async``: two ``LLM`` engines in one worker
  process, both built with kvguard, vLLM's synchronous or async scheduling (the CPU
  build's override undone by the test tooling). A repetition adds the same 128 requests
  to both and steps them in turn (``LLMEngine.step``, what ``LLM.generate`` loops over),
  the order alternating per step, with kvguard's hooks in on one engine and taken out on
  the other (the engine's own methods back); each engine's time is the sum of its own
  ``add_request`` and ``step`` calls. Both engines must take the same steps and produce
  every token (checked). A pair is two repetitions with the roles swapped (kvguard on
  engine 0, then on engine 1, the order alternating per pair), and its sample is the
  geometric mean of the two throughput ratios (on / off), in which a speed difference
  between the two engines themselves (about 1 % here, engine 0 the slower) cancels.
  Garbage collections are timed and charged to the engine whose call they ran in
  (reported: each side's share of its time). What this does not see: the cost of
  kvguard's code on the CPU caches of the engine's own code in the next step, since the
  other engine's step runs in between (in one engine, the model's forward does); the
  publisher thread's serialization when it overlaps the other engine's step (0.09 % of
  engine time at most, target 6). A worker process carries a bias of its own, which its
  pairs cannot show (on 2026-12-04, four processes of the sync mode measured 0.9957,
  0.9905, 0.9896 and 0.9892, each claiming about +-0.45 %): each mode runs in
  ``KVGUARD_BENCH_THROUGHPUT_PROCESSES`` (3) worker processes one after another, each
  with half the mode's budget, and its mean and 95 % interval are over their means.
- ``interleaved-control-sync`` / ``-async``: the method checked on itself, kvguard's
  hooks out on both engines, two treatments in turn: nothing (the interval must hold
  1.00x) and a busy wait of ``KVGUARD_BENCH_THROUGHPUT_BURN_US`` (default 70 us) after
  each step of the treated engine, timed with it (the interval must hold the ratio that
  the wait's share of the time gives).
- ``interleaved-kv-events-sync`` (``bench_kv_events.py``, target 10): both engines publish
  KV events with kvguard's hooks in on both; the treatment is kvguard's KV-event tap alone.
- ``server``: two real OpenAI servers on 127.0.0.1, one with kvguard and one with
  ``KVGUARD_ENABLED=0``, driven by the official ``openai`` client (``AsyncOpenAI``, 128
  concurrent completions), one repetition each in turn.

The server mode alternates whole repetitions, the order alternating per pair (ABBA); the
per-pair throughput ratio (on / off) is its sample. Pairs are added until the 95 %
interval of the mean ratio is within +-0.5 % (``interleaved-*``: each process, past 10
pairs) or the mode's time budget (``KVGUARD_BENCH_THROUGHPUT_SECONDS``, default 90 s per
mode) is spent; the interval reached is reported either way. Target: mean >= 0.99.

``./scripts/bench`` runs ``interleaved-control-sync``, ``interleaved-sync``,
``interleaved-async`` and ``server`` (``DEFAULT_MODES``: the server is the path users
run); ``KVGUARD_BENCH_THROUGHPUT_MODES`` names others. The server's two sides are two
processes measured one after the other, so its interval stays about as wide as this VM's
noise (+-30 % at 80 s); kvguard runs in its engine core, which the interleaved modes
measure. The earlier designs (``inproc-*``: two processes; ``same-engine-*``: one
engine's hooks in and out per repetition; their long run, ``throughput_long``) are
results now (``bench/results/what_if.md``, with the commit that measured them).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
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
    t_interval,
)

REQUESTS = 128
PREFIX_TOKENS = 64
SUFFIX_TOKENS = 32
OUTPUT_TOKENS = 96
POOL_BLOCKS = 256
MAX_SEQS = 64
BUDGET_SECONDS = float(os.environ.get("KVGUARD_BENCH_THROUGHPUT_SECONDS", "90"))
MIN_PAIRS = 6
PROCESSES = int(os.environ.get("KVGUARD_BENCH_THROUGHPUT_PROCESSES", "3"))
"""Worker processes per ``interleaved-*`` mode measuring kvguard: its verdict is judged
over them. On 2026-12-04 three processes of one mode measured 0.9905, 0.9896 and 0.9892
where a fourth that hour measured 0.9957, each claiming +-0.45 % from its pairs."""
MIN_INTERLEAVED_PAIRS = 10
"""An ``interleaved-*`` process reaches the target's width in 10-14 pairs here: it stops
for having reached it no sooner than this, so that an interval that happens to be narrow
early (a low spread by chance) does not end the run. Its budget spent, it stops past
``MIN_PAIRS`` (a slow hour gives fewer pairs and a wider interval, not a longer run:
target 5)."""
MAX_PAIRS = 400
RESULT = os.environ.get("KVGUARD_BENCH_THROUGHPUT_RESULT", "throughput")
"""The result file's name (``bench/results/RESULT.json``): ``throughput`` for the run of
``./scripts/bench``; another name for a longer or repeated run of some modes."""
TARGET_HALF_WIDTH = 0.005
CONTROL_BURN_US = float(os.environ.get("KVGUARD_BENCH_THROUGHPUT_BURN_US", "70"))
"""The ``interleaved-control-*`` modes' known cost: a busy wait of this many microseconds
after every step of the treated engine (about 2 % of a step of this workload here)."""
MODES = ("interleaved-sync", "interleaved-async", "interleaved-control-sync",
         "interleaved-control-async", "interleaved-kv-events-sync", "server")
DEFAULT_MODES = ("interleaved-control-sync", "interleaved-sync", "interleaved-async", "server")
SAME_HASH_SEED = {"PYTHONHASHSEED": "0"}
"""Both sides: vLLM iterates sets of request ids, so two processes with different hash
seeds schedule (preempt, admit) differently and do different work."""


def prompts(seed: int) -> list[list[int]]:
    """Token ids: the shared prefix, then a suffix of the request's own (ids in 4..503)."""
    prefix = [4 + (i * 37) % 500 for i in range(PREFIX_TOKENS)]
    return [prefix + [4 + (seed * 7919 + r * 131 + i * 31) % 500 for i in range(SUFFIX_TOKENS)]
            for r in range(REQUESTS)]


def spec_for(model_dir: Path, scheduling: str) -> Any:
    from kvguard.testing.engine import EngineSpec

    return EngineSpec(model_dir=model_dir, num_gpu_blocks_override=POOL_BLOCKS,
                      max_model_len=512, max_num_seqs=MAX_SEQS, max_num_batched_tokens=4096,
                      kv_cache_memory_bytes=32 << 20, scheduling=scheduling)


# ------------------------------------------------------------------ in-process workers
def _warm_llm(scheduling: str, model_dir: str, kv_events: str | None = None) -> Any:
    """An ``LLM`` in this process (engine core in process too), warmed up; with
    ``kv_events`` (an endpoint), publishing KV events there as a router's engine does."""
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
    """One repetition on both engines at once, stepped in turn. Engine ``on`` gets the
    treatment: kvguard's hooks in (``hooked``; the other engine's are out, and with
    ``hooked`` false both are out) and a busy wait of ``burn_seconds`` after each of its
    steps, timed with it (the positive control's known cost). Each engine's wall time is
    the sum of its own ``add_request`` and ``step`` calls (what ``LLM.generate`` spends on
    it). The step order alternates per step, so neither engine always runs right after the
    other. Garbage collections are timed and charged to the engine whose call they ran in.
    With ``tap_only`` kvguard's hooks are in on both engines and the treatment is its
    KV-event tap (``taps``), in on engine ``on`` only."""
    import gc

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
    """Two ``LLM``s with kvguard in this process (``kv_events``: each publishing KV events
    on an ``ipc://`` endpoint of its own); each ``run SEED ON HOOKED BURN_US TAP_ONLY``
    runs one repetition on both, stepped in turn, the treatment on engine ON (0 or 1)."""
    from kvguard.testing.engine import scheduler_of

    sock_dir = tempfile.mkdtemp(prefix="kvguard-bench-kvev-")
    llms = [_warm_llm(scheduling, model_dir, f"ipc://{sock_dir}/pub{i}" if kv_events else None)
            for i in range(2)]
    hooks = [kvguard_hooks(scheduler_of(llm.llm_engine)) for llm in llms]
    clock = [0.0]
    taps = [kv_tap(scheduler_of(llm.llm_engine), clock) for llm in llms]
    if not all(hooks) or (kv_events and not all(taps)):
        raise RuntimeError("kvguard's hooks (and KV-event taps) are not on both engines")
    reply("ready")
    treated = 0.0  # the tap-treated engine's time over the timed repetitions
    for line in sys.stdin:
        if line.strip() == "clocked":  # the tap's own share of its engine's time
            reply({"tap_seconds": clock[0], "treated_seconds": treated})
            continue
        _, seed, on, hooked, burn_us, tap_only = line.split()
        if seed == "0":
            clock[0] = 0.0  # the untimed warm-up repetitions
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
    """A busy wait after each of its steps, in microseconds."""
    tap_only: bool = False
    """kvguard's hooks in on both engines, its KV-event tap on the treated one only."""


KVGUARD: Final = Treatment("kvguard", True, 0.0)
KV_TAP: Final = Treatment("kv-events tap", True, 0.0, tap_only=True)
"""``interleaved-kv-events-sync``: both engines publish KV events with kvguard in; the
treated one also runs kvguard's side of the KV-event mirror check (issue 39's cost)."""
CONTROLS: Final = (Treatment("null", False, 0.0), Treatment("burn", False, CONTROL_BURN_US))
"""The ``interleaved-control-*`` modes' treatments, in turn: nothing (both engines the
same: the ratio must be 1), and a busy wait of known length (the ratio must be the one
its share of the treated engine's time gives)."""


def _interleaved_process(mode: str, scheduling: str, treatments: tuple[Treatment, ...],
                         model_dir: Path, log: Path, budget_seconds: float) -> dict[str, Pairs]:
    """One worker process of an ``interleaved-*`` mode: pairs of each treatment in turn
    until every treatment's interval is within the target's width (past
    ``MIN_INTERLEAVED_PAIRS``), or ``budget_seconds`` are spent (past ``MIN_PAIRS``)."""
    kv_events = any(t.tap_only for t in treatments)
    worker = Worker(__file__, ["interleave", scheduling, str(model_dir), str(int(kv_events))],
                    {**SAME_HASH_SEED, "KVGUARD_ENABLED": "1",
                     "KVGUARD_RUN_DIR": str(log.parent / f"run-{log.stem}")}, log)
    expected = REQUESTS * OUTPUT_TOKENS
    pairs = {t.name: Pairs(REQUESTS * OUTPUT_TOKENS, MIN_INTERLEAVED_PAIRS, TARGET_HALF_WIDTH)
             for t in treatments}
    try:
        for t in treatments:  # untimed: caches warm with each treatment on each engine
            for on in (0, 1):
                worker.ask(f"run 0 {on} {int(t.hooked)} {t.burn_us} {int(t.tap_only)}")
        started = time.monotonic()
        n = 0
        while n < MAX_PAIRS * len(treatments):
            t = treatments[n % len(treatments)]
            n += 1
            got: dict[int, dict[str, Any]] = {}
            for on in ((0, 1) if (n // len(treatments)) % 2 else (1, 0)):
                out = worker.ask(f"run {n * 2 + on} {on} {int(t.hooked)} {t.burn_us} "
                                 f"{int(t.tap_only)}")
                assert isinstance(out, dict)
                if out["tokens"] != [expected, expected] or out["steps"][0] != out["steps"][1]:
                    raise RuntimeError(f"{mode}: the two engines did different work "
                                       f"(tokens {out['tokens']}, steps {out['steps']}; "
                                       f"expected {expected} tokens each, equal steps)")
                got[on] = out
            pairs[t.name].add(got)
            fewest = min(len(p.ratios) for p in pairs.values())
            if n % len(treatments) == 0 and (
                    all(p.done() for p in pairs.values())  # past MIN_INTERLEAVED_PAIRS
                    or (fewest >= MIN_PAIRS and time.monotonic() - started > budget_seconds)):
                break
        if kv_events:
            clocked = worker.ask("clocked")
            assert isinstance(clocked, dict)
            pairs[KV_TAP.name].clocked = clocked["tap_seconds"] / clocked["treated_seconds"]
    finally:
        worker.close()
    return pairs


def measure_interleaved(mode: str, model_dir: Path, log: Path) -> dict[str, object]:
    """An ``interleaved-*`` mode: two engines in one worker, stepped in turn, so both sides
    of a repetition see the machine at the same moments (this VM's speed swings by about
    10 % within seconds, which no order of whole repetitions cancels). Each pair is two
    repetitions with the roles swapped (the treatment on engine 0, then on engine 1; the
    order alternating per pair). kvguard is measured in ``PROCESSES`` worker processes
    one after another, each with half the mode's budget (10 pairs take 45-55 s here), and
    judged over them
    (:func:`across_processes`). ``interleaved-control-*`` runs the method's own checks in
    one process, in turn instead of kvguard (its hooks out on both engines): an empty
    treatment and a busy wait of known length (neither depends on where a process's code
    landed)."""
    control = mode.startswith("interleaved-control-")
    scheduling = mode.rsplit("-", 1)[1]
    treated = KV_TAP if mode.startswith("interleaved-kv-events-") else KVGUARD
    if control:
        pairs = _interleaved_process(mode, scheduling, CONTROLS, model_dir, log,
                                     BUDGET_SECONDS)
        null, burn = pairs["null"].row(mode), pairs["burn"].row(mode)
        burn_s = CONTROL_BURN_US * 1e-6 * burn["steps_per_repetition"]
        row: dict[str, Any] = {
            "mode": mode, "burn_us_per_step": CONTROL_BURN_US,
            # the ratio the burn alone gives: its share of the treated engine's time
            "burn_expected_ratio": statistics.fmean((s - burn_s) / s
                                                    for s in burn["seconds_on"]),
            "null": null, "burn": burn}
        _print_interleaved(row)
        return row
    per_process = []
    for k in range(PROCESSES):
        one = _interleaved_process(mode, scheduling, (treated,), model_dir,
                                   log.with_name(f"{log.stem}-{k}.log"),
                                   BUDGET_SECONDS / 2)
        per_process.append(one[treated.name].row(mode))
        if treated is KV_TAP:  # its own engine-thread time, directly (target 10)
            per_process[-1]["tap_clocked_share"] = one[treated.name].clocked
        _print_interleaved(per_process[-1])
    if len(per_process) == 1:  # KVGUARD_BENCH_THROUGHPUT_PROCESSES=1: its pairs' interval
        return per_process[0]
    row = across_processes(mode, per_process, REQUESTS * OUTPUT_TOKENS)
    if treated is KV_TAP:
        row["tap_clocked_shares"] = [r["tap_clocked_share"] for r in per_process]
    print(f"{mode}: over {PROCESSES} processes {row['mean_ratio']:.4f} +- "
          f"{row['ci95_half_width']:.4f} (process means "
          + ", ".join(f"{m:.4f}" for m in row["process_means"]) + ")", flush=True)
    return row


def _print_interleaved(row: dict[str, Any]) -> None:
    def one(r: dict[str, Any]) -> str:
        return (f"mean throughput ratio {r['mean_ratio']:.4f} +- {r['ci95_half_width']:.4f} "
                f"(95 %, {r['pairs']} pairs); {r['tokens_per_second_on']:.0f} vs "
                f"{r['tokens_per_second_off']:.0f} tokens/s; engine 0 / engine 1 time "
                f"{r['engine_time_ratio']:.4f}; garbage collection "
                f"{100 * r['gc_share_on']:.2f} % treated, {100 * r['gc_share_off']:.2f} % not")
    if "null" in row:
        print(f"{row['mode']}: nothing: {one(row['null'])}", flush=True)
        print(f"{row['mode']}: a {row['burn_us_per_step']:.0f} us busy wait per step "
              f"(expected {row['burn_expected_ratio']:.4f}): {one(row['burn'])}", flush=True)
    else:
        print(f"{row['mode']}: {one(row)}", flush=True)


# ------------------------------------------------------------------ server side
class ServerSide:
    def __init__(self, model_dir: Path, enabled: bool, log: Path) -> None:
        import httpx2  # the HTTP client of openai 3.x
        from openai import AsyncOpenAI, DefaultAsyncHttpxClient

        from kvguard.testing.engine import ServerProcess

        env = {**SAME_HASH_SEED, "KVGUARD_ENABLED": "1" if enabled else "0",
               "KVGUARD_RUN_DIR": str(log.parent / f"run-server-{int(enabled)}")}
        self.spec = spec_for(model_dir, "sync")
        self.server = ServerProcess(self.spec, log_path=log, env=env)
        self.server.start()
        # Idle connections are dropped after 1 s, before the server's own 5 s keep-alive
        # timeout: with both at 5 s, a request sent on a connection the server was closing
        # just then failed (ReadError) after the other side's repetition left it idle.
        http = DefaultAsyncHttpxClient(limits=httpx2.Limits(
            max_connections=1000, max_keepalive_connections=200, keepalive_expiry=1.0))
        self.client = AsyncOpenAI(base_url=self.server.base_url + "/v1", api_key="unused",
                                  max_retries=0, timeout=600, http_client=http)
        self.loop = asyncio.new_event_loop()

    async def _one(self, p: list[int]) -> int:
        out = await self.client.completions.create(
            model=self.spec.served_model_name, prompt=p, max_tokens=OUTPUT_TOKENS,
            temperature=0.0, extra_body={"ignore_eos": True})
        return out.usage.completion_tokens if out.usage else 0

    async def _batch(self, seed: int) -> int:
        return sum(await asyncio.gather(*(self._one(p) for p in prompts(seed))))

    def run(self, seed: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        tokens = self.loop.run_until_complete(self._batch(seed))
        return time.perf_counter() - t0, tokens

    def close(self) -> None:
        self.loop.run_until_complete(self.client.close())
        self.loop.close()
        self.server.stop()


def measure(mode: str, make: Callable[[bool], Any]) -> dict[str, object]:
    sides = {True: make(True), False: make(False)}
    try:
        for enabled in (True, False):  # one untimed repetition each: caches and JIT warm
            sides[enabled].run(0)
        ratios: list[float] = []
        seconds: dict[bool, list[float]] = {True: [], False: []}
        started = time.monotonic()
        pair = 0
        while pair < MAX_PAIRS:
            pair += 1
            order = (True, False) if pair % 2 else (False, True)
            got = {}
            for enabled in order:
                dt, tokens = sides[enabled].run(pair)
                if tokens != REQUESTS * OUTPUT_TOKENS:
                    raise RuntimeError(f"{mode}: {tokens} tokens generated, expected "
                                       f"{REQUESTS * OUTPUT_TOKENS}")
                got[enabled] = dt
                seconds[enabled].append(dt)
            ratios.append(got[False] / got[True])  # throughput on / off
            mean, half = t_interval(ratios)
            if pair >= MIN_PAIRS and (half <= TARGET_HALF_WIDTH
                                      or time.monotonic() - started > BUDGET_SECONDS):
                break
    finally:
        for side in sides.values():
            side.close()
    mean, half = t_interval(ratios)
    tps = {k: REQUESTS * OUTPUT_TOKENS / statistics.median(v) for k, v in seconds.items()}
    row = {"mode": mode, "pairs": len(ratios), "mean_ratio": mean, "ci95_half_width": half,
           "median_ratio": statistics.median(ratios), "ratios": ratios,
           "tokens_per_second_on": tps[True], "tokens_per_second_off": tps[False],
           "seconds_on": seconds[True], "seconds_off": seconds[False]}
    print(f"{mode}: mean throughput ratio {mean:.4f} +- {half:.4f} (95 %, {len(ratios)} pairs);"
          f" {tps[True]:.0f} vs {tps[False]:.0f} tokens/s", flush=True)
    return row


def main() -> None:
    from kvguard.testing.tiny_model import make_tiny_model

    os.environ.setdefault("VLLM_PLUGINS", "kvguard")
    tmp = Path(tempfile.mkdtemp(prefix="kvguard-bench-tput-"))
    model_dir = make_tiny_model(tmp)
    raw = os.environ.get("KVGUARD_BENCH_THROUGHPUT_MODES", ",".join(DEFAULT_MODES))
    wanted = [m for m in raw.split(",") if m]
    unknown = [m for m in wanted if m not in MODES]
    if unknown or not wanted:
        raise SystemExit(f"KVGUARD_BENCH_THROUGHPUT_MODES={raw!r}: name one or more of "
                         f"{', '.join(MODES)}, comma-separated")
    rows = []
    for mode in wanted:
        if mode == "server":
            rows.append(measure(mode, lambda on: ServerSide(model_dir, on,
                                                            tmp / f"server-{int(on)}.log")))
        else:
            rows.append(measure_interleaved(mode, model_dir, tmp / f"{mode}.log"))
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
