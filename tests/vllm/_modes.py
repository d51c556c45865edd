"""Both scheduling modes for a test module's real engines."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvguard.chaos.faults import SCHEDULER_CLS, scheduler_cls_for
from kvguard.chaos.harness import EngineHarness as Harness
from kvguard.testing.scheduling import Scheduling


def in_mode(make: Callable[..., Harness], scheduling: Scheduling) -> Callable[..., Harness]:
    """``make`` with every engine built in ``scheduling`` mode (the chaos scheduler as its
    async twin): a module overrides its ``engines`` fixture with this to run both modes."""
    def made(**overrides: Any) -> Harness:
        if overrides.get("scheduler_cls") == SCHEDULER_CLS:
            overrides["scheduler_cls"] = scheduler_cls_for(scheduling)
        return make(scheduling=scheduling, **overrides)
    return made
