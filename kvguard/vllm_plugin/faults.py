"""Opt-in fault injectors that reproduce real leak classes inside the real vLLM.

FOR TESTS AND STAGING ONLY. They make the engine leak KV blocks on purpose.
Two keys must both be set, so that one stray variable cannot enable them:
``KVGUARD_ALLOW_FAULTS=1`` and ``KVGUARD_FAULTS=<spec>``; enabling logs a
warning on every engine start. ``<spec>`` is a comma-separated list of
``name=count`` (how many times the fault fires):

``skip_free_on_abort``    an aborted request's block free is skipped (vllm #29987 class)
``double_free_on_abort``  an aborted request's blocks are freed twice (SGLang #6888 class)
``refcount_bump``         a finishing request's last block gets ``ref_cnt += 1``
                          behind every hook (a copy-on-write/connector bump never released)
``hook_error``            kvguard's own finish hook raises (proves containment)
"""

from __future__ import annotations

import enum
import logging

from kvguard.errors import ConfigError

log = logging.getLogger("kvguard.faults")


class Fault(enum.StrEnum):
    SKIP_FREE_ON_ABORT = "skip_free_on_abort"
    DOUBLE_FREE_ON_ABORT = "double_free_on_abort"
    REFCOUNT_BUMP = "refcount_bump"
    HOOK_ERROR = "hook_error"


class FaultPlan:
    """Remaining firings per fault. Empty (and free to check) when faults are off."""

    def __init__(self, budget: dict[Fault, int] | None = None) -> None:
        self._budget: dict[Fault, int] = dict(budget or {})
        self._armed: dict[Fault, int] = dict(self._budget)

    @classmethod
    def parse(cls, spec: str, *, allowed: bool, quiet: bool = False) -> FaultPlan:
        spec = spec.strip()
        if not spec:
            return cls()
        if not allowed:
            raise ConfigError("KVGUARD_FAULTS", spec,
                              "unset, or KVGUARD_ALLOW_FAULTS=1 as well (faults leak blocks "
                              "on purpose: tests and staging only)")
        budget: dict[Fault, int] = {}
        for part in spec.split(","):
            name, _, count = part.strip().partition("=")
            try:
                fault = Fault(name)
            except ValueError:
                raise ConfigError("KVGUARD_FAULTS", name,
                                  "one of " + ", ".join(f.value for f in Fault)) from None
            try:
                budget[fault] = int(count) if count else 1
            except ValueError:
                raise ConfigError("KVGUARD_FAULTS", part, "name=count with an integer count") \
                    from None
        if not quiet:
            log.warning("KVGUARD FAULT INJECTION ENABLED (%s): this engine will leak or corrupt KV "
                        "blocks on purpose. Never use this in production.", spec)
        return cls(budget)

    @property
    def enabled(self) -> list[str]:
        """Every armed fault with how often it fired: stays visible after it has fired."""
        return [f"{f.value} (fired {n - self._budget.get(f, 0)} of {n})"
                for f, n in self._armed.items() if n > 0]

    def __bool__(self) -> bool:
        return any(n > 0 for n in self._budget.values())

    def fire(self, fault: Fault) -> bool:
        """Consume one firing of ``fault``; false when none is left."""
        n = self._budget.get(fault, 0)
        if n <= 0:
            return False
        self._budget[fault] = n - 1
        log.warning("kvguard fault injected: %s", fault.value)
        return True
