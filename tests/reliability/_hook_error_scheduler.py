"""A test-side scheduler for server mode: kvguard's own finish hook raises N times.

Not a fault in the engine: after kvguard has attached, its ledger's finish event is
monkeypatched to raise for the first ``KVGUARD_TEST_HOOK_ERRORS`` finishes, to prove that
kvguard contains its own failures (and logs them without prompt content) in a real
server's EngineCore. Load with ``--scheduler-cls _hook_error_scheduler.HookErrorScheduler``
and this directory on ``PYTHONPATH``. Faults in vLLM's paths still come from
``KVGUARD_FAULTS`` (it subclasses the chaos scheduler).
"""

from __future__ import annotations

import os
from typing import Any

from kvguard.chaos.faults.scheduler import ChaosScheduler
from kvguard.chaos.harness import fail_finish_events
from kvguard.vllm_plugin.guard import guard_of


class HookErrorScheduler(ChaosScheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        guard = guard_of(self)
        times = int(os.environ.get("KVGUARD_TEST_HOOK_ERRORS", "0"))
        if guard is not None and times:
            fail_finish_events(guard.ledger, times)
