"""The trend verdict across consecutive judged checkpoints of one engine.

Judged: drained checkpoints that were not skipped, and online audit reports
(which are issued when what the audit confirms changes).

One checkpoint can say "5 blocks held by finished requests". Only a series can
say whether that number is *growing* (a leak that will fill the pool, even if
each step is small) or a cache that climbed to its capacity and stays there
(saturation, fine).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from kvguard.core.report import CheckpointReport
from kvguard.core.types import Evidence, Verdict

TREND_WINDOW = 4
"""Drained checkpoints considered (the most recent ones)."""


class TrendVerdict(enum.StrEnum):
    INSUFFICIENT_DATA = "insufficient_data"
    CLEAN = "clean"
    SATURATED = "saturated"
    LEAK_STABLE = "leak_stable"
    LEAK_GROWING = "leak_growing"


@dataclass(frozen=True, slots=True)
class Trend:
    verdict: TrendVerdict
    checkpoints: int
    """Drained checkpoints the verdict rests on."""
    holding_series: tuple[int, ...]
    """Finished requests holding blocks at each of them, oldest first."""
    explanation: str


def judged(r: CheckpointReport) -> bool:
    """A report with a verdict on the pool: drained and not skipped, or online."""
    if r.evidence is Evidence.ONLINE:
        return True
    return r.drained and r.verdict is not Verdict.SKIPPED


def trend(reports: Sequence[CheckpointReport], window: int = TREND_WINDOW) -> Trend:
    """Judge the last ``window`` judged checkpoints of ``reports`` (oldest first, one epoch)."""
    drained = [r for r in reports if judged(r)][-window:]
    series = tuple(r.finished_requests_holding_blocks for r in drained)
    leaked = tuple(r.leaked_blocks for r in drained)
    n = len(drained)
    if n == 0:
        return Trend(TrendVerdict.INSUFFICIENT_DATA, 0, series,
                     "No drained checkpoint yet: nothing to compare.")
    growing = n >= 2 and all(b >= a for a, b in pairwise(series)) \
        and series[-1] > series[0]
    growing |= n >= 2 and all(b >= a for a, b in pairwise(leaked)) \
        and leaked[-1] > leaked[0]
    if growing:
        return Trend(TrendVerdict.LEAK_GROWING, n, series,
                     f"Finished requests holding blocks grew over {n} drained checkpoints "
                     f"({' -> '.join(map(str, series))}; leaked blocks "
                     f"{' -> '.join(map(str, leaked))}): a leak that will fill the pool. "
                     "See the latest report for the requests and the path.")
    if leaked[-1] > 0:
        return Trend(TrendVerdict.LEAK_STABLE, n, series,
                     f"{leaked[-1]} leaked blocks at the last drained checkpoint, not growing "
                     f"over {n} checkpoints: a one-off leak; the pool lost that capacity.")
    if n < 2:
        return Trend(TrendVerdict.INSUFFICIENT_DATA, n, series,
                     "One clean drained checkpoint so far; a trend needs two.")
    if drained[-1].verdict is Verdict.SATURATED:
        return Trend(TrendVerdict.SATURATED, n, series,
                     f"The prefix cache sits at {drained[-1].saturation_ratio:.0%} of capacity "
                     "with no leak: saturation by design, not a leak.")
    return Trend(TrendVerdict.CLEAN, n, series, f"{n} drained checkpoints, no leak.")
