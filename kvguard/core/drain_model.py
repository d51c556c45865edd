"""When can the next drained checkpoint happen? A fluid-queue prediction.

The workload boundary, not memory: with arrival rate λ, completion rate μ and
backlog q0 now, the fluid model q(t) = max(0, q0 + (λ - μ)·t) drains at
t = q0 / (μ - λ) when λ < μ, and never when λ ≥ μ: a nonzero steady backlog
is ongoing work, not a leak, and kvguard says so instead of guessing.

λ and μ are counted over a sliding window of lifecycle events (admissions and
finishes), per second. The estimator keeps at most ``max_events`` timestamps
per kind, so its memory is bounded whatever the traffic.
"""

from __future__ import annotations

import math
from collections import deque

from pydantic import BaseModel, ConfigDict, Field

DRAIN_WINDOW_SECONDS = 30.0
MIN_SPAN_SECONDS = 1.0
"""Rates are never computed over less than this (a 3-event burst is not 3000/s)."""


class DrainPrediction(BaseModel):
    """The drain model's view at ``at`` (Unix s); ``eta_seconds`` is ``inf`` if it never drains."""

    # inf must survive JSON (the state file): written as Infinity, read back as inf.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True,
                              ser_json_inf_nan="constants")

    at: float
    arrival_rate_per_s: float = Field(ge=0.0)
    completion_rate_per_s: float = Field(ge=0.0)
    backlog: int = Field(ge=0, description="Requests waiting, running or preempted now.")
    window_seconds: float = Field(ge=0.0)
    drains: bool
    eta_seconds: float = Field(ge=0.0, description="inf when the workload does not drain.")
    explanation: str


def fluid_backlog(q0: float, arrival_rate: float, completion_rate: float, t: float) -> float:
    """q(t) = max(0, q0 + (λ - μ)·t): the lab's model, and the estimator's."""
    return max(0.0, q0 + (arrival_rate - completion_rate) * t)


def predict(q0: int, arrival_rate: float, completion_rate: float, *, at: float,
            window_seconds: float) -> DrainPrediction:
    lam, mu = arrival_rate, completion_rate
    if q0 == 0:
        drains, eta = True, 0.0
        text = "Nothing in flight: drained now."
    elif lam < mu:
        drains, eta = True, q0 / (mu - lam)
        text = (f"Drains in about {eta:.1f} s: λ={lam:.2f}/s < μ={mu:.2f}/s, "
                f"backlog {q0}.")
    else:
        drains, eta = False, math.inf
        text = (f"Does not drain: λ={lam:.2f}/s ≥ μ={mu:.2f}/s, backlog {q0}. A steady "
                "backlog is ongoing work, not a leak; a drained checkpoint needs a quiet "
                "moment (or the online audit).")
    return DrainPrediction(at=at, arrival_rate_per_s=lam, completion_rate_per_s=mu, backlog=q0,
                           window_seconds=window_seconds, drains=drains, eta_seconds=eta,
                           explanation=text)


class DrainEstimator:
    """Sliding-window λ and μ from admission and finish times (Unix s, non-decreasing)."""

    def __init__(self, *, window_seconds: float = DRAIN_WINDOW_SECONDS,
                 max_events: int = 100_000, started_at: float = 0.0) -> None:
        self.window_seconds = window_seconds
        self.started_at = started_at
        self._arrivals: deque[float] = deque(maxlen=max_events)
        self._completions: deque[float] = deque(maxlen=max_events)

    def on_arrival(self, at: float) -> None:
        self._arrivals.append(at)

    def on_completion(self, at: float) -> None:
        self._completions.append(at)

    def _rate(self, events: deque[float], now: float) -> tuple[float, float]:
        horizon = now - self.window_seconds
        while events and events[0] < horizon:
            events.popleft()
        span = max(MIN_SPAN_SECONDS, min(self.window_seconds, now - self.started_at))
        return len(events) / span, span

    def predict(self, now: float, backlog: int) -> DrainPrediction:
        lam, span = self._rate(self._arrivals, now)
        mu, _ = self._rate(self._completions, now)
        return predict(backlog, lam, mu, at=now, window_seconds=span)
