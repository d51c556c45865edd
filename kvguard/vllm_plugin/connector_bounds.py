"""How long a KV connector may legitimately keep a finished request's blocks.

A transfer or offload connector holds a finished request's blocks until its
transfer completes (vLLM's *delayed free*). kvguard calls a hold past a bound
a leak with path ``delayed_free``. The bound comes, in this order, from
``KVGUARD_DELAYED_FREE_BOUND_SECONDS``, from the connector's own timeout where
vLLM exposes one, or from :data:`DEFAULT_BOUND_SECONDS`:

==========================  ===================================================
NixlConnector               ``kv_lease_duration`` (extra config, vLLM default
                            30 s) x 2: the lease plus one heartbeat extension
MooncakeConnector           ``VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`` (480 s)
MoRIIOConnector             its read-abort timeout (3600 s)
anything else               30 s
==========================  ===================================================

A MultiConnector takes the largest bound of its parts.
"""

from __future__ import annotations

import os
from typing import Any

from kvguard.core.engine import HoldBound
from kvguard.vllm_plugin.versions import (
    KV_CONNECTOR,
    KV_CONNECTOR_EXTRA_CONFIG,
    VLLM_KV_TRANSFER_CONFIG,
    read,
)

DEFAULT_BOUND_SECONDS = 30.0
"""When neither the user nor the connector says: a transfer taking longer is suspect."""


def connector_hold_bound(vllm_config: Any) -> HoldBound:
    """The delayed-free bound implied by the engine's KV connector configuration."""
    kv = read(vllm_config, VLLM_KV_TRANSFER_CONFIG)
    name = read(kv, KV_CONNECTOR) if kv is not None else None
    if not name:
        return HoldBound(DEFAULT_BOUND_SECONDS, "default (no KV connector)")
    extra = read(kv, KV_CONNECTOR_EXTRA_CONFIG) or {}
    bounds = [_bound_of(str(name), extra)]
    if name == "MultiConnector":
        for part in extra.get("connectors", ()) or ():
            if isinstance(part, dict) and part.get("kv_connector"):
                bounds.append(_bound_of(str(part["kv_connector"]),
                                        part.get("kv_connector_extra_config") or {}))
    return max(bounds, key=lambda b: b.seconds)


def _bound_of(name: str, extra: Any) -> HoldBound:
    if "Nixl" in name:
        lease = _number(extra.get("kv_lease_duration", 30) if isinstance(extra, dict) else 30)
        if lease is not None:
            return HoldBound(2 * lease, f"{name} kv_lease_duration {lease:g} s x 2")
    if "Mooncake" in name:
        t = _number(os.environ.get("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "480"))
        if t is not None:
            return HoldBound(t, f"{name} VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT {t:g} s")
    if "MoRIIO" in name:
        return HoldBound(3600.0, f"{name} read-abort timeout 3600 s")
    return HoldBound(DEFAULT_BOUND_SECONDS, f"default ({name} exposes no timeout)")


def _number(value: object) -> float | None:
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return v if v > 0 else None
