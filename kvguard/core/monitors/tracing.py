"""Request tracing as a monitor: kvguard's findings in the requests' own traces.

Watches: requests kvguard lets go of (their trace context is forgotten), every recorded
report (a span per leak finding of a traced request, once per finding), KV transfers that
end and transfer hazards (a span each, through the transfer log's callbacks).
Adds: the ``tracing`` section of the state (spans queued, exported, failed). Every call
into the tracer is contained under ``tracing``; export runs on the tracer's own thread.
Costs per step: nothing (it acts per freed request and per report).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvguard.core.monitor import BaseMonitor, MonitorHost, StateSection
from kvguard.core.report import CheckpointReport
from kvguard.core.state import TracingState
from kvguard.core.transfers import TransferHazard, TransferLog, TransferRecord
from kvguard.core.types import RequestId


class RequestTraces(Protocol):
    """kvguard's findings in the requests' traces (:class:`kvguard.RequestTracer`): set
    by the engine integration when an OTLP endpoint is configured. Every method runs on the
    engine's thread, never blocks (export happens on another thread) and is contained."""

    def released(self, request_id: str) -> None:
        """kvguard no longer tracks the request: forget its trace context."""

    def prune(self, tracked: Callable[[str], bool]) -> None:
        """Forget the contexts of requests ``tracked`` says are no longer followed."""

    def report(self, report: CheckpointReport) -> None:
        """A report: a span per leak finding of a traced request, once per finding."""

    def transfer_ended(self, rec: TransferRecord, blocks: int | None) -> None:
        """A KV transfer ended (``blocks``: the request's blocks then, by the ledger)."""

    def hazard(self, hz: TransferHazard, rec: TransferRecord | None) -> None:
        """A transfer hazard (``rec``: its transfer, if still kept)."""

    def state(self) -> TracingState: ...

    def close(self) -> None: ...


class RequestTracing(BaseMonitor):
    """Hands kvguard's findings to a :class:`RequestTraces`."""

    name = "tracing"

    def __init__(self, host: MonitorHost, tracer: RequestTraces,
                 transfers: TransferLog | None) -> None:
        self.host = host
        self.tracer = tracer
        self.transfers = transfers
        if transfers is not None:
            transfers.on_ended = self.transfer_ended
            transfers.on_hazard = self.hazard

    def detach(self) -> None:
        """Stop hearing from the transfer log (the tracer was replaced or turned off)."""
        if self.transfers is not None:
            self.transfers.on_ended = None
            self.transfers.on_hazard = None

    def on_request_freed(self, request_id: RequestId, at: float) -> None:
        rec = self.host.ledger.record(request_id)
        if rec is None or not rec.blocks:  # a request still holding blocks may leak
            with self.host.contain(self.name):
                self.tracer.released(request_id)

    def on_report(self, report: CheckpointReport) -> None:
        with self.host.contain(self.name):
            self.tracer.report(report)
            if report.drained:  # forget contexts of requests the ledger let go of
                records = self.host.ledger.records_map()
                self.tracer.prune(lambda rid: RequestId(rid) in records)

    def transfer_ended(self, rec: TransferRecord) -> None:
        """The transfer log closed ``rec``: its span, when the request is traced."""
        with self.host.contain(self.name):
            held = self.host.ledger.record(RequestId(rec.request_id))
            self.tracer.transfer_ended(rec, held.num_blocks if held is not None else None)

    def hazard(self, hz: TransferHazard) -> None:
        if self.transfers is None:
            return
        with self.host.contain(self.name):
            self.tracer.hazard(hz, self.transfers.get(hz.request_id))

    def state_section(self) -> StateSection:
        try:
            return {"tracing": self.tracer.state()}
        except Exception as exc:
            self.host.errors.record(self.name, exc)
            return {}

    def close(self) -> None:
        with self.host.contain(self.name):
            self.tracer.close()
