"""Start an engine's tracing: settings in, a running :class:`RequestTracer` (or None) out."""

from __future__ import annotations

import logging

from kvguard.tracing.config import TracingSettings
from kvguard.tracing.queue import DEFAULT_QUEUE_SIZE, SpanQueue
from kvguard.tracing.records import TraceIdentity
from kvguard.tracing.tracer import RequestTracer

log = logging.getLogger("kvguard")


def start_tracing(settings: TracingSettings, identity: TraceIdentity, *,
                  queue_size: int = DEFAULT_QUEUE_SIZE) -> RequestTracer | None:
    """The tracer of one engine exporting per ``settings``, its export thread started; None
    (with one error logged) when OpenTelemetry is not installed (``kvguard[otel]``)."""
    try:
        from kvguard.tracing.otlp import OtlpExport
        export = OtlpExport(settings)
    except ImportError as exc:
        log.error("kvguard: an OTLP traces endpoint is set (%s) but OpenTelemetry's SDK or "
                  "its %s exporter is not installed (%s): findings are not traced; install "
                  "kvguard[otel]", settings.where, settings.protocol, exc)
        return None
    tracer = RequestTracer(identity, SpanQueue(export, maxsize=queue_size), settings=settings)
    log.info("kvguard traces findings of engine %s to %s (%s)", identity.engine,
             settings.where, settings.protocol)
    return tracer
