"""The drain model as a monitor: when will this engine next drain (``state.drain``).

Watches: admissions (arrivals) and finishes (completions), per request.
Adds: the ``drain`` section of the state (rates, backlog, predicted drain time or "does
not drain"); a skipped checkpoint asked for under load quotes its explanation.
Costs per step: nothing (two clock-free updates per request; the prediction is built at
publish time only).
"""

from __future__ import annotations

import time

from kvguard.core.drain_model import DrainEstimator, DrainPrediction
from kvguard.core.engine import EngineAdapter
from kvguard.core.monitor import BaseMonitor, StateSection
from kvguard.core.types import FinishReason, RequestId


class DrainForecast(BaseMonitor):
    """Arrival and completion rates, and the drain they predict
    (:mod:`kvguard.core.drain_model`)."""

    name = "drain"

    def __init__(self, adapter: EngineAdapter, started_at: float) -> None:
        self.adapter = adapter
        self.estimator = DrainEstimator(started_at=started_at)
        """Fed by the events; read at publish time."""

    def on_request_admitted(self, request_id: RequestId, at: float) -> None:
        self.estimator.on_arrival(at)

    def on_request_finished(self, request_id: RequestId, reason: FinishReason,
                            at: float) -> None:
        self.estimator.on_completion(at)

    def predict(self, now: float | None = None) -> DrainPrediction:
        """The prediction now, from the engine's current backlog (running + waiting)."""
        act = self.adapter.activity()
        return self.estimator.predict(time.time() if now is None else now,
                                      act.running + act.waiting)

    def state_section(self) -> StateSection:
        return {"drain": self.predict()}
