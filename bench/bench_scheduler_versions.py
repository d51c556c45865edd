"""Target 8 per vLLM release: kvguard's cost on the scheduler of 0.32, 0.33 and 0.34.

vLLM's real ``Scheduler`` and ``BlockPool`` stepped without a model, once per installed
vLLM release (0.32, 0.33 and 0.34), hooks in and out per round.

vLLM 0.33's and 0.34's model runners cannot run on CPU, so this is the level every release
runs here (``tests/scheduler/_sched.py``, as vLLM's ``tests/v1/core`` drive it), each
release in a worker of its own venv. A round: 48 requests in 4 groups sharing a 48-token
prefix, a pool too small for them all, 4 aborted at step 15, stepped until vLLM holds
nothing. A step's time is its ``schedule``, ``update_from_output``, ``add_request`` and
``finish_requests`` calls, clocked outside kvguard's hooks; rounds ABBA, the prefix cache
reset before each; both sides' steps, preemptions and prefix hits checked equal. With no
forward pass the ratio is not target 8's: what this compares is the releases.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Final

from harness import (
    RoundBudget,
    Worker,
    abba,
    clocked,
    kvguard_hooks,
    reply,
    save,
    set_hooks,
    stats,
    t_interval,
    verdict_counts,
)

ROOT: Final = Path(__file__).resolve().parents[1]
VENVS: Final = {"0.32": ROOT / ".venv", "0.33": ROOT / ".venv-vllm033",
                "0.34": ROOT / ".venv-vllm034"}
"""The releases measured, each by the interpreter of its venv (``scripts/bootstrap``)."""
REQUESTS, PREFIX_TOKENS, POOL_BLOCKS, MAX_NUM_SEQS = 48, 48, 120, 32
ABORT_AT_STEP, ABORTED = 15, 4
MIN_ROUNDS, MAX_ROUNDS = 8, 40
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

    def run(seed: int, on: bool) -> dict[str, Any]:
        for name in timed:
            sched.__dict__.pop(name, None)
        set_hooks(hooks, on)
        for name in timed:
            setattr(sched, name, clocked(getattr(sched, name), clock))  # outside the hooks
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
        elif words[0] == "verdicts":
            reply(verdict_counts(s.guard))
        else:
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
    try:
        version = w.ask("version")
        budget = RoundBudget("KVGUARD_BENCH_VERSIONS_SECONDS", SECONDS, min_rounds=MIN_ROUNDS,
                             max_rounds=MAX_ROUNDS, step=2)
        rounds = abba(budget, ("on", "off"), lambda r, m: w.ask(f"run {r} {m}"))
        verdicts = w.ask("verdicts")
    finally:
        w.close()
    r = len(rounds)
    us = {m: [x for got in rounds for x in got[m]["us"]] for m in ("on", "off")}
    work = [got["off"]["work"] for got in rounds]
    mismatched = sum(got["on"]["work"] != got["off"]["work"] for got in rounds)
    per_round = [statistics.fmean(got["on"]["us"]) / statistics.fmean(got["off"]["us"])
                 for got in rounds]
    mean, half = t_interval(per_round)
    row = {"release": release, "vllm": version, "rounds": r, "mean_ratio": mean,
           "interval_half": half, "per_round_ratio": per_round,
           "median_ratio": statistics.median(us["on"]) / statistics.median(us["off"]),
           "with_us": stats(us["on"]), "without_us": stats(us["off"]),
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
