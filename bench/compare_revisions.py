"""Target 1 before/after a change: the hook-overhead benchmark on two kvguard revisions,
paired and interleaved.

``python bench/compare_revisions.py BEFORE AFTER [--pairs 4] [--rounds 20]``

Each revision is checked out in a temporary git worktree; this checkout's
``bench/bench_hook_overhead.py`` (the same script for both) runs in a fresh process
with that worktree first on ``PYTHONPATH``, ``--pairs`` times per revision in ABBA
order (before, after, after, before, ...), so machine drift hits both alike. Each
process measures kvguard against an engine without kvguard in the same process (its
per-round ratio), so what is compared across revisions is a ratio, not a time.
Writes ``bench/results/hook_overhead_before_after.json``; ``bench/run_all.py`` renders
it into BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import RESULTS, machine

ROOT = Path(__file__).resolve().parents[1]


def _run(rev_dir: Path, rounds: int, out_dir: Path) -> dict[str, object]:
    bench = out_dir / "bench"
    if not bench.exists():
        shutil.copytree(ROOT / "bench", bench, ignore=shutil.ignore_patterns("results"))
    env = {**os.environ, "PYTHONPATH": str(rev_dir), "KVGUARD_BENCH_ROUNDS": str(rounds),
           "KVGUARD_BENCH_RESULTS": str(out_dir), "VLLM_PLUGINS": "kvguard"}
    subprocess.run([sys.executable, str(bench / "bench_hook_overhead.py")], env=env,
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    d: dict[str, object] = json.loads((out_dir / "hook_overhead.json").read_text())
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=20)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvguard-compare-"))
    revs = {}
    for name, rev in (("before", a.before), ("after", a.after)):
        sha = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout.strip()
        subprocess.run(["git", "worktree", "add", "--detach", str(tmp / name), sha], cwd=ROOT,
                       check=True, capture_output=True)
        revs[name] = sha
    runs: dict[str, list[dict[str, object]]] = {"before": [], "after": []}
    try:
        order = 0
        for i in range(a.pairs):
            for name in (("before", "after") if i % 2 == 0 else ("after", "before")):
                order += 1
                d = _run(tmp / name, a.rounds, tmp / f"out-{order}")
                runs[name].append({"order": order, "ratio_per_round": d["ratio_per_round"],
                                   "ratio_hooks_only_per_round":
                                       d["ratio_hooks_only_per_round"],
                                   "mean_ratio": d["mean_ratio"]})
                print(f"{order} {name}: per-round median "
                      f"{statistics.median(d['ratio_per_round']):.3f}", flush=True)  # type: ignore[arg-type]
    finally:
        for name in revs:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp / name)], cwd=ROOT,
                           capture_output=True)
    summary = {}
    for name, rs in runs.items():
        pooled = [x for r in rs for x in r["ratio_per_round"]]  # type: ignore[attr-defined]
        hooks = [x for r in rs for x in r["ratio_hooks_only_per_round"]]  # type: ignore[attr-defined]
        q, qh = statistics.quantiles(pooled, n=4), statistics.quantiles(hooks, n=4)
        summary[name] = {"revision": revs[name], "processes": len(rs),
                         "per_round_median": statistics.median(pooled),
                         "per_round_quartiles": [q[0], q[2]],
                         "hooks_only_per_round_median": statistics.median(hooks),
                         "hooks_only_per_round_quartiles": [qh[0], qh[2]],
                         "process_medians": [statistics.median(r["ratio_per_round"])  # type: ignore[arg-type]
                                             for r in rs]}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "hook_overhead_before_after.json").write_text(json.dumps(
        {"name": "hook_overhead_before_after", "machine": machine(), "pairs": a.pairs,
         "rounds_per_process": a.rounds, "summary": summary, "runs": runs}, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
