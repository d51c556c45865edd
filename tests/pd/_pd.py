"""Shared by the P/D tests: two real vLLM servers, read the way an operator reads them."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from pd_pair import PdPair
from prometheus_client.parser import text_string_to_metric_families

from kvguard.core.state import EngineState
from kvguard.testing.hang import raise_if_hung
from kvguard.transport.reader import read_run_dir

WAIT_SECONDS = 180.0
"""The longest any single wait may take: a loaded 2-core machine has stalled a CPU
worker for 60-100 s ("No available shared memory broadcast block")."""

PROMPT_WORDS = 150
"""A prompt of 5 blocks (32 tokens each) with the tiny model's tokenizer."""


def prompt(tag: str) -> str:
    return f"{tag} " + " ".join(f"w{i}" for i in range(PROMPT_WORDS))


def body(pair: PdPair, tag: str, max_tokens: int = 8) -> dict[str, Any]:
    return {"model": pair.prefill.spec.served_model_name, "prompt": prompt(tag),
            "max_tokens": max_tokens, "temperature": 0.0}


def vllm_series(url: str, name: str) -> float:
    """A vLLM series summed over its labels (a counter's ``_total`` sample included)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return float(sum(s.value for fam in text_string_to_metric_families(text)
                     for s in fam.samples if s.name in (name, name + "_total")))


def blocks_in_use(server: Any) -> int:
    """vLLM's own count of blocks with a reference: usage x usable capacity."""
    usable: int = server.spec.num_gpu_blocks_override - 1
    return round(vllm_series(server.base_url, "vllm:kv_cache_usage_perc") * usable)


def post_plain(server: Any, tag: str) -> None:
    """One ordinary completion (no transfer): makes an idle engine step."""
    body = {"model": server.spec.served_model_name, "prompt": prompt(tag), "max_tokens": 2}
    req = urllib.request.Request(server.base_url + "/v1/completions",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=WAIT_SECONDS) as resp:
        assert resp.status == 200


def state(pair: PdPair, engine: str) -> EngineState:
    for s in read_run_dir(pair.run_dir).states:
        if s.engine == engine:
            return s
    raise AssertionError(f"no state of {engine} in {pair.run_dir}")


def until(what: str, cond: Callable[[], Any], timeout: float = WAIT_SECONDS) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        raise_if_hung(what)  # a server the hang watch stopped never answers again
        try:
            v = cond()
        except (TimeoutError, urllib.error.URLError):  # a stalled server: ask again
            v = None
        if v:
            return v
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")




EXPIRED_LINE = "Releasing expired KV blocks for request"
"""NIXL's worker, once per rank, when a lease lapses and it releases the blocks."""
LATE_LINE = "Potentially invalid KV blocks for unrecognized request"
"""NIXL's worker, once per rank, when a read notification names a request it no longer
holds."""


def logged_requests(server: Any, line: str) -> list[str]:
    """The request ids in ``server``'s log lines that start with ``line`` (one per rank)."""
    text = server.log_path.read_text(errors="replace")
    return re.findall(re.escape(line) + r" (\S+?)(?: which| were|$)", text, re.M)


def freed_then_read(server: Any) -> set[str]:
    """Requests whose lease vLLM let lapse and which a decode worker read afterwards, by
    vLLM's own log: the freed-before-read hazard."""
    return set(logged_requests(server, EXPIRED_LINE)) & set(logged_requests(server, LATE_LINE))


def client_id(vllm_request_id: str) -> str:
    """The id the client gave, from vLLM's internal one (vLLM appends ``-<8 hex>``)."""
    return vllm_request_id.rsplit("-", 1)[0]


HANDSHAKE_TRIES = 3


def first_transfer(pair: PdPair) -> None:
    """One P/D request before the tests, retried: the first read makes the decode worker
    handshake with the prefill engine's NIXL side channel, whose reply vLLM waits for 5 s
    at most (``zmq.RCVTIMEO``, ``nixl/base_worker.py``); on 2 loaded cores it has come too
    late, and vLLM failed that request (HTTP 500, "KV load failure")."""
    from pd_proxy import pd_complete

    for attempt in range(HANDSHAKE_TRIES):
        try:
            out = pd_complete(pair.prefill.base_url, pair.decode.base_url,
                              body(pair, f"handshake{attempt}"), f"handshake-{attempt}",
                              timeout_seconds=WAIT_SECONDS)
        except (TimeoutError, urllib.error.URLError):  # HTTPError included
            continue
        if out.decode is not None:
            return
    raise AssertionError(f"no P/D transfer succeeded in {HANDSHAKE_TRIES} tries")


def decode_hung_up(pair: PdPair, tag: str, params: dict[str, Any], request_id: str) -> None:
    """Send the decode half, and hang up once vLLM's decode engine holds blocks for it
    (by its own ``vllm:kv_cache_usage_perc``): a client that gives up on a request whose
    KV never arrives. vLLM then aborts the request.

    A fixed client timeout is not enough on 2 loaded cores: the decode engine has
    scheduled a request (allocated its blocks) 3 s after it arrived, and a client that hung
    up first left vLLM aborting a request that never held a block.
    """
    import http.client
    from urllib.parse import urlsplit

    before = blocks_in_use(pair.decode)
    url = urlsplit(pair.decode.base_url)
    conn = http.client.HTTPConnection(url.hostname or "127.0.0.1", url.port, timeout=30)
    try:
        conn.request("POST", "/v1/completions",
                     json.dumps({**body(pair, tag), "kv_transfer_params": params}),
                     {"Content-Type": "application/json", "X-Request-Id": request_id})
        until(f"the decode engine to hold blocks for {request_id}",
              lambda: blocks_in_use(pair.decode) > before)
    finally:
        conn.close()  # vLLM sees the disconnect and aborts the request
