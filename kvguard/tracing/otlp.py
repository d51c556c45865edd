"""OTLP export of :class:`~kvguard.tracing.records.SpanRecord` batches (export thread only).

Imports OpenTelemetry lazily (the ``kvguard[otel]`` extra: ``opentelemetry-sdk`` and
``opentelemetry-exporter-otlp-proto-http``; ``grpc`` needs
``opentelemetry-exporter-otlp-proto-grpc``, which vLLM installs): kvguard without the extra
imports nothing of it. Spans are built with kvguard's own ``TracerProvider`` (never the
global one, which vLLM may own) whose only processor collects them, and exported in one
call per batch. Each span's parent is the request's remote span context, so it lands in
the request's trace next to vLLM's own ``llm_request`` span.
"""

from __future__ import annotations

import os
from typing import Any

from kvguard.tracing.config import TracingSettings
from kvguard.tracing.records import SpanRecord

EXPORT_TIMEOUT_SECONDS = 10.0
"""One export call's time limit (the export thread's, never the engine's)."""


def otlp_exporter(settings: TracingSettings) -> Any:
    """The OTLP span exporter for ``settings``; raises ImportError without the extra."""
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )
        return GrpcExporter(endpoint=settings.endpoint, insecure=True,
                            timeout=EXPORT_TIMEOUT_SECONDS)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )
    return HttpExporter(endpoint=settings.endpoint, timeout=EXPORT_TIMEOUT_SECONDS)


class OtlpExport:
    """Builds the spans of a batch and exports them: the ``Export`` of a
    :class:`~kvguard.tracing.queue.SpanQueue`. Built on the engine thread at start-up (it
    imports OpenTelemetry then, so a missing extra is known at once); called on the export
    thread only."""

    def __init__(self, settings: TracingSettings, exporter: Any | None = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider

        collected: list[ReadableSpan] = []

        class _Collect(SpanProcessor):
            def on_end(self, span: ReadableSpan) -> None:
                collected.append(span)

        self._collected = collected
        self._exporter = exporter if exporter is not None else otlp_exporter(settings)
        provider = TracerProvider(resource=Resource.create({
            "service.name": settings.service_name, "process.pid": os.getpid()}))
        provider.add_span_processor(_Collect())
        self._tracer = provider.get_tracer("kvguard")

    def __call__(self, batch: list[SpanRecord]) -> bool:
        from opentelemetry import trace
        from opentelemetry.sdk.trace.export import SpanExportResult
        from opentelemetry.trace import (
            NonRecordingSpan,
            SpanContext,
            Status,
            StatusCode,
            TraceFlags,
            TraceState,
        )

        self._collected.clear()
        for rec in batch:
            p = rec.parent
            state = TraceState.from_header([p.tracestate]) if p.tracestate else None
            parent = NonRecordingSpan(SpanContext(p.trace_id, p.span_id, is_remote=True,
                                                  trace_flags=TraceFlags(p.flags),
                                                  trace_state=state))
            span = self._tracer.start_span(rec.name, context=trace.set_span_in_context(parent),
                                           attributes=rec.attributes, start_time=rec.start_ns)
            if rec.error:
                span.set_status(Status(StatusCode.ERROR))
            span.end(end_time=rec.end_ns)
        spans, self._collected[:] = list(self._collected), []
        ok = not spans or self._exporter.export(spans) is SpanExportResult.SUCCESS
        return ok and len(spans) == len(batch)  # a span the sampler dropped is not exported

    def shutdown(self) -> None:
        self._exporter.shutdown()
