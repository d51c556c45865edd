"""The spans kvguard emits, as plain records the engine thread can build cheaply.

A :class:`SpanRecord` is what crosses from the engine thread to the export thread: names,
ids, times and a flat dict of attribute values (str, int, float, bool). Building the
OpenTelemetry span from it happens on the export thread only (:mod:`kvguard.tracing.otlp`).

Span names (the contract a trace query relies on):

=============================  ===============================================================
``kvguard.leak``               one leak finding (once per request, cause and path), from the
                               checkpoint that first found it; from when the request finished
                               to that checkpoint
``kvguard.kv_transfer``        how one P/D KV transfer ended on this engine; from its start to
                               its end
``kvguard.kv_transfer_hazard`` a read reported after the prefill engine freed the blocks on
                               lease expiry (``freed_before_read``); from the free to the read
=============================  ===============================================================

Attributes never carry prompt text or token ids: engine identity, request ids, counts,
causes, paths, outcomes and kvguard's own one-sentence evidence. ``service.name`` is
repeated as a span attribute because some trace stores drop resource attributes.

Beside the ``kvguard.*`` attributes, the OpenTelemetry GenAI ones that truly describe the
request, under the names vLLM's own ``llm_request`` span uses (``vllm.tracing``'s
``SpanAttributes``), so that a trace store groups and joins the two by them:

- ``gen_ai.request.id``: vLLM's external request id (``EngineCoreRequest.external_req_id``,
  what vLLM's span carries): the client-facing id, which kvguard gets back from the
  engine's internal id by dropping vLLM's 8-hex suffix (``client_request_id``);
- ``gen_ai.response.model``: the engine's served model name (vLLM's ``model_name`` metric
  label: the first ``--served-model-name``; a LoRA request's adapter name is not known).

Nothing about tokens, prompts or sampling: kvguard's spans are not model calls, so neither
``gen_ai.operation.name`` nor ``gen_ai.usage.*`` applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from kvguard.core.report import CheckpointReport, LeakReport
from kvguard.core.transfers import TransferHazard, TransferOutcome, TransferRecord
from kvguard.tracing.context import TraceContext

AttrValue = str | int | float | bool
"""An OpenTelemetry attribute value kvguard uses (no sequences)."""

LEAK_SPAN: Final = "kvguard.leak"
TRANSFER_SPAN: Final = "kvguard.kv_transfer"
HAZARD_SPAN: Final = "kvguard.kv_transfer_hazard"
GEN_AI_REQUEST_ID: Final = "gen_ai.request.id"
"""vLLM's ``SpanAttributes.GEN_AI_REQUEST_ID`` (a vLLM extension of the GenAI conventions)."""
GEN_AI_RESPONSE_MODEL: Final = "gen_ai.response.model"
"""The GenAI conventions' model that served the request (``SpanAttributes`` names it too)."""
DEFAULT_SERVICE_NAME: Final = "kvguard"
"""``service.name`` when ``OTEL_SERVICE_NAME`` is unset."""

_TRANSFER_TROUBLE: Final = frozenset({
    TransferOutcome.EXPIRED_UNREAD, TransferOutcome.EXPIRED_PARTLY_READ,
    TransferOutcome.FAILED, TransferOutcome.ABORTED_WAITING})
"""Transfer outcomes whose span gets an error status (the KV did not go where it should)."""


@dataclass(frozen=True, slots=True)
class TraceIdentity:
    """Which engine emits the spans: the same on every span of one engine."""

    service_name: str
    engine: str
    """kvguard's engine name (the state file's, the sidecar's ``engine_name``)."""
    model_name: str | None = None
    engine_index: int = 0
    """vLLM's engine index (data-parallel rank): its metrics' ``engine`` label."""
    kv_engine_id: str | None = None
    """The KV connector's engine id (P/D): what the other side's ``remote_engine_id`` names."""
    kv_role: str | None = None

    def attributes(self) -> dict[str, AttrValue]:
        attrs: dict[str, AttrValue] = {"service.name": self.service_name,
                                       "kvguard.engine.name": self.engine,
                                       "kvguard.engine.index": self.engine_index}
        if self.model_name is not None:
            attrs["kvguard.engine.model_name"] = self.model_name
            attrs[GEN_AI_RESPONSE_MODEL] = self.model_name
        if self.kv_engine_id is not None:
            attrs["kvguard.kv.engine_id"] = self.kv_engine_id
        if self.kv_role is not None:
            attrs["kvguard.kv.role"] = self.kv_role
        return attrs


@dataclass(frozen=True, slots=True)
class SpanRecord:
    """One span to export. Times are Unix nanoseconds; ``start_ns <= end_ns``."""

    name: str
    parent: TraceContext
    start_ns: int
    end_ns: int
    attributes: dict[str, AttrValue] = field(default_factory=dict)
    error: bool = False
    """Give the span an error status (a leak, a hazard, a transfer that did not land)."""


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _span(name: str, parent: TraceContext, start: float, end: float,
          attrs: dict[str, AttrValue], *, error: bool) -> SpanRecord:
    start_ns, end_ns = _ns(start), _ns(end)
    return SpanRecord(name, parent, min(start_ns, end_ns), end_ns, attrs, error)


def leak_span(parent: TraceContext, identity: dict[str, AttrValue], report: CheckpointReport,
              leak: LeakReport) -> SpanRecord:
    """The span of one leak finding of ``report``."""
    attrs = dict(identity)
    attrs.update({
        "kvguard.verdict": report.verdict.value,
        "kvguard.checkpoint.id": report.checkpoint_id,
        "kvguard.checkpoint.epoch": report.epoch,
        "kvguard.evidence": leak.evidence.value,
        "kvguard.leak.cause": leak.cause.value,
        "kvguard.leak.path": leak.path.value,
        "kvguard.leak.blocks": leak.blocks,
        "kvguard.leak.shared_blocks": leak.shared_blocks,
        "kvguard.report.leaked_blocks": report.leaked_blocks,
    })
    if leak.request_id is not None:
        attrs["kvguard.request.id"] = leak.request_id
    if leak.client_request_id is not None:
        attrs["kvguard.request.client_id"] = leak.client_request_id
        attrs[GEN_AI_REQUEST_ID] = leak.client_request_id
    if leak.finish_reason is not None:
        attrs["kvguard.leak.finish_reason"] = leak.finish_reason.value
    if leak.held_for_seconds is not None:
        attrs["kvguard.leak.held_for_seconds"] = leak.held_for_seconds
    if report.pool is not None:
        attrs["kvguard.pool.capacity"] = report.pool.capacity
    if leak.detail:
        attrs["kvguard.detail"] = leak.detail
    held = leak.held_for_seconds or 0.0
    return _span(LEAK_SPAN, parent, report.taken_at - held, report.taken_at, attrs, error=True)


def transfer_span(parent: TraceContext, identity: dict[str, AttrValue], rec: TransferRecord,
                  blocks: int | None) -> SpanRecord:
    """The span of one ended transfer (``blocks``: the request's blocks when it ended, by
    kvguard's ledger; None when unknown)."""
    attrs = dict(identity)
    attrs.update({
        "kvguard.request.id": rec.request_id,
        "kvguard.request.client_id": rec.client_request_id,
        GEN_AI_REQUEST_ID: rec.client_request_id,
        "kvguard.transfer.role": rec.role.value,
        "kvguard.transfer.outcome": rec.outcome.value,
    })
    if rec.remote_engine_id is not None:
        attrs["kvguard.transfer.remote_engine_id"] = rec.remote_engine_id
    if rec.remote_request_id is not None:
        attrs["kvguard.transfer.remote_request_id"] = rec.remote_request_id
    if rec.reads is not None:
        attrs["kvguard.transfer.reads"] = rec.reads
    if rec.hold_deadline is not None:
        attrs["kvguard.transfer.hold_deadline"] = rec.hold_deadline
    if blocks is not None:
        attrs["kvguard.transfer.blocks"] = blocks
    end = rec.ended_at if rec.ended_at is not None else rec.started_at
    return _span(TRANSFER_SPAN, parent, rec.started_at, end, attrs,
                 error=rec.outcome in _TRANSFER_TROUBLE)


def hazard_span(parent: TraceContext, identity: dict[str, AttrValue], hz: TransferHazard,
                rec: TransferRecord | None) -> SpanRecord:
    """The span of one transfer hazard (``rec``: the transfer it happened to, if kept)."""
    attrs = dict(identity)
    attrs.update({
        "kvguard.request.id": hz.request_id,
        "kvguard.request.client_id": hz.client_request_id,
        GEN_AI_REQUEST_ID: hz.client_request_id,
        "kvguard.hazard.kind": hz.kind.value,
        "kvguard.detail": hz.detail,
    })
    if rec is not None:
        attrs["kvguard.transfer.role"] = rec.role.value
        attrs["kvguard.transfer.outcome"] = rec.outcome.value
        if rec.reads is not None:
            attrs["kvguard.transfer.reads"] = rec.reads
    start = hz.freed_at if hz.freed_at is not None else hz.read_at
    return _span(HAZARD_SPAN, parent, start, hz.read_at, attrs, error=True)
