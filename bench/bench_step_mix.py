"""Target 8: scheduler time per step with kvguard vs without, every step counted, a real mix.

Target 1 (``bench_hook_overhead.py``) times the steady state: only steps with all 64
requests running. Here every step counts (admission, chunked prefills, finishing, the
drained checkpoint each round ends with), and a step's time includes the
``Scheduler.add_request`` calls made since the step before (kvguard's admission hook runs
there, and so does a drained audit the checkpoint pace owes), on a workload with the paths
where kvguard does more work:

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

The comparison carries no process or engine bias: one engine with kvguard,
its hooks taken out for every other round (the engine's own methods back) and put in again
(ABBA, up to ``TOGGLE_ROUNDS`` per mode in each of ``TOGGLE_PROCESSES`` processes, as many
as ``TOGGLE_SECONDS`` of wall time per process allows past ``TOGGLE_MIN_ROUNDS``, the prefix
cache reset before every round so that both modes start from the same pool). Both modes
share the process, the engine and its memory; what the "without" side still carries is
kvguard's idle objects and its publisher thread asleep. Reported: the mean of the per-round
ratios with its 95 % interval, and whether any round pair did different work (steps or
vLLM's counters). Each round also runs a third way, with a pass-through wrapper on every
method kvguard hooks (the same calls intercepted, no work; the three ways in turn, ABC then
CBA): the ratio splits into the interception's share (pass-through / without) and kvguard's
work's (with / pass-through). Then, in the first process, ``SELF_TIME_ROUNDS`` rounds with
a clock at every boundary between kvguard and the engine: kvguard's own time per hook and
per session method, per step: where the ratio comes from.

The what-if studies once run from here (``seam``, ``groups``, ``batched``) and the earlier
design of two engines in a process pair each (``step_mix_pairs``: a process carries a bias
of its own that its rounds cannot cancel) are results now (``bench/results/what_if.md``,
with the commit that measured them).
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

from harness import RoundBudget, Worker, kvguard_hooks, reply, save, set_hooks, stats, t_interval

REQUESTS = 64
GROUPS = 4
OUTPUT_TOKENS = 96
ABORT_AT_STEP = 24
ABORTED = 8
POOL_BLOCKS = 160


COUNTERS = ("vllm:num_preemptions", "vllm:prefix_cache_hits",
            "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
"""vLLM's own counts of the work in a round (both sides must show the same)."""
TOGGLE_PROCESSES = int(os.environ.get("KVGUARD_BENCH_MIX_TOGGLE_PROCESSES", "2"))
"""Processes for the same-engine measurement (hooks in and out per round)."""
TOGGLE_ROUNDS = int(os.environ.get("KVGUARD_BENCH_MIX_TOGGLE_ROUNDS", "16"))
"""Rounds per process and mode, alternating the order (ABBA)."""
TOGGLE_MIN_ROUNDS = 8
TOGGLE_SECONDS = 100.0
"""Wall-time budget of one process's rounds (``KVGUARD_BENCH_MIX_TOGGLE_SECONDS``), past
``TOGGLE_MIN_ROUNDS``: 16 rounds of the three modes take about 60 s at this VM's fast
hours and 150 s at its slow ones."""
SELF_TIME_ROUNDS = 2
"""Rounds timed at every hook boundary (kvguard's own time per hook), in one process."""


PACED_PROCESSES = 1
PACED_SECONDS = 40.0
"""The paced measurement (opt-in, beyond the target): one process, 8-16 rounds within
``KVGUARD_BENCH_MIX_PACED_SECONDS``."""
PACED_INTERVAL = "10"
"""``KVGUARD_CHECKPOINT_MIN_INTERVAL_SECONDS`` of the paced measurement: a round takes
about 1-2 s here, so a pace of 1 s would let every drain through; at 10 s, after the
burst of 4, most drains are let go and audited later (at an admission the pace allows)."""


def _clocked(fn: Any, done: Any) -> Any:
    """``fn`` timed: ``done(ns)`` with its time."""
    def run(*a: Any, **k: Any) -> Any:
        t = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            done(time.perf_counter_ns() - t)
    return run


MODES: Final = ("on", "bare", "off")
"""How a toggle round runs: kvguard's hooks (``on``), the engine's own methods (``off``),
or a :func:`passthrough` wrapper on each method kvguard hooks (``bare``); a round with all
three runs them in this order, then reversed."""
def passthrough(orig: Any) -> Any:
    """A wrapper of a kvguard hook's shape (a Python frame around the engine's call; a
    hook's ``try`` costs nothing on CPython 3.11 unless it raises) that does no work: with
    one on every method kvguard hooks, a step pays the interception alone, and kvguard's
    hooks pay it plus their work."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return orig(*args, **kwargs)
    return wrapper


def timed(sched: Any, samples: list[int], tags: list[str], guard: Any) -> None:
    """Time every ``schedule`` + ``update_from_output`` pair, with the ``add_request`` calls
    since the step before (admission runs between steps: kvguard's admission hook, and a
    drained audit the checkpoint pace owes, are paid there); tag what kvguard did in it."""
    schedule, update, admit = sched.schedule, sched.update_from_output, sched.add_request
    acc = [0]
    admitted = [0]
    """``add_request`` time since the last step (ns), counted in the next one."""

    def marks() -> tuple[int, int]:
        if guard is None:
            return 0, 0
        return len(guard.reports), guard.online.stats.sweeps_total if guard.online else 0

    last = [marks()]
    """kvguard's marks at the end of the last step: a change since is this step's doing."""

    def admitted_done(ns: int) -> None:
        admitted[0] += ns

    def schedule_done(ns: int) -> None:
        acc[0] = ns + admitted[0]
        admitted[0] = 0

    def update_done(ns: int) -> None:
        samples.append(acc[0] + ns)
        after = marks()
        tags.append("checkpoint" if after[0] != last[0][0] else
                    "sweep" if after[1] != last[0][1] else "")
        last[0] = after

    add_request_timed = _clocked(admit, admitted_done)
    schedule_timed = _clocked(schedule, schedule_done)
    update_timed = _clocked(update, update_done)
    sched.schedule, sched.update_from_output = schedule_timed, update_timed
    sched.add_request = add_request_timed


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


def _spec() -> Any:
    """The engine both sides run: the tiny Llama, a 160-block pool, a draft model."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from kvguard.testing.engine import EngineSpec
    from kvguard.testing.tiny_model import make_draft_model, make_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="kvguard-bench-mix-"))
    os.environ["KVGUARD_RUN_DIR"] = str(tmp / "run")
    return EngineSpec(model_dir=make_tiny_model(tmp), num_gpu_blocks_override=POOL_BLOCKS,
                      max_model_len=512, max_num_seqs=REQUESTS, max_num_batched_tokens=2048,
                      kv_cache_memory_bytes=32 << 20,
                      extra={"speculative_config": {"method": "draft_model",
                                                    "model": str(make_draft_model(tmp)),
                                                    "num_speculative_tokens": 3}})


def _build_engine_on() -> tuple[Any, Any]:
    from kvguard.chaos.harness import EngineHarness

    h = EngineHarness(_spec())
    return h, h.scheduler


def toggle_worker(modes: tuple[str, ...]) -> None:
    """One engine with kvguard; each round runs with its hooks in place, taken out (the
    engine's own methods back), replaced by :func:`passthrough` wrappers, or as the
    as the driver asks: ``run SEED on|off|bare`` (one of ``modes``, each warmed up
    first). The same engine, process
    and memory on every side, so the ratios carry no process or engine bias.
    ``selftime ROUNDS``: kvguard's own time per hook, from clocks at every hook boundary."""
    h, sched = _build_engine_on()
    hooks = kvguard_hooks(h.scheduler)
    samples: list[int] = []
    tags: list[str] = []

    def verdicts() -> dict[str, int]:
        """kvguard's reports so far, by verdict."""
        return dict(collections.Counter(r.verdict.value for r in h.guard.reports))

    def set_mode(mode: str) -> None:
        set_hooks(hooks, mode == "on")
        if mode == "bare":
            for obj, name, _ in hooks:
                setattr(obj, name, passthrough(getattr(type(obj), name).__get__(obj)))
        timed(sched, samples, tags, h.guard if mode not in ("off", "bare") else None)

    for mode in modes:
        set_mode(mode)
        run_round(h, 0)  # warm-up, every way
    reply("ready")
    for line in sys.stdin:
        words = line.split()
        if words[0] == "verdicts":  # what kvguard's drained audits said, and let go
            reply({"verdicts": verdicts(), "drains_unaudited": h.guard.pacer.drains_unaudited,
                   "double_frees": h.guard.ledger.num_double_frees,
                   "hook_errors": dict(h.guard.errors.by_hook)})
            continue
        if words[0] == "selftime":
            set_mode("on")
            out = self_time(h, hooks, int(words[1]))
            # Taking the hooks out between drained rounds must leave kvguard's records
            # true: every drained checkpoint of the hooked rounds is clean or saturated.
            out["verdicts"] = verdicts()
            reply(out)
            continue
        set_mode(words[2])
        samples.clear()
        tags.clear()
        # Both modes run each seed from the same pool state: an empty prefix cache (else
        # the second run of a seed would hit the blocks the first one cached).
        h.engine.reset_prefix_cache()
        before = {k: h.vllm_metric(k) for k in COUNTERS}
        run_round(h, int(words[1]))
        reply({"us": [x / 1000 for x in samples],
               "vllm": {k: h.vllm_metric(k) - before[k] for k in COUNTERS}})
    os._exit(0)


def self_time(h: Any, hooks: list[tuple[Any, str, Any]], rounds: int) -> dict[str, Any]:
    """kvguard's own time per hook and per session method, per step (us), over ``rounds``.

    A clock read at every boundary between kvguard and the engine (entering a hook, its
    call to the engine's method, that call's return, the hook's return) charges each
    interval to the hook or method running; nested calls are charged to the innermost.
    The clocks cost about 0.1-0.3 us per boundary, inside the buckets."""
    pc = time.perf_counter_ns
    names = ["engine"]
    acc = [0] * 64
    calls = [0] * 64
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
    for n in ("claim", "checkpoint_now", "publish", "_online_step", "on_admitted",
              "on_finished", "drain_blocker"):
        names.append(f"session {n}")
        setattr(g, n, bucketed(getattr(g, n), len(names) - 1))
        restore.append((g, n, None))
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


def measure_toggle(env: dict[str, str], tmp: Path, *, self_time: bool = True,
                   floor: bool = False,
                   processes: int = TOGGLE_PROCESSES,
                   seconds: float = TOGGLE_SECONDS,
                   seconds_env: str = "KVGUARD_BENCH_MIX_TOGGLE_SECONDS") -> dict[str, Any]:
    """The same engine with kvguard's hooks in and out, per round (ABBA), in ``processes``
    processes, ``TOGGLE_MIN_ROUNDS`` to ``TOGGLE_ROUNDS`` rounds each within ``seconds``
    of wall time (:class:`RoundBudget`); then kvguard's own time per hook in the first one
    (``self_time``), and what its drained audits said in each. ``floor``: each round also
    runs with :func:`passthrough` wrappers (ABC, CBA), which splits the ratio into the
    interception's (bare / off) and kvguard's work's (on / bare)."""
    modes = MODES if floor else ("on", "off")
    per_round: list[float] = []
    per_round_bare: list[float] = []
    per_round_work: list[float] = []
    per_process: list[float] = []
    us: dict[str, list[float]] = {m: [] for m in modes}
    mismatched = 0
    breakdown: dict[str, Any] = {}
    verdicts: collections.Counter[str] = collections.Counter()
    unaudited = 0
    double_frees = 0
    hook_errors: collections.Counter[str] = collections.Counter()
    for p in range(processes):
        w = Worker(__file__, ["toggle", *modes], env, tmp / f"toggle-{p}.log")
        try:
            mine: dict[str, list[float]] = {m: [] for m in modes}
            budget = RoundBudget(seconds_env, seconds,
                                 min_rounds=min(TOGGLE_MIN_ROUNDS, TOGGLE_ROUNDS),
                                 max_rounds=TOGGLE_ROUNDS, step=2)  # ABBA
            r = 0
            while budget.more(r):
                r += 1
                seed = 500 + p * TOGGLE_ROUNDS + r  # distinct per process up to the most rounds
                got: dict[str, dict[str, Any]] = {}
                for k in (modes if r % 2 else modes[::-1]):
                    out = w.ask(f"run {seed} {k}")
                    assert isinstance(out, dict)
                    got[k] = out
                    mine[k] += out["us"]
                if any(len(got[k]["us"]) != len(got["off"]["us"])
                       or got[k]["vllm"] != got["off"]["vllm"] for k in modes):
                    mismatched += 1
                mean_of = {k: statistics.fmean(got[k]["us"]) for k in modes}
                per_round.append(mean_of["on"] / mean_of["off"])
                if floor:
                    per_round_bare.append(mean_of["bare"] / mean_of["off"])
                    per_round_work.append(mean_of["on"] / mean_of["bare"])
            per_process.append(statistics.fmean(mine["on"]) / statistics.fmean(mine["off"]))
            for k in us:
                us[k] += mine[k]
            out = w.ask("verdicts")
            assert isinstance(out, dict)
            verdicts.update(out["verdicts"])
            unaudited += out["drains_unaudited"]
            double_frees += out["double_frees"]
            hook_errors.update(out["hook_errors"])
            if p == 0 and self_time:
                out = w.ask(f"selftime {SELF_TIME_ROUNDS}")
                assert isinstance(out, dict)
                breakdown = out
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
    if floor:
        bare_mean, bare_half = t_interval(per_round_bare)
        work_mean, work_half = t_interval(per_round_work)
        out["floor"] = {"bare_mean_ratio": bare_mean, "bare_interval_half": bare_half,
                        "work_mean_ratio": work_mean, "work_interval_half": work_half,
                        "per_round_bare_ratio": per_round_bare,
                        "per_round_work_ratio": per_round_work, "bare_us": stats(us["bare"])}
    return out


def main() -> None:
    env, tmp = _alone()
    toggle = measure_toggle(env, tmp, floor=True)
    # The same with the opt-in checkpoint pace: what it buys on a workload that drains
    # every round (not the defaults).
    paced = measure_toggle(env | {"KVGUARD_CHECKPOINT_MIN_INTERVAL_SECONDS": PACED_INTERVAL},
                           tmp, self_time=False, processes=PACED_PROCESSES,
                           seconds=PACED_SECONDS,
                           seconds_env="KVGUARD_BENCH_MIX_PACED_SECONDS")
    print(f"same engine, hooks in/out: {toggle['mean_ratio']:.4f} +- "
          f"{toggle['interval_half']:.4f} over {toggle['rounds']} rounds "
          f"({toggle['rounds_mismatched']} with different work); checkpoint pace "
          f"{PACED_INTERVAL} s: {paced['mean_ratio']:.4f} +- {paced['interval_half']:.4f}")
    save("step_mix", {"target_mean_ratio": 1.02, "toggle": toggle,
                      "toggle_paced": paced | {"interval_seconds": float(PACED_INTERVAL)}})


def _alone() -> tuple[dict[str, str], Path]:
    """What a measurement needs: the plugin, one hash seed and plain request ids (vLLM
    iterates sets of request ids, and its random id suffix would order the batches
    differently from round to round), and a directory for the workers' logs."""
    os.environ.setdefault("VLLM_PLUGINS", "kvguard")
    return ({"PYTHONHASHSEED": "0", "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1"},
            Path(tempfile.mkdtemp(prefix="kvguard-bench-mix-")))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "worker" and sys.argv[2] == "toggle":
        toggle_worker(tuple(sys.argv[3:]) or MODES)
    elif sys.argv[1:] == ["toggle"]:  # the same-engine measurement alone (minutes, not tens)
        print(json.dumps(measure_toggle(*_alone(), floor=True), indent=1))
    else:
        main()
