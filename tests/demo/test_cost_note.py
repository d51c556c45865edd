"""The demo's cost line: the share it metered, what its own audit budget changed in it, the
share at the defaults, and end-to-end terms, so that a first run does not mislead."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from kvguard.demo.run import DEFAULT_ONLINE_BUDGET, DEMO_ONLINE_BUDGET, cost_note
from kvguard.transport.state import CostState, OnlineState

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sidecar"))
from factories import report, state

# 10 windows of 8 steps metered, one in every 512: about 11 * 512 = 5,632 steps in all,
# 1 ms of scheduler time each (5.6 s), kvguard 0.132 ms of it (13.2 %).
METERED = CostState(sample_every_steps=512, window_steps=8, sampled_steps_total=80,
                    self_seconds_total=0.01056, scheduler_seconds_total=0.08)


def _note(audit_seconds: float, busy_seconds: float | None = None) -> str:
    online = OnlineState(budget_fraction=DEMO_ONLINE_BUDGET, sweeps_total=3,
                         audit_seconds_total=audit_seconds)
    s = state([report(1)]).model_copy(update={"cost": METERED, "online": online})
    return cost_note(s, busy_seconds)


def test_an_audit_that_spent_its_demo_budget_is_taken_down_to_the_default() -> None:
    # 0.2816 s of audit = 5 % of 5.632 s: the whole demo budget; at the defaults 0.5 %.
    note = _note(0.2816)
    assert DEFAULT_ONLINE_BUDGET == 0.005
    assert "13.2 % of scheduler time; its online audit spent about 5.0 % of it" in note
    assert "under this demo's budget of 5.0 % (default 0.5 %)" in note
    assert "so at the defaults about 8.7 %" in note  # 13.2 - 5 + 0.5
    assert "kvguard keeps about 0.99x of vLLM's throughput, a cost of about 1 %" in note


def test_an_audit_that_spent_little_changes_little() -> None:
    # A small pool sweeps fast: 0.029 s of audit is 0.5 % of 5.632 s, within the default.
    note = _note(0.029)
    assert "its online audit spent about 0.5 % of it" in note
    assert "so at the defaults about 13.2 %" in note


def test_end_to_end_here_is_kvguards_own_time_over_the_workloads_wall_time() -> None:
    # 0.132 ms x 5,632 steps = 0.743 s of kvguard over 30 s of workload.
    assert "about 2.5 % of the workload's 30 s" in _note(0.029, 30.0)
    assert "of the workload" not in _note(0.029)


@pytest.mark.parametrize("cost", [None, METERED.model_copy(update={"sampled_steps_total": 0})])
def test_nothing_metered_says_nothing(cost: CostState | None) -> None:
    assert cost_note(state([report(1)]).model_copy(update={"cost": cost})) == ""
