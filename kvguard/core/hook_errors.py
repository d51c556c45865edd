"""``HookErrors``: failures inside kvguard's code on the engine's thread, counted and logged once.

Containment is kvguard's first rule inside an engine: an exception in a hook body is
recorded here (per hook label, ``kvguard_hook_errors_total``) and the engine's own call
proceeds. A failure in a hook that feeds the ledger may leave it short of events; the
session reads :attr:`HookErrors.ledger_errors` to distrust its records until they are
rebuilt.
"""

from __future__ import annotations

import logging
from collections import Counter

log = logging.getLogger("kvguard")


class HookErrors:
    """Failures inside kvguard hook code: counted per hook, logged once per hook."""

    LEDGER_SAFE = frozenset({"publish", "attribution", "update_from_output", "schedule",
                             "finish_requests", "transfers", "checkpoint", "cost_meter",
                             "idle_wake", "idle", "kv_events", "tracing", "offload",
                             "wedge"})
    """Hooks whose failure cannot leave the ledger short of events."""

    def __init__(self) -> None:
        self.by_hook: Counter[str] = Counter()
        self.ledger_errors = 0
        """Failures in hooks that feed the ledger (its records may now be incomplete)."""

    @property
    def total(self) -> int:
        return sum(self.by_hook.values())

    def record(self, hook: str, exc: BaseException) -> None:
        first = hook not in self.by_hook
        self.by_hook[hook] += 1
        if hook not in self.LEDGER_SAFE:
            self.ledger_errors += 1
        if first:
            log.error("kvguard hook %s failed (%s: %s); the engine continues, the error is "
                      "counted in kvguard_hook_errors_total and not logged again for this hook",
                      hook, type(exc).__name__, exc, exc_info=exc)
