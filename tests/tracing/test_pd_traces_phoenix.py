"""One P/D request, one trace: both engines' transfer outcomes in it, in a real trace store.

Two real vLLM servers (prefill and decode, NixlConnector), both started with
``--otlp-traces-endpoint`` pointing at a real Arize Phoenix on loopback, kvguard in each;
the test's request goes to both halves as kvguard's P/D proxy sends it, with a
``traceparent`` the test made.

Ground truth is vLLM's: its own ``llm_request`` span from each server in that trace, and
the ``kv_transfer_params`` the prefill server answered with (its NIXL engine id and its
request id), which each side's ``kvguard.kv_transfer`` span must name.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _pd import WAIT_SECONDS, blocks_in_use, body, first_transfer, post_plain, state, until
from _phoenix import Phoenix, phoenix_server

from kvguard.demo.pd_pair import PdPair, pd_pair
from kvguard.demo.pd_proxy import pd_complete
from kvguard.demo.ports import LOOPBACK, free_loopback_port
from kvguard.demo.tiny_model import make_tiny_model

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

VLLM_SPAN = "llm_request"


@pytest.fixture(scope="module")
def traced_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[PdPair, Phoenix]]:
    tmp = tmp_path_factory.mktemp("pd-traced")
    with phoenix_server(LOOPBACK, free_loopback_port(), tmp / "phoenix",
                        grpc_port=free_loopback_port()) as px:
        env = {"VLLM_PLUGINS": "kvguard", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
               "OTEL_SERVICE_NAME": "kvguard-pd-trace-test"}
        with pd_pair(make_tiny_model(tmp / "model"), tmp / "run", tmp / "logs",
                     prefill_env=env, decode_env=env,
                     engine_extra={"otlp_traces_endpoint": px.otlp_traces_endpoint}) as pair:
            first_transfer(pair)
            yield pair, px


def _transfer_span(spans: list[dict[str, Any]], role: str) -> dict[str, Any]:
    found = [s for s in spans if s["name"] == "kvguard.kv_transfer"
             and s["attributes"]["kvguard.transfer.role"] == role]
    assert len(found) == 1, (role, spans)
    return found[0]


def test_both_engines_transfer_outcomes_are_spans_in_the_request_s_trace(
        traced_pair: tuple[PdPair, Phoenix]) -> None:
    pair, px = traced_pair
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    out = pd_complete(pair.prefill.base_url, pair.decode.base_url, body(pair, "traced"),
                      "traced-1", timeout_seconds=WAIT_SECONDS,
                      trace_headers={"traceparent": f"00-{trace_id}-{parent}-01"})
    assert out.decode is not None and out.decode["usage"]["completion_tokens"] == 8
    # vLLM's own answer: the prefill engine's NIXL id and request id the decode side reads.
    params = out.prefill_params
    until("the prefill side to free its held blocks", lambda: blocks_in_use(pair.prefill) == 0)

    def both_spans() -> list[dict[str, Any]] | None:
        spans = px.spans(trace_id)
        roles = {s["attributes"].get("kvguard.transfer.role") for s in spans
                 if s["name"] == "kvguard.kv_transfer"}
        if {"prefill", "decode"} <= roles and \
                sum(s["name"] == VLLM_SPAN for s in spans) == 2:
            return spans
        post_plain(pair.prefill, f"step-{time.monotonic()}")  # an idle prefill's last news
        return None                                          # comes out with a step
    spans = until("both engines' transfer spans and vLLM's two request spans in the trace",
                  both_spans, 120.0)
    # vLLM's own spans, one per server, children of the caller's span.
    assert [s["parent_id"] for s in spans if s["name"] == VLLM_SPAN] == [parent, parent]
    p_span, d_span = _transfer_span(spans, "prefill"), _transfer_span(spans, "decode")
    assert p_span["parent_id"] == d_span["parent_id"] == parent
    pa, da = p_span["attributes"], d_span["attributes"]
    # Both sides name the transfer as vLLM did: the decode side's remote engine and request
    # are the prefill engine's own NIXL id and request id.
    assert pa["kvguard.kv.engine_id"] == da["kvguard.transfer.remote_engine_id"] \
        == params["remote_engine_id"]
    assert pa["kvguard.request.id"] == da["kvguard.transfer.remote_request_id"] \
        == params["remote_request_id"]
    assert pa["kvguard.kv.role"] == "kv_producer" and da["kvguard.kv.role"] == "kv_consumer"
    assert pa["kvguard.engine.name"] == "prefill" and da["kvguard.engine.name"] == "decode"
    assert "traced-1" in pa["kvguard.request.client_id"]
    assert "traced-1" in da["kvguard.request.client_id"]
    assert da["kvguard.transfer.outcome"] == "received" and d_span["status_code"] != "ERROR"
    # The hold ended by the read, or (a decode stalled past the lease on a loaded machine)
    # by the lease lapsing: then the span says so, with an error status.
    assert pa["kvguard.transfer.outcome"] in ("read", "expired_unread"), pa
    assert (p_span["status_code"] == "ERROR") is (pa["kvguard.transfer.outcome"] != "read")
    for name in ("prefill", "decode"):
        tr = state(pair, name).tracing
        assert tr is not None and tr.spans_dropped_total == 0 and tr.export_failures_total == 0
        assert tr.errors_total == 0 and state(pair, name).hook_errors_total == 0
