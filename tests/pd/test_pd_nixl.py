"""P/D disaggregation on two real vLLM servers with the real NixlConnector.

One prefill server (``kv_producer``) and one decode server (``kv_consumer``) on
127.0.0.1, each on its own core, publish kvguard state into one run dir; requests are
routed by the project's own proxy (``kvguard.demo.pd_proxy``). Both servers run the
chaos scheduler with faults that fire only on request ids carrying their marker
(``@lost`` on the prefill side, ``@abort`` on the decode side), so the healthy
scenarios run first on the same pair, untouched.

Ground truth is vLLM's own: each server's ``vllm:kv_cache_usage_perc`` times its
capacity (blocks held), its request gauges and its log lines (lease expiry, reads after
expiry); never kvguard's counters. The tests run in file order (module-scoped pair).
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvguard.chaos.faults import SCHEDULER_CLS
from kvguard.core.state import EngineState
from kvguard.core.transfer_links import LinkKind, link_transfers
from kvguard.core.types import LeakCause, LeakPath, Verdict
from kvguard.demo.pd_pair import PdPair, pd_pair
from kvguard.demo.pd_proxy import create_proxy, decode, decode_abandoned, pd_complete, prefill
from kvguard.demo.tiny_model import make_tiny_model
from kvguard.transport.reader import read_run_dir

pytestmark = pytest.mark.timeout(600)

PROMPT_WORDS = 150
"""A prompt of 5 blocks (32 tokens each) with the tiny model's tokenizer."""


def _prompt(tag: str) -> str:
    return f"{tag} " + " ".join(f"w{i}" for i in range(PROMPT_WORDS))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdPair]:
    tmp = tmp_path_factory.mktemp("pd")
    faults = {"KVGUARD_ALLOW_FAULTS": "1", "VLLM_PLUGINS": "kvguard"}
    with pd_pair(make_tiny_model(tmp / "model"), tmp / "run", tmp / "logs",
                 scheduler_cls=SCHEDULER_CLS,
                 prefill_env={**faults, "KVGUARD_FAULTS": "send_completion_lost=2@lost"},
                 decode_env={**faults, "KVGUARD_FAULTS": "remote_kv_never_arrives=2@abort"}
                 ) as p:
        yield p


def _body(pair: PdPair, tag: str, max_tokens: int = 8) -> dict[str, Any]:
    return {"model": pair.prefill.spec.served_model_name, "prompt": _prompt(tag),
            "max_tokens": max_tokens, "temperature": 0.0}


def _vllm(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name)


def blocks_in_use(server: Any) -> int:
    """vLLM's own count of blocks with a reference: usage x usable capacity."""
    usable = server.spec.num_gpu_blocks_override - 1
    return round(_vllm(server.base_url, "vllm:kv_cache_usage_perc") * usable)


def _post_plain(server: Any, tag: str) -> None:
    """One ordinary completion (no transfer): makes an idle engine step."""
    body = {"model": server.spec.served_model_name, "prompt": _prompt(tag), "max_tokens": 2}
    req = urllib.request.Request(server.base_url + "/v1/completions",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200


def _state(pair: PdPair, engine: str) -> EngineState:
    for s in read_run_dir(pair.run_dir).states:
        if s.engine == engine:
            return s
    raise AssertionError(f"no state of {engine} in {pair.run_dir}")


def _until(what: str, cond: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def _latest_drained(pair: PdPair, engine: str, after: float) -> Any:
    def got() -> Any:
        r = _state(pair, engine).latest_report
        return r if r is not None and r.drained and r.taken_at > after else None
    return _until(f"a drained checkpoint of {engine}", got, 90.0)


def _record(pair: PdPair, engine: str, client_id_part: str) -> Any:
    t = _state(pair, engine).transfers
    assert t is not None
    return next((r for r in t.records if client_id_part in r.client_request_id), None)


def test_a_healthy_transfer_is_clean_on_both_sides(pair: PdPair) -> None:
    t0 = time.time()
    for i in range(3):
        out = pd_complete(pair.prefill.base_url, pair.decode.base_url,
                          _body(pair, f"ok{i}"), f"ok-{i}")
        assert out.prefill_params["remote_engine_id"] and out.decode is not None
        assert out.decode["usage"]["completion_tokens"] == 8
    _until("the prefill side to free its held blocks", lambda: blocks_in_use(pair.prefill) == 0)
    for engine in ("prefill", "decode"):
        r = _latest_drained(pair, engine, t0)
        assert r.verdict in (Verdict.CLEAN, Verdict.SATURATED), r.explanation
    p, d = _state(pair, "prefill").transfers, _state(pair, "decode").transfers
    assert p is not None and d is not None
    assert p.connector == "NixlConnector" and p.kv_role == "kv_producer"
    assert "live leases" in p.hold_source  # the worker's leases were reachable
    assert p.outcomes_total.get("read") == 3 and d.outcomes_total.get("received") == 3
    # Each decode record names the prefill engine's NIXL id and request id.
    ok0 = _record(pair, "decode", "ok-0")
    assert ok0.remote_engine_id == p.kv_engine_id
    assert _record(pair, "prefill", "ok-0").request_id == ok0.remote_request_id
    assert link_transfers({"p": _state(pair, "prefill"), "d": _state(pair, "decode")}) == []


def test_decode_never_comes_the_lease_releases_the_hold_and_no_leak(pair: PdPair) -> None:
    t0 = time.time()
    pair_params = prefill(pair.prefill.base_url, _body(pair, "never"), "never-1")
    held = blocks_in_use(pair.prefill)
    assert held > 0  # vLLM keeps them for the decode that never comes
    rec = _until("the lease to be read", lambda: (r := _record(pair, "prefill", "never-1"))
                 and r.hold_deadline and r)
    assert 0 < rec.hold_deadline - t0 <= pair.lease_seconds + 2
    _until("vLLM to free on lease expiry", lambda: blocks_in_use(pair.prefill) == 0,
           pair.lease_seconds + 30)
    assert "Releasing expired KV blocks" in pair.prefill.log_path.read_text()
    r = _latest_drained(pair, "prefill", t0)
    assert r.verdict is not Verdict.LEAK, r.explanation
    rec = _record(pair, "prefill", "never-1")
    assert rec.outcome.value == "expired_unread" and rec.reads == 0
    pair.never_params = pair_params  # type: ignore[attr-defined]  # the next test reads late


def test_a_read_after_the_lease_lapsed_is_reported_as_a_hazard(pair: PdPair) -> None:
    params = getattr(pair, "never_params", None)
    assert params is not None, "runs after test_decode_never_comes..."
    decode(pair.decode.base_url, _body(pair, "never"), params, "never-1")
    # An idle prefill engine does not step, and reads its NIXL notifications only in a
    # step: give it one.
    _post_plain(pair.prefill, "kick")
    log = pair.prefill.log_path
    _until("vLLM's own warning of a read after expiry",
           lambda: "Potentially invalid KV blocks" in log.read_text())
    t = _until("kvguard's hazard", lambda: (s := _state(pair, "prefill").transfers)
               and s.hazards and s)
    (hz,) = t.hazards
    assert hz.kind.value == "freed_before_read" and "never-1" in hz.client_request_id
    assert t.hazards_total == {"freed_before_read": 1}
    links = _until("the cross-engine link", lambda: [ln for ln in link_transfers(
        {"prefill": _state(pair, "prefill"), "decode": _state(pair, "decode")})
        if ln.kind is LinkKind.FREED_BEFORE_READ])
    assert "never-1" in links[0].prefill_request_id
    # In Prometheus: per engine, no request label.
    samples = _sidecar_samples(pair)
    assert samples[("kvguard_kv_transfer_hazards_total", "prefill", "freed_before_read")] == 1
    assert samples[("kvguard_kv_transfers_total", "prefill", "expired_unread")] == 1
    assert samples[("kvguard_kv_transfers_total", "decode", "received")] >= 4


def _sidecar_samples(pair: PdPair) -> dict[tuple[str, str, str], float]:
    """The real sidecar app's /metrics over the pair's run dir: (name, engine, outcome or
    kind) -> value."""
    from fastapi.testclient import TestClient

    from kvguard.sidecar.app import create_app
    from kvguard.sidecar.store import EngineStore

    store = EngineStore(pair.run_dir)
    store.refresh()
    with TestClient(create_app(store)) as client:
        text = client.get("/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name.startswith("kvguard_kv_"):
                assert set(smp.labels) <= {"engine_name", "model_name", "engine", "outcome",
                                           "kind", "connector", "kv_role", "kv_engine_id",
                                           "hold_source"}, smp.labels
                key = smp.labels.get("outcome") or smp.labels.get("kind") or ""
                out[(smp.name, smp.labels["engine_name"], key)] = smp.value
    return out


def test_decode_aborted_while_waiting_is_a_finding_on_the_decode_side(pair: PdPair) -> None:
    t0 = time.time()
    params = prefill(pair.prefill.base_url, _body(pair, "abort"), "abort-1")
    # The decode side's completion is lost (fault): the request waits; the client gives up.
    assert decode_abandoned(pair.decode.base_url, _body(pair, "abort"), params, "abort-1",
                            after_seconds=4.0)
    _until("the decode request to be aborted",
           lambda: _vllm(pair.decode.base_url, "vllm:num_requests_running")
           + _vllm(pair.decode.base_url, "vllm:num_requests_waiting") == 0)
    held = blocks_in_use(pair.decode)
    assert held > 0  # vLLM keeps the blocks of a request whose KV never arrived
    bound = 2 * pair.lease_seconds
    r = _latest_drained(pair, "decode", t0 + bound)
    assert r.verdict is Verdict.LEAK, r.explanation
    (f,) = r.leaks
    assert f.cause is LeakCause.FINISHED_REQUEST and f.path is LeakPath.REMOTE_KV_WAIT
    assert "abort-1" in (f.client_request_id or "") and f.blocks == held
    p_state = _state(pair, "prefill")
    assert p_state.transfers is not None and p_state.transfers.kv_engine_id in f.detail
    # The prefill side was read and let go: clean; the link says where the loss was.
    assert blocks_in_use(pair.prefill) == 0
    links = [ln for ln in link_transfers({"prefill": p_state, "decode": _state(pair, "decode")})
             if "abort-1" in ln.decode_request_id]
    assert [ln.kind for ln in links] == [LinkKind.READ_NOT_RECEIVED]


def test_a_completion_lost_below_kvguard_on_the_prefill_side_is_caught(pair: PdPair) -> None:
    t0 = time.time()
    out = pd_complete(pair.prefill.base_url, pair.decode.base_url, _body(pair, "lost"),
                      "lost-1")
    assert out.decode is not None and out.decode["usage"]["completion_tokens"] == 8
    time.sleep(2.0)
    held = blocks_in_use(pair.prefill)
    assert held > 0  # read by the decode side, never given back (fault below the hooks)
    r = _latest_drained(pair, "prefill", t0 + 5.0)
    assert r.verdict is Verdict.LEAK, r.explanation
    (f,) = [f for f in r.leaks if "lost-1" in (f.client_request_id or "")]
    assert f.cause is LeakCause.FINISHED_REQUEST and f.path is LeakPath.DELAYED_FREE
    assert f.blocks == held and "hold ended" in f.detail


def test_the_lost_send_completion_reaches_the_sidecar_with_no_further_traffic(
        pair: PdPair) -> None:
    """Issue 41: after the previous test's lost completion nothing is sent to the prefill
    engine; the sidecar's ``kvguard_leaked_blocks`` still equals what vLLM holds."""
    from fastapi.testclient import TestClient

    from kvguard.sidecar.app import create_app
    from kvguard.sidecar.store import EngineStore

    assert _record(pair, "prefill", "lost-1") is not None, "runs after the lost completion"
    assert _vllm(pair.prefill.base_url, "vllm:num_requests_running") \
        + _vllm(pair.prefill.base_url, "vllm:num_requests_waiting") == 0
    held = blocks_in_use(pair.prefill)
    store = EngineStore(pair.run_dir)
    store.refresh()
    with TestClient(create_app(store)) as client:
        text = client.get("/metrics").text
    leaked = sum(smp.value for fam in text_string_to_metric_families(text)
                 for smp in fam.samples if smp.name == "kvguard_leaked_blocks"
                 and smp.labels.get("engine_name") == "prefill")
    assert held > 0 and leaked == held


def test_a_prefill_hold_for_an_aborted_decode_is_named_across_engines(pair: PdPair) -> None:
    from fastapi.testclient import TestClient

    from kvguard.sidecar.app import create_app
    from kvguard.sidecar.store import EngineStore

    params = prefill(pair.prefill.base_url, _body(pair, "both"), "abort-lost-1")
    assert decode_abandoned(pair.decode.base_url, _body(pair, "both"), params, "abort-lost-1",
                            after_seconds=4.0)
    store = EngineStore(pair.run_dir)

    def linked() -> Any:
        store.refresh()
        with TestClient(create_app(store)) as client:
            body = client.get("/v1/report").json()
        return [ln for ln in body["transfer_links"] if "abort-lost-1" in ln["decode_request_id"]]
    (ln,) = _until("the sidecar's cross-engine link", linked)
    assert ln["kind"] == LinkKind.PREFILL_HOLDS_FOR_ABORTED_DECODE.value
    assert ln["prefill_engine"] == "prefill" and ln["decode_engine"] == "decode"
    assert ln["sentence"].startswith("prefill engine prefill holds blocks for request ")
    assert blocks_in_use(pair.prefill) > 0 and blocks_in_use(pair.decode) > 0


def test_the_proxy_app_routes_a_completion_across_the_pair(pair: PdPair) -> None:
    from fastapi.testclient import TestClient

    with TestClient(create_proxy(pair.prefill.base_url, pair.decode.base_url)) as client:
        resp = client.post("/v1/completions", json=_body(pair, "proxy"),
                           headers={"X-Request-Id": "proxy-1"})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 8
    assert _until("the decode record", lambda: _record(pair, "decode", "proxy-1"))
