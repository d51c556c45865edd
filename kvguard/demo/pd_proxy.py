"""A small P/D router: prefill on one vLLM server, decode on another (tests and the demo).

It routes a completion as vLLM's own ``toy_proxy_server.py`` does: the prefill server
gets the request with ``max_tokens: 1`` and ``kv_transfer_params`` asking for a remote
decode, and answers with the ``kv_transfer_params`` that name its engine, blocks and
request id; the decode server then gets the original request with those parameters and
pulls the KV (NixlConnector, pull mode). Both calls carry the same ``X-Request-Id`` and
the caller's W3C trace context (``traceparent``, ``tracestate``), so that both engines'
spans, vLLM's and kvguard's, land in the caller's trace (servers run with
``--otlp-traces-endpoint``).

Not a production router (no load balancing, retries or streaming): a fleet runs its
own (vLLM's router, llm-d, Dynamo). :func:`create_proxy` wraps :func:`pd_complete` in a
FastAPI app with one route, ``POST /v1/completions``.
"""

# No ``from __future__ import annotations``: FastAPI reads the route's annotations at run
# time, and ``Request`` is imported inside create_proxy (FastAPI stays optional here).
import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TRACE_HEADERS = ("traceparent", "tracestate")
"""The W3C trace context headers the proxy forwards (nothing else of the caller's)."""

REMOTE_DECODE_PARAMS: dict[str, Any] = {
    "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
    "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""What a prefill request carries: "compute the KV, keep it for a remote decode"."""


@dataclass(frozen=True, slots=True)
class PdResult:
    prefill_params: dict[str, Any]
    """The prefill server's ``kv_transfer_params`` (``remote_engine_id``,
    ``remote_request_id``, ``remote_block_ids``...)."""
    decode: dict[str, Any] | None
    """The decode server's completion (``None`` when no decode was sent)."""


def _post(base_url: str, body: dict[str, Any], request_id: str,
          timeout_seconds: float, trace_headers: Mapping[str, str] | None = None,
          ) -> dict[str, Any]:
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    for name in TRACE_HEADERS:
        if trace_headers and trace_headers.get(name):
            headers[name] = trace_headers[name]
    req = urllib.request.Request(
        base_url + "/v1/completions", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(req, timeout=timeout_seconds) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def prefill(prefill_url: str, body: dict[str, Any], request_id: str, *,
            timeout_seconds: float = 120.0,
            trace_headers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run the prefill half; returns the ``kv_transfer_params`` for the decode half."""
    p_body = {**body, "max_tokens": 1, "stream": False,
              "kv_transfer_params": dict(REMOTE_DECODE_PARAMS)}
    p_body.pop("max_completion_tokens", None)
    out = _post(prefill_url, p_body, request_id, timeout_seconds, trace_headers)
    params = out.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise RuntimeError(f"the prefill server at {prefill_url} returned no "
                           "kv_transfer_params: is it started with a kv_producer "
                           "--kv-transfer-config?")
    return params


def decode(decode_url: str, body: dict[str, Any], params: dict[str, Any], request_id: str,
           *, timeout_seconds: float = 120.0,
           trace_headers: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run the decode half with the prefill server's ``kv_transfer_params``. A
    ``timeout_seconds`` that runs out closes the connection: vLLM aborts the request."""
    return _post(decode_url, {**body, "kv_transfer_params": params}, request_id,
                 timeout_seconds, trace_headers)


def pd_complete(prefill_url: str, decode_url: str, body: dict[str, Any], request_id: str,
                *, timeout_seconds: float = 120.0,
                trace_headers: Mapping[str, str] | None = None) -> PdResult:
    """Prefill, then decode: one completion across the pair (both halves carry
    ``trace_headers``' ``traceparent`` and ``tracestate``)."""
    params = prefill(prefill_url, body, request_id, timeout_seconds=timeout_seconds,
                     trace_headers=trace_headers)
    return PdResult(params, decode(decode_url, body, params, request_id,
                                   timeout_seconds=timeout_seconds,
                                   trace_headers=trace_headers))


def decode_abandoned(decode_url: str, body: dict[str, Any], params: dict[str, Any],
                     request_id: str, *, after_seconds: float) -> bool:
    """Send the decode half and hang up after ``after_seconds`` (a client that gives up):
    True when the server had not answered by then (vLLM then aborts the request)."""
    try:
        decode(decode_url, body, params, request_id, timeout_seconds=after_seconds)
    except (TimeoutError, urllib.error.URLError) as exc:
        return isinstance(exc, TimeoutError) or isinstance(
            getattr(exc, "reason", None), TimeoutError)
    return False


def create_proxy(prefill_url: str, decode_url: str) -> Any:
    """A FastAPI app routing ``POST /v1/completions`` across the pair."""
    from fastapi import FastAPI, Header, Request
    from fastapi.concurrency import run_in_threadpool

    app = FastAPI(title="kvguard P/D proxy (tests and demo)")

    @app.post("/v1/completions")
    async def completions(request: Request,
                          x_request_id: str | None = Header(default=None)) -> dict[str, Any]:
        import uuid

        body = await request.json()
        rid = x_request_id or f"pd-{uuid.uuid4().hex[:12]}"
        trace = {n: v for n in TRACE_HEADERS if (v := request.headers.get(n))}
        result = await run_in_threadpool(pd_complete, prefill_url, decode_url, body, rid,
                                         trace_headers=trace)
        assert result.decode is not None
        return result.decode

    return app
