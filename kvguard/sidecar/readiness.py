"""``/v1/ready``: whether the pod should receive traffic (a Kubernetes readinessProbe).

Not ready (503, with the reason) exactly when:

* no engine has published its state yet (the engine is starting), or
* an engine's state is stale: kvguard stopped hearing from it (its process died or
  hangs; the publisher writes a heartbeat every few seconds even when idle), or
* an engine is wedged (:mod:`kvguard.core.wedge`): requests wait behind blocks that dead
  owners hold, and it will not recover on its own.

A saturated cache, a busy pool, a long queue or a leak that does not (yet) block
admission are ready (200): readiness takes a pod out of rotation only when sending it
traffic cannot succeed. Restarting is a liveness decision, left to the operator
(docs/wedge.md).
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict, Field

from kvguard.sidecar.store import EngineStore


class EngineReadiness(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    engine: str
    ready: bool
    reason: str | None = Field(default=None, description="Why not ready (None: ready).")


class Readiness(BaseModel):
    """The body of ``/v1/ready`` (200 and 503 alike)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    ready: bool
    reason: str | None = Field(default=None, description="The first engine's reason when "
                                                         "not ready.")
    engines: list[EngineReadiness] = Field(default_factory=list)


def readiness(store: EngineStore, now: float | None = None) -> Readiness:
    """Judge every engine the sidecar knows; ready only when all are."""
    now = time.time() if now is None else now
    if not store.engines:
        return Readiness(ready=False, reason="no engine has published its state yet "
                                             f"(run dir {store.run_dir})")
    out: list[EngineReadiness] = []
    for name, view in sorted(store.engines.items()):
        s = view.state
        reason: str | None = None
        if not store.is_up(view, now):
            reason = (f"engine {name}: no state for {now - s.updated_at:.0f} s (more than "
                      f"{store.stale_after_seconds:g} s): kvguard stopped hearing from it")
        elif s.wedge is not None and s.wedge.wedged and s.wedge.last is not None:
            reason = f"engine {name}: {s.wedge.last.explanation}"
        out.append(EngineReadiness(engine=name, ready=reason is None, reason=reason))
    first = next((e.reason for e in out if e.reason is not None), None)
    return Readiness(ready=first is None, reason=first, engines=out)
