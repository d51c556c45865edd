"""Faults stay off unless both keys are set; a plan says what it injected."""

from __future__ import annotations

import pytest

from kvguard.chaos.faults import Fault, FaultPlan
from kvguard.errors import ConfigError


def test_a_fault_spec_without_the_second_key_is_refused() -> None:
    with pytest.raises(ConfigError, match="KVGUARD_ALLOW_FAULTS=1"):
        FaultPlan.parse("skip_free_on_abort=1", allowed=False)
    assert not FaultPlan.parse("", allowed=False)  # no spec: nothing armed, no error


def test_an_unknown_fault_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="preemption_skips_free"):
        FaultPlan.parse("skip_the_free=1", allowed=True)


def test_a_plan_counts_its_firings_and_stops_when_spent() -> None:
    plan = FaultPlan.parse("refcount_bump=2,prefix_hit_extra_ref", allowed=True)
    assert plan.fire(Fault.REFCOUNT_BUMP, "r1") and plan.fire(Fault.REFCOUNT_BUMP, "r2")
    assert not plan.fire(Fault.REFCOUNT_BUMP, "r3")
    assert plan.times_fired(Fault.REFCOUNT_BUMP) == 2
    assert plan.enabled == ["refcount_bump (fired 2 of 2)", "prefix_hit_extra_ref (fired 0 of 1)"]
    assert plan.fired == [(Fault.REFCOUNT_BUMP, "r1"), (Fault.REFCOUNT_BUMP, "r2")]
