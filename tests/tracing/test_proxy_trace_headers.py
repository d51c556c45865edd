"""The P/D proxy forwards the caller's W3C trace context to both halves, and nothing else of
the caller's headers (a stand-in HTTP server records what each half received)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from kvguard.demo.pd_proxy import create_proxy
from kvguard.demo.ports import LOOPBACK, free_loopback_port

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class _Recorder(BaseHTTPRequestHandler):
    seen: ClassVar[list[dict[str, str]]] = []

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length", "0"))
        body = json.loads(self.rfile.read(n))
        type(self).seen.append({k.lower(): v for k, v in self.headers.items()})
        if body.get("kv_transfer_params", {}).get("do_remote_decode"):
            out = {"kv_transfer_params": {"remote_engine_id": "P", "remote_request_id": "p-1"}}
        else:
            out = {"usage": {"completion_tokens": 1}}
        data = json.dumps(out).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def backend() -> Iterator[str]:
    _Recorder.seen = []
    server = ThreadingHTTPServer((LOOPBACK, free_loopback_port()), _Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{LOOPBACK}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_the_proxy_forwards_traceparent_and_tracestate_to_both_halves_only(
        backend: str) -> None:
    from fastapi.testclient import TestClient

    with TestClient(create_proxy(backend, backend)) as client:
        resp = client.post("/v1/completions", json={"model": "m", "prompt": "p"},
                           headers={"X-Request-Id": "r-1", "traceparent": TRACEPARENT,
                                    "tracestate": "k=v", "baggage": "user=alice",
                                    "Authorization": "Bearer secret"})
    assert resp.status_code == 200
    prefill, decode = _Recorder.seen
    for half in (prefill, decode):
        assert half["traceparent"] == TRACEPARENT and half["tracestate"] == "k=v"
        assert half["x-request-id"] == "r-1"
        assert "baggage" not in half and "authorization" not in half


def test_without_a_trace_context_the_proxy_sends_none(backend: str) -> None:
    from fastapi.testclient import TestClient

    with TestClient(create_proxy(backend, backend)) as client:
        assert client.post("/v1/completions", json={"model": "m"}).status_code == 200
    assert all("traceparent" not in h and "tracestate" not in h for h in _Recorder.seen)
