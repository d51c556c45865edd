"""kvguard's tracing without a server: the W3C context, the bounded hand-over to the export
thread, the spans a session emits and how they are built. No network: the exporter is
OpenTelemetry's in-memory one where a real OTLP span is needed (a real trace store is in
test_traces_phoenix.py)."""

from __future__ import annotations

import threading
import time

import pytest
from _pool import Harness, RefAdapter
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvguard import (
    ConfigError,
    RequestTracer,
    SpanQueue,
    SpanRecord,
    TraceContext,
    TraceIdentity,
    TracingSettings,
    parse_traceparent,
    tracing_settings,
)
from kvguard.config import KvguardConfig
from kvguard.core.session import GuardSession
from kvguard.core.state import EngineState
from kvguard.core.transfers import TransferLog, TransferOutcome, TransferRole
from kvguard.core.types import Verdict
from kvguard.tracing.context import TraceContexts, context_of
from kvguard.tracing.otlp import OtlpExport

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
HEADER = f"00-{TRACE}-{PARENT}-01"
CTX = TraceContext(int(TRACE, 16), int(PARENT, 16), 1)


# ------------------------------------------------------------------ W3C context
def test_a_sampled_traceparent_is_read_and_nothing_else_is_kept() -> None:
    ctx = context_of({"traceparent": HEADER, "tracestate": "congo=t61rcWkgMzE",
                      "baggage": "user=alice", "authorization": "Bearer x"})
    assert ctx == TraceContext(int(TRACE, 16), int(PARENT, 16), 1, "congo=t61rcWkgMzE")
    assert ctx is not None and ctx.trace_id_hex == TRACE
    assert set(TraceContext.__slots__) == {"trace_id", "span_id", "flags", "tracestate"}


@pytest.mark.parametrize("header", [
    f"00-{TRACE}-{PARENT}-00",              # not sampled: nothing would be exported
    f"00-{'0' * 32}-{PARENT}-01",            # all-zero trace id
    f"00-{TRACE}-{'0' * 16}-01",             # all-zero span id
    f"ff-{TRACE}-{PARENT}-01",               # forbidden version
    f"00-{TRACE[:-1]}-{PARENT}-01",          # short
    "garbage",
])
def test_an_unusable_traceparent_is_no_context(header: str) -> None:
    assert parse_traceparent(header) is None


def test_an_oversized_tracestate_is_dropped_and_the_context_kept() -> None:
    ctx = parse_traceparent(HEADER, "k=" + "v" * 600)
    assert ctx is not None and ctx.tracestate is None


def test_the_context_map_is_bounded_and_counts_what_it_dropped() -> None:
    m = TraceContexts(max_contexts=3)
    for i in range(5):
        m.put(f"r{i}", CTX)
    assert len(m) == 3 and m.evicted_total == 2
    assert m.request_ids() == ["r2", "r3", "r4"] and m.get("r0") is None


# ------------------------------------------------------------------ settings
def test_settings_follow_vllms_flag_then_the_otel_environment() -> None:
    assert tracing_settings(None, {}) is None  # off: nothing configured
    s = tracing_settings("http://a:4318/v1/traces", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "x"})
    assert s == TracingSettings("http://a:4318/v1/traces", "grpc", "kvguard")  # vLLM's default
    s = tracing_settings(None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://b/v1/traces",
                                "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                                "OTEL_SERVICE_NAME": "svc"})
    assert s == TracingSettings("http://b/v1/traces", "http/protobuf", "svc")
    s = tracing_settings(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert s is not None and s.endpoint is None  # the exporter appends /v1/traces itself
    assert tracing_settings("http://a", {"OTEL_SDK_DISABLED": "true"}) is None
    with pytest.raises(ConfigError):
        tracing_settings("http://a", {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})


# ------------------------------------------------------------------ the queue
def _record(i: int = 0) -> SpanRecord:
    return SpanRecord("kvguard.leak", CTX, i, i + 1, {"i": i})


def test_a_full_queue_drops_and_counts_and_the_engine_thread_never_waits() -> None:
    release = threading.Event()
    exported: list[SpanRecord] = []

    def slow_export(batch: list[SpanRecord]) -> bool:
        release.wait(30)  # a backend that does not answer
        exported.extend(batch)
        return True

    q = SpanQueue(slow_export, maxsize=8, batch=4)
    try:
        q.offer(_record(-1))
        deadline = time.monotonic() + 5
        while q.waiting and time.monotonic() < deadline:  # the thread holds it, blocked
            time.sleep(0.01)
        worst = 0.0
        for i in range(1000):
            t = time.perf_counter()
            q.offer(_record(i))
            worst = max(worst, time.perf_counter() - t)
        assert q.queued_total == 1 + 8 and q.dropped_total == 1000 - 8
        assert q.offered_total == 1001
        assert worst < 0.05, f"an offer took {worst * 1e3:.1f} ms"  # never waits for export
        release.set()
        deadline = time.monotonic() + 10
        while q.exported_total < q.queued_total and time.monotonic() < deadline:
            time.sleep(0.01)
        assert q.exported_total == 9 and q.failed_total == 0
        assert [r.start_ns for r in exported] == [-1, *range(8)]  # first in, first out
    finally:
        release.set()
        q.close()


def test_export_failures_are_counted_and_the_thread_goes_on() -> None:
    calls: list[int] = []

    def flaky(batch: list[SpanRecord]) -> bool:
        calls.append(len(batch))
        if len(calls) == 1:
            raise ConnectionError("backend down")
        return len(calls) > 2

    q = SpanQueue(flaky, maxsize=16, batch=1)
    try:
        for i in range(3):
            q.offer(_record(i))
        deadline = time.monotonic() + 10
        while q.exported_total + q.failed_total < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert (q.failed_total, q.exported_total) == (2, 1)
    finally:
        q.close()
    assert not q.offer(_record())  # closed: dropped, counted
    assert q.dropped_total == 1


# ------------------------------------------------------------------ the session
class _Collect:
    def __init__(self) -> None:
        self.records: list[SpanRecord] = []

    def __call__(self, batch: list[SpanRecord]) -> bool:
        self.records.extend(batch)
        return True


class _Sink:
    drops = 0

    def __init__(self) -> None:
        self.states: list[EngineState] = []

    def offer(self, state: EngineState) -> None:
        self.states.append(state)

    def close(self) -> None:
        pass


def _traced_session(h: Harness) -> tuple[GuardSession, RequestTracer, _Collect]:
    cfg = KvguardConfig.from_env({}, publish_interval_seconds=0.0, online_audit=False)
    s = GuardSession(RefAdapter(h), cfg, engine="ref0", sink=_Sink())
    h.ledger = s.ledger  # the harness feeds the session's ledger, as the hooks do
    collect = _Collect()
    tracer = RequestTracer(TraceIdentity("svc", "ref0", "tiny", 0), SpanQueue(collect))
    s.tracer = tracer
    return s, tracer, collect


def _wait_exported(tracer: RequestTracer, n: int) -> None:
    deadline = time.monotonic() + 10
    while tracer.spans.exported_total < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert tracer.spans.exported_total == n


def test_a_leak_is_one_span_in_its_request_s_trace_however_often_it_is_seen() -> None:
    h = Harness(64, lazy_claims=True)
    s, tracer, collect = _traced_session(h)
    leaking, clean, untraced = h.admit(), h.admit(), h.admit()
    tracer.admitted(leaking.rid, {"traceparent": HEADER})
    tracer.admitted(clean.rid, {"traceparent": f"00-{'1' * 32}-{PARENT}-01"})
    tracer.admitted(untraced.rid, None)
    for r in (leaking, clean, untraced):
        h.allocate(r, 3, hash_mask=[False] * 3, attributed=True)
    leak = h.skip_free_on_abort(leaking)
    h.drain()
    for r in (clean, untraced):
        s.on_freed(r.rid, h.tick())  # what the engine's free hook says
    assert len(tracer.contexts) == 1  # the clean one was released; the leak holds blocks
    for _ in range(3):  # three drained checkpoints see the same leak
        s.checkpoint_now()
    assert [r.verdict for r in s.reports] == [Verdict.LEAK] * 3
    _wait_exported(tracer, 1)
    [span] = collect.records
    assert span.name == "kvguard.leak" and span.parent == CTX and span.error
    a = span.attributes
    assert a["kvguard.request.id"] == leak.rid and a["kvguard.request.client_id"] == leak.client_id
    assert a["kvguard.leak.blocks"] == len(leak.blocks) == 3
    assert (a["kvguard.leak.cause"], a["kvguard.leak.path"]) == ("finished_request", "abort")
    assert a["service.name"] == "svc" and a["kvguard.engine.name"] == "ref0"
    assert a["kvguard.engine.model_name"] == "tiny" and a["kvguard.engine.index"] == 0
    # The GenAI names vLLM's own span uses: its external id (the client's) and the model.
    assert a["gen_ai.request.id"] == leak.client_id and a["gen_ai.response.model"] == "tiny"
    assert span.start_ns <= span.end_ns
    st = s.state().tracing
    assert st is not None and st.leak_spans_total == 1 and st.spans_exported_total == 1
    assert st.traced_requests == 1 and st.spans_dropped_total == 0
    tracer.close()


def test_transfer_outcomes_and_a_late_read_hazard_are_spans_of_the_prefill_request() -> None:
    tracer = RequestTracer(TraceIdentity("svc", "p0", None, 0, "P-uuid", "kv_producer"),
                           SpanQueue(_Collect()))
    collect = tracer.spans._export
    assert isinstance(collect, _Collect)
    log = TransferLog(connector="NixlConnector", kv_role="kv_producer", kv_engine_id="P-uuid",
                      hold_source="x")
    log.on_ended = lambda rec: tracer.transfer_ended(rec, 4)
    log.on_hazard = lambda hz: tracer.hazard(hz, log.get(hz.request_id))
    tracer.admitted("p1-0a1b2c3d", {"traceparent": HEADER})
    log.started("p1-0a1b2c3d", "p1", TransferRole.PREFILL, 10.0)
    log.ended("p1-0a1b2c3d", TransferOutcome.EXPIRED_UNREAD, 20.0, reads=0)
    tracer.released("p1-0a1b2c3d")  # freed on the lapse: the context moves to the expired
    assert log.read_after_expiry("p1-0a1b2c3d", 25.0) is not None
    _wait_exported(tracer, 2)
    transfer, hazard = collect.records
    assert transfer.name == "kvguard.kv_transfer" and transfer.error
    assert transfer.attributes["kvguard.transfer.outcome"] == "expired_unread"
    assert transfer.attributes["kvguard.transfer.blocks"] == 4
    assert transfer.attributes["kvguard.kv.engine_id"] == "P-uuid"
    assert (transfer.start_ns, transfer.end_ns) == (10 * 10**9, 20 * 10**9)
    assert hazard.name == "kvguard.kv_transfer_hazard" and hazard.parent == CTX
    assert hazard.attributes["kvguard.hazard.kind"] == "freed_before_read"
    for span in (transfer, hazard):  # vLLM's external id; no model name known here
        assert span.attributes["gen_ai.request.id"] == "p1", span.attributes
        assert span.attributes["kvguard.request.id"] == "p1-0a1b2c3d"
        assert "gen_ai.response.model" not in span.attributes
    assert (hazard.start_ns, hazard.end_ns) == (20 * 10**9, 25 * 10**9)
    tracer.close()


def test_the_otlp_span_is_a_child_of_the_incoming_context_with_every_attribute() -> None:
    mem = InMemorySpanExporter()
    export = OtlpExport(TracingSettings("http://unused", "http/protobuf", "svc"), exporter=mem)
    rec = SpanRecord("kvguard.leak", CTX, 1_000, 2_000, {"service.name": "svc", "n": 3}, True)
    assert export([rec])
    [span] = mem.get_finished_spans()
    assert span.context is not None and span.parent is not None
    assert span.context.trace_id == CTX.trace_id and span.parent.span_id == CTX.span_id
    assert span.parent.is_remote and span.name == "kvguard.leak"
    assert (span.start_time, span.end_time) == (1_000, 2_000)
    assert dict(span.attributes or {}) == {"service.name": "svc", "n": 3}
    assert span.status.status_code.name == "ERROR"
    assert span.resource.attributes["service.name"] == "svc"

    class Refusing(InMemorySpanExporter):
        def export(self, spans: object) -> SpanExportResult:  # type: ignore[override]
            return SpanExportResult.FAILURE

    assert not OtlpExport(TracingSettings(None, "http/protobuf", "svc"), exporter=Refusing())([rec])


# ------------------------------------------------------------------ off, and contained
def test_without_an_endpoint_there_is_no_tracer_and_no_tracing_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from kvguard.vllm_plugin.trace_setup import tracer_for_vllm

    for key in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        monkeypatch.delenv(key, raising=False)
    h = Harness(8)
    cfg = KvguardConfig.from_env({}, publish_interval_seconds=0.0, online_audit=False)
    s = GuardSession(RefAdapter(h), cfg, engine="ref0", sink=_Sink())
    sched = SimpleNamespace(vllm_config=SimpleNamespace(
        observability_config=SimpleNamespace(otlp_traces_endpoint=None)))
    assert tracer_for_vllm(sched, s) is None
    assert s.tracer is None and s.state().tracing is None
    threads = {t.name for t in threading.enumerate()}
    assert "kvguard-trace-export" not in threads


class _Broken:
    """A tracer whose every method fails."""

    def released(self, request_id: str) -> None:
        raise RuntimeError("broken")

    def prune(self, tracked: object) -> None:
        raise RuntimeError("broken")

    def report(self, report: object) -> None:
        raise RuntimeError("broken")

    def transfer_ended(self, rec: object, blocks: object) -> None:
        raise RuntimeError("broken")

    def hazard(self, hz: object, rec: object) -> None:
        raise RuntimeError("broken")

    def state(self) -> object:
        raise RuntimeError("broken")

    def close(self) -> None:
        raise RuntimeError("broken")


def test_a_failing_tracer_is_contained_and_never_costs_a_verdict() -> None:
    h = Harness(64, lazy_claims=True)
    cfg = KvguardConfig.from_env({}, publish_interval_seconds=0.0, online_audit=False)
    s = GuardSession(RefAdapter(h), cfg, engine="ref0", sink=_Sink())
    h.ledger = s.ledger
    s.tracer = _Broken()  # type: ignore[assignment]
    r = h.admit()
    h.allocate(r, 2, hash_mask=[False, False], attributed=True)
    h.skip_free_on_abort(r)
    s.on_freed(r.rid, h.tick())
    first, second = s.checkpoint_now(), s.checkpoint_now()
    assert first.verdict is second.verdict is Verdict.LEAK  # not skipped: no ledger error
    assert s.errors.by_hook["tracing"] >= 2 and s.errors.ledger_errors == 0
    assert s.state().tracing is None
    s.close()
