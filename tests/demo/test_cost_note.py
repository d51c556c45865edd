"""The demo's cost line: the share it metered, what its own audit budget adds, the share
at the defaults, and the end-to-end figure, so that a first run does not mislead."""

from __future__ import annotations

import sys
from pathlib import Path

from kvguard.demo.run import DEFAULT_ONLINE_BUDGET, DEMO_ONLINE_BUDGET, cost_note
from kvguard.transport.state import CostState, OnlineState

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sidecar"))
from factories import report, state


def test_demo_separates_its_audit_budget_from_the_cost_at_the_defaults() -> None:
    metered = CostState(sample_every_steps=16, window_steps=8, sampled_steps_total=64,
                        self_seconds_total=0.0132, scheduler_seconds_total=0.1)
    online = OnlineState(budget_fraction=DEMO_ONLINE_BUDGET, sweeps_total=3)
    s = state([report(1)]).model_copy(update={"cost": metered, "online": online})
    note = cost_note(s)
    assert DEFAULT_ONLINE_BUDGET == 0.005
    assert "13.2 % of scheduler time, with this demo's online-audit budget of 5.0 %" in note
    assert "(default 0.5 %); at the defaults about 8.7 %" in note  # 13.2 - 5 + 0.5
    assert "end to end, at the defaults, kvguard keeps about 0.99x" in note
    assert "costs about 1 %" in note


def test_nothing_metered_says_nothing() -> None:
    assert cost_note(state([report(1)])) == ""
