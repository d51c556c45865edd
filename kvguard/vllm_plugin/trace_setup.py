"""Tracing for one vLLM engine, configured as vLLM's own tracing is.

The endpoint is the engine's ``ObservabilityConfig.otlp_traces_endpoint`` (vLLM's
``--otlp-traces-endpoint``, the same flag that makes vLLM keep a request's ``traceparent``),
else the ``OTEL_EXPORTER_OTLP_*`` environment (:mod:`kvguard.tracing.config`). Neither
set: no tracer, and the hooks make no tracing call at all.
"""

from __future__ import annotations

import logging
from typing import Any

from kvguard.core.session import GuardSession
from kvguard.errors import ConfigError
from kvguard.tracing.config import tracing_settings
from kvguard.tracing.records import DEFAULT_SERVICE_NAME, TraceIdentity
from kvguard.tracing.setup import start_tracing
from kvguard.tracing.tracer import RequestTracer
from kvguard.vllm_plugin.versions import (
    OTLP_TRACES_ENDPOINT,
    SCHEDULER_VLLM_CONFIG,
    VLLM_OBSERVABILITY_CONFIG,
    read,
)

log = logging.getLogger("kvguard")


def otlp_traces_endpoint(scheduler: Any) -> str | None:
    """vLLM's ``--otlp-traces-endpoint`` for this engine (None: not set, or unreadable)."""
    obs = read(read(scheduler, SCHEDULER_VLLM_CONFIG), VLLM_OBSERVABILITY_CONFIG)
    endpoint = read(obs, OTLP_TRACES_ENDPOINT)
    return endpoint if isinstance(endpoint, str) and endpoint else None


def tracer_for_vllm(scheduler: Any, session: GuardSession) -> RequestTracer | None:
    """The engine's tracer, its export thread started; None when tracing is off or cannot
    start (one error logged; the engine and the rest of kvguard run on)."""
    try:
        settings = tracing_settings(otlp_traces_endpoint(scheduler),
                                    default_service_name=DEFAULT_SERVICE_NAME)
    except ConfigError as exc:
        log.error("kvguard: findings are not traced: %s", exc)
        return None
    if settings is None:
        return None
    ident = session.identity
    transfers = session.transfers
    identity = TraceIdentity(
        service_name=settings.service_name, engine=session.engine,
        model_name=ident.model_name, engine_index=ident.engine_index,
        kv_engine_id=transfers.kv_engine_id if transfers is not None else None,
        kv_role=transfers.kv_role if transfers is not None else None)
    return start_tracing(settings, identity)
