"""``RequestTracer``: the engine side of kvguard's tracing, one per engine.

Fed on the engine's scheduler thread by the session and the hooks: a request's trace
context at admission, its release, each report, each ended transfer and each hazard.
Each call does a dict lookup and, when it has something to say about a traced request,
builds one :class:`~kvguard.tracing.records.SpanRecord` and offers it to the
:class:`~kvguard.tracing.queue.SpanQueue` (never blocks). It never raises into its
caller (failures are counted in ``errors_total``), though its callers contain it anyway.

Invariants: a leak finding is emitted once per (request, cause, path), however many
checkpoints see it again; contexts are kept only for requests kvguard tracks (dropped at
release, or when the ledger has let go of them), at most ``TraceContexts.max_contexts``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Final

from kvguard.core.report import CheckpointReport
from kvguard.core.state import TracingState
from kvguard.core.transfers import TransferHazard, TransferOutcome, TransferRecord
from kvguard.core.types import Verdict
from kvguard.tracing.config import TracingSettings
from kvguard.tracing.context import DEFAULT_MAX_CONTEXTS, TraceContext, TraceContexts, context_of
from kvguard.tracing.queue import SpanQueue
from kvguard.tracing.records import (
    AttrValue,
    TraceIdentity,
    hazard_span,
    leak_span,
    transfer_span,
)

log = logging.getLogger("kvguard")

MAX_EMITTED_FINDINGS: Final = 4096
"""Leak findings remembered as already emitted (oldest forgotten first)."""
MAX_EXPIRED_KEPT: Final = 64
"""Contexts kept past release for transfers that expired unread: a read reported later is
a hazard in that request's trace (as many as a transfer log keeps ended records)."""
_EXPIRED: Final = frozenset({TransferOutcome.EXPIRED_UNREAD,
                             TransferOutcome.EXPIRED_PARTLY_READ})


class RequestTracer:
    """Trace contexts of the requests one engine tracks, and the spans about them."""

    def __init__(self, identity: TraceIdentity, spans: SpanQueue, *,
                 settings: TracingSettings | None = None,
                 max_contexts: int = DEFAULT_MAX_CONTEXTS) -> None:
        self.identity = identity
        self._identity_attrs: dict[str, AttrValue] = identity.attributes()
        self.spans = spans
        self.settings = settings
        self.contexts = TraceContexts(max_contexts)
        self._expired: OrderedDict[str, TraceContext] = OrderedDict()
        """Released requests whose transfer expired unread (a late read may follow)."""
        self._emitted: OrderedDict[tuple[str, str, str], None] = OrderedDict()
        self.leak_spans_total = 0
        self.transfer_spans_total = 0
        self.hazard_spans_total = 0
        self.errors_total = 0

    def set_kv_identity(self, kv_engine_id: str | None, kv_role: str | None) -> None:
        """The KV connector's engine id and role, once known (P/D)."""
        ident = self.identity
        self.identity = TraceIdentity(ident.service_name, ident.engine, ident.model_name,
                                      ident.engine_index, kv_engine_id, kv_role)
        self._identity_attrs = self.identity.attributes()

    def _failed(self, what: str, exc: Exception) -> None:
        if not self.errors_total:
            log.error("kvguard tracing: %s failed (%s: %s); the engine continues, failures "
                      "are counted in its state", what, type(exc).__name__, exc, exc_info=exc)
        self.errors_total += 1

    # ------------------------------------------------------------ lifecycle
    def admitted(self, request_id: str, trace_headers: Mapping[str, str] | None) -> None:
        """A request entered; ``trace_headers``: vLLM's ``Request.trace_headers``."""
        if not trace_headers:
            return
        try:
            ctx = context_of(trace_headers)
            if ctx is not None:
                self.contexts.put(request_id, ctx)
        except Exception as exc:
            self._failed("reading a trace context", exc)

    def released(self, request_id: str) -> None:
        """kvguard no longer tracks the request (its blocks are all back)."""
        self.contexts.pop(request_id)

    def prune(self, tracked: Callable[[str], bool]) -> None:
        """Drop the contexts of requests ``tracked`` says kvguard no longer follows (at a
        checkpoint; the map's size bounds the work)."""
        try:
            for rid in self.contexts.request_ids():
                if not tracked(rid):
                    self.contexts.pop(rid)
        except Exception as exc:
            self._failed("pruning trace contexts", exc)

    # ---------------------------------------------------------------- spans
    def report(self, report: CheckpointReport) -> None:
        """A checkpoint report: a span per leak finding of a traced request, once each."""
        if report.verdict is not Verdict.LEAK:
            return
        try:
            for leak in report.leaks:
                ctx = self.contexts.get(leak.request_id)
                if ctx is None or leak.request_id is None:
                    continue
                key = (leak.request_id, leak.cause.value, leak.path.value)
                if key in self._emitted:
                    continue
                self._emitted[key] = None
                while len(self._emitted) > MAX_EMITTED_FINDINGS:
                    self._emitted.popitem(last=False)
                if self.spans.offer(leak_span(ctx, self._identity_attrs, report, leak)):
                    self.leak_spans_total += 1
        except Exception as exc:
            self._failed("a leak span", exc)

    def transfer_ended(self, rec: TransferRecord, blocks: int | None) -> None:
        """A transfer ended on this engine (``blocks``: the request's, then)."""
        try:
            ctx = self.contexts.get(rec.request_id)
            if ctx is None:
                return
            if rec.outcome in _EXPIRED:
                self._expired[rec.request_id] = ctx
                while len(self._expired) > MAX_EXPIRED_KEPT:
                    self._expired.popitem(last=False)
            if self.spans.offer(transfer_span(ctx, self._identity_attrs, rec, blocks)):
                self.transfer_spans_total += 1
        except Exception as exc:
            self._failed("a transfer span", exc)

    def hazard(self, hz: TransferHazard, rec: TransferRecord | None) -> None:
        """A transfer hazard on this engine (``rec``: the transfer, if still kept)."""
        try:
            ctx = self._expired.pop(hz.request_id, None) or self.contexts.get(hz.request_id)
            if ctx is None:
                return
            if self.spans.offer(hazard_span(ctx, self._identity_attrs, hz, rec)):
                self.hazard_spans_total += 1
        except Exception as exc:
            self._failed("a hazard span", exc)

    # ---------------------------------------------------------------- state
    def state(self) -> TracingState:
        s = self.spans
        return TracingState(
            endpoint=self.settings.where if self.settings is not None else None,
            protocol=self.settings.protocol if self.settings is not None else None,
            service_name=self.identity.service_name,
            traced_requests=len(self.contexts),
            contexts_evicted_total=self.contexts.evicted_total,
            leak_spans_total=self.leak_spans_total,
            transfer_spans_total=self.transfer_spans_total,
            hazard_spans_total=self.hazard_spans_total,
            queue_capacity=s.maxsize,
            spans_queued_total=s.queued_total,
            spans_dropped_total=s.dropped_total,
            spans_exported_total=s.exported_total,
            export_failures_total=s.failed_total,
            errors_total=self.errors_total)

    def close(self) -> None:
        self.spans.close()
