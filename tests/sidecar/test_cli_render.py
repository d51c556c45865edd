"""`kvguard report` text: an online finding says it is one, with the audit's pace."""

from __future__ import annotations

from factories import report, state

from kvguard.cli.render import render_state
from kvguard.core.report import LeakReport, OnlineSweepReport
from kvguard.core.types import Evidence, LeakCause, LeakPath, Verdict
from kvguard.transport.state import OnlineState


def test_online_report_and_audit_pace_are_rendered() -> None:
    leak = LeakReport(request_id="victim-0000000a", client_request_id="victim",
                      cause=LeakCause.FINISHED_REQUEST, path=LeakPath.ABORT, blocks=3,
                      evidence=Evidence.ONLINE)
    sweep = OnlineSweepReport(sweep_steps=9, sweep_seconds=0.011, audit_seconds=0.0001,
                              budget_fraction=0.005, detection_latency_steps=27,
                              detection_latency_seconds=0.033, delayed_free_bound_seconds=30.0)
    r = report(5).model_copy(update={
        "drained": False, "evidence": Evidence.ONLINE, "verdict": Verdict.LEAK,
        "leaks": [leak], "online": sweep, "explanation": "Online audit under load: ..."})
    online = OnlineState(budget_fraction=0.005, sweeps_total=420, audit_seconds_total=0.04,
                         last_sweep_steps=9, last_sweep_seconds=0.011,
                         detection_latency_steps=27, detection_latency_seconds=0.033)
    text = render_state(state([r]).model_copy(update={"online": online}))
    assert "online audit #5" in text and "verdict: LEAK" in text
    assert "online audit: 420 sweeps, the last 9 steps (0.01 s); detection within 27 steps" in text
    assert "victim" in text and "finished_request" in text and "abort" in text


def test_kvguards_own_cost_is_rendered_as_a_share_and_a_ratio_once_metered() -> None:
    from kvguard.transport.state import CostState

    metered = CostState(sample_every_steps=512, window_steps=8, sampled_steps_total=64,
                        self_seconds_total=0.01, scheduler_seconds_total=0.1)
    text = render_state(state([report(1)]).model_copy(update={"cost": metered}))
    assert ("kvguard's own cost: 10.0 % of scheduler time (1.111x), metered over 64 steps "
            "(8 in every 512)") in text
    nothing_yet = metered.model_copy(update={"sampled_steps_total": 0,
                                             "self_seconds_total": 0.0,
                                             "scheduler_seconds_total": 0.0})
    for cost in (nothing_yet, None):
        text = render_state(state([report(1)]).model_copy(update={"cost": cost}))
        assert "own cost" not in text
