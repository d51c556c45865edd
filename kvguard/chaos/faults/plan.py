"""Which faults to inject and how often: the plan, from code or from two environment keys.

FOR TESTS AND STAGING ONLY: every fault makes the engine leak or corrupt KV blocks on
purpose. A plan only takes effect in an engine built with
:class:`kvguard.chaos.faults.scheduler.ChaosScheduler` (``--scheduler-cls``), and from the
environment only when both ``KVGUARD_ALLOW_FAULTS=1`` and ``KVGUARD_FAULTS=<spec>`` are
set; ``<spec>`` is a comma-separated list of ``name=count`` (how many times the fault
fires; ``name`` alone is once), each optionally ``@marker``: the fault then fires only on
requests whose id contains ``marker`` (the client's id is part of vLLM's, so a test
picks its victims by the ``X-Request-Id`` it sends). Arming a non-empty plan logs a
warning.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping

from kvguard.errors import ConfigError

log = logging.getLogger("kvguard.faults")


class Fault(enum.StrEnum):
    """A real bug class, injected in vLLM's own code path (see the package docstring)."""

    SKIP_FREE_ON_ABORT = "skip_free_on_abort"
    DOUBLE_FREE_ON_ABORT = "double_free_on_abort"
    REFCOUNT_BUMP = "refcount_bump"
    PREEMPTION_SKIPS_FREE = "preemption_skips_free"
    SPEC_ROLLBACK_KEEPS_BLOCKS = "spec_rollback_keeps_blocks"
    PREFIX_HIT_EXTRA_REF = "prefix_hit_extra_ref"
    DEFERRED_FREE_NEVER_RELEASED = "deferred_free_never_released"
    SLIDING_WINDOW_REMOVAL_SKIPS_FREE = "sliding_window_removal_skips_free"
    REMOTE_KV_NEVER_ARRIVES = "remote_kv_never_arrives"
    SEND_COMPLETION_LOST = "send_completion_lost"


class FaultPlan:
    """Remaining firings per fault. Empty (and false) when no fault is armed."""

    def __init__(self, budget: Mapping[Fault, int] | None = None,
                 markers: Mapping[Fault, str] | None = None) -> None:
        self._budget: dict[Fault, int] = dict(budget or {})
        self._markers: dict[Fault, str] = dict(markers or {})
        """Fault -> the substring a victim's request id must contain."""
        self._armed: dict[Fault, int] = dict(self._budget)
        self.fired: list[tuple[Fault, str]] = []
        """(fault, engine-internal request id) per firing, oldest first (tooling only)."""

    @classmethod
    def parse(cls, spec: str, *, allowed: bool) -> FaultPlan:
        """``name=count,...``; raises :class:`ConfigError` unless ``allowed`` (the second key)."""
        spec = spec.strip()
        if not spec:
            return cls()
        if not allowed:
            raise ConfigError("KVGUARD_FAULTS", spec,
                              "unset, or KVGUARD_ALLOW_FAULTS=1 as well (faults leak blocks "
                              "on purpose: tests and staging only)")
        budget: dict[Fault, int] = {}
        markers: dict[Fault, str] = {}
        for part in spec.split(","):
            part, _, marker = part.strip().partition("@")
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
            if marker.strip():
                markers[fault] = marker.strip()
        return cls(budget, markers)

    @property
    def enabled(self) -> list[str]:
        """Every armed fault with how often it fired: stays visible after it has fired."""
        return [f"{f.value} (fired {n - self._budget.get(f, 0)} of {n}"
                + (f", on ids with {self._markers[f]!r})" if f in self._markers else ")")
                for f, n in self._armed.items() if n > 0]

    def __bool__(self) -> bool:
        return any(n > 0 for n in self._budget.values())

    def armed(self, fault: Fault) -> bool:
        """Whether ``fault`` has a firing left (consumes nothing)."""
        return self._budget.get(fault, 0) > 0

    def fire(self, fault: Fault, request_id: str = "") -> bool:
        """Consume one firing of ``fault``; false when none is left."""
        n = self._budget.get(fault, 0)
        if n <= 0:
            return False
        marker = self._markers.get(fault)
        if marker is not None and marker not in request_id:
            return False
        self._budget[fault] = n - 1
        self.fired.append((fault, request_id))
        log.warning("kvguard chaos: fault injected: %s", fault.value)
        return True

    def times_fired(self, fault: Fault) -> int:
        return sum(1 for f, _ in self.fired if f is fault)
