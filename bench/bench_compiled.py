"""Target 8's other what-if: kvguard's hot path compiled to C, against the same code interpreted.

The first question a reader asks of target 8's miss is "why not write the hooks in C?".
This measures the answer without writing them twice: mypyc (mypy's compiler, which ships
with the ``mypy`` of the dev extra, and compiles the typed source as it is) turns the
modules of :data:`COMPILED` into C extensions in a copy of the package, and two worker
processes run the step mix of ``bench_step_mix.py`` (prefix hits, preemption, aborts,
speculative decoding) on the same engine build, one importing the interpreted package and
one the compiled copy. Nothing else differs: the same source, the same engine, the same
rounds (greedy, one hash seed), in turn (ABBA), both processes alive.

What is compared is kvguard's own time per step, read from its live cost meter with every
step metered (``KVGUARD_COST_SAMPLE_EVERY_STEPS=1``; ``bench_cost_meter.py`` checks the
meter against the benchmark's own clocks): the part compiling can change. The meter's
clocks sit in ``hooks.py`` and are compiled with it, so the compiled side's clocks are a
little cheaper too (4 reads per hook call, 0.1-0.3 us each interpreted): the saving read
here is an upper bound, by that much. Each side's scheduler time per step gives the ratio
target 8 states for it (scheduler time over scheduler time without kvguard's part).

Valid only where the compiled side loaded the compiled modules (their ``__file__``), both
sides took the same steps and vLLM counted the same work in every round, and no drained
audit said leak. Not in the default run (``./scripts/bench``): the compile alone takes
about 4 minutes here (mypy type-checks the modules' imports first). Run it with
``.venv/bin/python bench/bench_compiled.py``; the result is ``results/compiled.json``,
shown in BENCHMARKS.md as row "8 (compiled)".
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Final

from common import RoundBudget, Worker, reply, save, stats, t_interval

REPO: Final = Path(__file__).resolve().parent.parent
COMPILED: Final = ("kvguard/core/ledger.py", "kvguard/vllm_plugin/hooks.py")
"""The modules compiled: the ledger (every pool event and claim) and the hooks (every call
kvguard intercepts, the meter's clocks). The session, the online audit and the pacer are
left interpreted: mypyc 2.4 generates C that does not build for ``kvguard.core.session``
(a module reference to ``pydantic.main`` it never declares), and those run once per step,
not once per event."""
PROCESSES = int(os.environ.get("KVGUARD_BENCH_COMPILED_PROCESSES", "3"))
"""Process pairs: a process carries a bias of its own (where its code and data landed)."""
ROUNDS = 12
"""Rounds per pair at most, ABBA; at least ``MIN_ROUNDS``, more while ``SECONDS`` last."""
MIN_ROUNDS = 6
SECONDS = 90.0
MODES: Final = ("interpreted", "compiled")


def build(dest: Path) -> float:
    """A copy of the package in ``dest`` with :data:`COMPILED` built by mypyc in place;
    returns the seconds the compile took."""
    shutil.copytree(REPO / "kvguard", dest / "kvguard",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "mypyc", *COMPILED], cwd=dest,
                          capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"mypyc failed ({proc.returncode}); its output ends:\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return time.monotonic() - t0


def worker(mode: str) -> None:
    """One side: the step-mix engine with kvguard, every step metered; a round per
    ``run SEED``: kvguard's self time and the scheduler time per step, the steps, vLLM's
    counters; ``loaded``: the file suffix each measured module was imported from (``.so``:
    compiled); ``verdicts``: what kvguard's drained audits said."""
    os.environ["KVGUARD_COST_SAMPLE_EVERY_STEPS"] = "1"
    import collections

    import bench_step_mix as mix

    import kvguard.core.ledger
    import kvguard.vllm_plugin.hooks

    loaded = {m.__name__: Path(m.__file__ or "").suffix
              for m in (kvguard.core.ledger, kvguard.vllm_plugin.hooks)}
    h, _ = mix._build_engine_on()
    meter = h.guard.meter
    mix.run_round(h, 0)  # warm-up
    reply("ready")
    for line in sys.stdin:
        words = line.split()
        if words[0] == "loaded":  # where each compiled-or-not module came from
            reply(loaded)
            continue
        if words[0] == "verdicts":
            reply(dict(collections.Counter(r.verdict.value for r in h.guard.reports)))
            continue
        h.engine.reset_prefix_cache()  # every round from the same pool state
        before = {k: h.vllm_metric(k) for k in mix.COUNTERS}
        s0, c0, n0 = meter.self_ns_total, meter.scheduler_ns_total, meter.steps_total
        mix.run_round(h, int(words[1]))
        n = meter.steps_total - n0
        reply({"steps": n, "self_us": (meter.self_ns_total - s0) / n / 1000,
               "scheduler_us": (meter.scheduler_ns_total - c0) / n / 1000,
               "vllm": {k: h.vllm_metric(k) - before[k] for k in mix.COUNTERS}})
    os._exit(0)


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="kvguard-bench-compiled-"))
    compile_seconds = build(tmp / "src")
    srcs = {"interpreted": REPO, "compiled": tmp / "src"}
    per_round: list[dict[str, Any]] = []
    loaded: dict[str, dict[str, str]] = {}
    verdicts: dict[str, int] = {}
    mismatched = 0
    for pair in range(PROCESSES):
        sides: dict[str, Worker] = {}
        try:
            for mode in MODES:
                env = {"PYTHONHASHSEED": "0", "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION": "1",
                       "VLLM_PLUGINS": "kvguard", "PYTHONPATH": str(srcs[mode])}
                sides[mode] = Worker(__file__, [mode], env, tmp / f"{mode}-{pair}.log")
                got_loaded = sides[mode].ask("loaded")
                assert isinstance(got_loaded, dict)
                # Every pair's, not the last one's: a suffix that differs between pairs
                # reads "mixed" (the row is then not valid).
                seen = loaded.setdefault(mode, got_loaded)
                for name, suffix in got_loaded.items():
                    if seen.get(name) != suffix:
                        seen[name] = "mixed"
            budget = RoundBudget("KVGUARD_BENCH_COMPILED_SECONDS", SECONDS,
                                 min_rounds=MIN_ROUNDS, max_rounds=ROUNDS, step=2)
            r = 0
            while budget.more(r):
                r += 1
                seed = pair * 100 + r
                got: dict[str, dict[str, Any]] = {}
                order = MODES if r % 4 in (1, 0) else MODES[::-1]  # ABBA
                for mode in order:
                    out = sides[mode].ask(f"run {seed}")
                    assert isinstance(out, dict)
                    got[mode] = out
                a, b = got["interpreted"], got["compiled"]
                same = a["steps"] == b["steps"] and a["vllm"] == b["vllm"]
                mismatched += not same
                per_round.append({"pair": pair, "steps": a["steps"], "same_work": same,
                                  **{f"{m}_{k}": got[m][k] for m in MODES
                                     for k in ("self_us", "scheduler_us")},
                                  "self_ratio": b["self_us"] / a["self_us"]})
            for w in sides.values():
                v = w.ask("verdicts")
                assert isinstance(v, dict)
                for k, n in v.items():
                    verdicts[k] = verdicts.get(k, 0) + n
        finally:
            for w in sides.values():
                w.close()
    ratios = [x["self_ratio"] for x in per_round]
    mean, half = t_interval(ratios)
    per_process = [statistics.fmean(x["self_ratio"] for x in per_round if x["pair"] == p)
                   for p in range(PROCESSES)]
    sides_out = {}
    for mode in MODES:
        self_us = [x[f"{mode}_self_us"] for x in per_round]
        sched_us = [x[f"{mode}_scheduler_us"] for x in per_round]
        s, c = statistics.fmean(self_us), statistics.fmean(sched_us)
        sides_out[mode] = {"self_us": stats(self_us), "scheduler_us": stats(sched_us),
                           "share_of_scheduler": s / c, "implied_ratio": c / (c - s)}
    print(f"compiled / interpreted, kvguard's own time per step: {mean:.3f} +- {half:.3f} "
          f"({len(ratios)} rounds, processes {[round(p, 3) for p in per_process]}); "
          + "; ".join(f"{m} {o['self_us']['mean']:.1f} us of {o['scheduler_us']['mean']:.0f}"
                      f" ({o['implied_ratio']:.3f}x)" for m, o in sides_out.items()))
    save("compiled", {
        "compiled_modules": list(COMPILED), "compile_seconds": compile_seconds,
        "loaded": loaded, "rounds": len(ratios), "processes": PROCESSES,
        "rounds_mismatched": mismatched, "verdicts": verdicts,
        "self_ratio_mean": mean, "self_ratio_interval_half": half,
        "per_process_self_ratio": per_process, "sides": sides_out, "per_round": per_round,
        "target_mean_ratio": 1.02})


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "worker":
        worker(sys.argv[2])
    else:
        main()
