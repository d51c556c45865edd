"""The sidecar's HTTP API and metrics, on engine state files written as an engine would."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from factories import judged, report, state, write
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from kvguard.core.trend import TrendVerdict
from kvguard.sidecar.app import create_app
from kvguard.sidecar.metrics import KvguardCollector
from kvguard.sidecar.store import EngineStore
from kvguard.transport.control import request_path
from kvguard.transport.publisher import state_path

CONTRACT = {
    "kvguard_pool_capacity_blocks": "gauge", "kvguard_pool_blocks": "gauge",
    "kvguard_cache_saturation_ratio": "gauge",
    "kvguard_finished_requests_holding_blocks": "gauge", "kvguard_leaked_blocks": "gauge",
    "kvguard_checkpoints": "counter", "kvguard_last_checkpoint_timestamp_seconds": "gauge",
    "kvguard_request_events": "counter", "kvguard_hook_errors": "counter",
}


def _client(run_dir: Path, token: str | None = None) -> TestClient:
    store = EngineStore(run_dir)
    store.refresh()
    return TestClient(create_app(store, control_token=token, poll_interval_seconds=0.05))


def _metrics(c: TestClient) -> dict[str, list[tuple[dict[str, str], float, str]]]:
    out: dict[str, list[tuple[dict[str, str], float, str]]] = {}
    for fam in text_string_to_metric_families(c.get("/metrics").text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value, fam.type))
    return out


def test_sidecar_started_before_any_engine_serves_empty_answers(tmp_path: Path) -> None:
    with _client(tmp_path / "not-yet") as c:
        h = c.get("/healthz").json()
        assert h == {"status": "ok", "engines": 0, "engines_up": 0, "read_errors": {}}
        assert c.get("/v1/report").json() == {"engines": [], "transfer_links": []}
        assert c.get("/v1/checkpoints").json() == {"checkpoints": []}
        assert c.get("/metrics").status_code == 200


def test_get_metrics_serves_the_librarys_bytes_with_its_content_type(tmp_path: Path) -> None:
    for e in range(2):
        write(tmp_path, state([report(i, engine=f"dp{e}", holding=(i + e) % 3)
                               for i in range(1, 9)], engine=f"dp{e}", hook_errors=e))
    store = EngineStore(tmp_path)
    store.refresh()
    with TestClient(create_app(store, poll_interval_seconds=60)) as c:
        got = c.get("/metrics")
    assert got.status_code == 200
    assert got.headers["content-type"] == CONTENT_TYPE_LATEST
    library = CollectorRegistry(auto_describe=False)
    library.register(KvguardCollector(store))
    assert got.content == generate_latest(library)


class _SlowStore(EngineStore):
    """A store whose reads take a while, as on a busy node or a slow volume."""

    def refresh(self) -> None:
        time.sleep(0.3)
        super().refresh()


class _BrokenStore(EngineStore):
    def refresh(self) -> None:
        raise OSError("volume not mounted yet")


def test_the_first_scrape_after_start_sees_the_engines_already_on_disk(tmp_path: Path) -> None:
    # A restarted sidecar must not answer its first scrape with no engines: Prometheus
    # would record every kvguard series as gone for one interval.
    write(tmp_path, state([report(1), judged(2, holding=2).report]))
    with TestClient(create_app(_SlowStore(tmp_path), poll_interval_seconds=3600)) as c:
        assert c.get("/healthz").json()["engines"] == 1
        assert _metrics(c)["kvguard_finished_requests_holding_blocks"][0][1] == 2.0


def test_a_failing_first_read_does_not_stop_the_sidecar(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    with TestClient(create_app(_BrokenStore(tmp_path), poll_interval_seconds=3600)) as c:
        assert c.get("/healthz").json()["engines"] == 0
        assert c.get("/metrics").status_code == 200
    assert "volume not mounted yet" in caplog.text


def test_metrics_follow_the_contract_with_types_and_no_request_labels(tmp_path: Path) -> None:
    latest = judged(2, holding=2)
    write(tmp_path, state([report(1), latest.report]))
    with _client(tmp_path) as c:
        m = _metrics(c)
    for name, typ in CONTRACT.items():
        sample = name + "_total" if typ == "counter" else name
        assert sample in m, name
        assert all(t == typ for _, _, t in m[sample])
    # Ground truth from the reference pool, not from the report: referenced blocks are the
    # leaked ones (nothing is live at a drained checkpoint), the rest free or cached.
    pool = latest.harness.pool
    referenced = sum(1 for b in range(1, pool.num_blocks) if pool.ref[b] > 0)
    free, cached = pool.count_states_truth()
    assert referenced == len({b for lk in latest.leaks for b in lk.blocks}) > 0
    states = {lbl["state"]: v for lbl, v, _ in m["kvguard_pool_blocks"]}
    assert states == {"free": free, "cached": cached, "active": 0,
                      "held_by_finished": referenced, "orphaned": 0}
    assert sum(states.values()) == pool.capacity
    leaked = {lbl["cause"]: v for lbl, v, _ in m["kvguard_leaked_blocks"]}
    assert leaked == {"finished_request": referenced, "orphan": 0.0, "refcount_drift": 0.0,
                      "double_free": 0.0}
    [(_, holding, _)] = m["kvguard_finished_requests_holding_blocks"]
    assert holding == len(latest.leaks)
    for samples in m.values():
        for labels, _, _ in samples:
            assert not {"request_id", "request", "client_request_id"} & labels.keys()


def test_growing_holders_over_checkpoints_is_a_growing_leak(tmp_path: Path) -> None:
    write(tmp_path, state([report(i, holding=h) for i, h in enumerate([0, 1, 2, 3], 1)]))
    with _client(tmp_path) as c:
        [eng] = c.get("/v1/report").json()["engines"]
        assert eng["trend"]["verdict"] == TrendVerdict.LEAK_GROWING
        assert eng["trend"]["holding_series"] == [0, 1, 2, 3]
        assert _metrics(c)["kvguard_leak_trend"][0][1] == 1.0


def test_the_trend_follows_each_new_state_of_an_engine(tmp_path: Path) -> None:
    """The store computes an engine's trend once per state it merges (every scrape asks
    for it): a state that arrives later must change what scrapes and reports say."""
    reports = [report(i, cached=c) for i, c in enumerate([20, 45, 60, 61], 1)]
    store = EngineStore(tmp_path)
    write(tmp_path, state(reports, updated_at=100.0))
    store.refresh()
    assert store.engines["dp0"].trend.verdict == TrendVerdict.SATURATED
    assert store.engines["dp0"].trend is store.engines["dp0"].trend  # computed once
    reports += [report(i, holding=h) for i, h in zip(range(5, 8), [1, 2, 3], strict=True)]
    write(tmp_path, state(reports, updated_at=101.0))
    os.utime(state_path(tmp_path, "dp0"), ns=(1, 2))  # a new file version whatever the clock
    store.refresh()
    t = store.engines["dp0"].trend
    assert t.verdict == TrendVerdict.LEAK_GROWING and t.holding_series[-3:] == (1, 2, 3)
    with TestClient(create_app(store, poll_interval_seconds=3600)) as c:
        assert _metrics(c)["kvguard_leak_trend"][0][1] == 1.0


def test_stable_saturation_is_not_a_leak_trend(tmp_path: Path) -> None:
    write(tmp_path, state([report(i, cached=c) for i, c in enumerate([20, 45, 60, 61, 61], 1)]))
    with _client(tmp_path) as c:
        [eng] = c.get("/v1/report").json()["engines"]
        assert eng["trend"]["verdict"] == TrendVerdict.SATURATED
        assert eng["latest"]["verdict"] == "saturated"
        m = _metrics(c)
        assert m["kvguard_leak_trend"][0][1] == 0.0
        assert all(v == 0 for _, v, _ in m["kvguard_leaked_blocks"])


def test_checkpoint_history_is_kept_across_rewrites_and_filtered(tmp_path: Path) -> None:
    write(tmp_path, state([report(1), report(2)]))
    write(tmp_path, state([report(9, engine="dp1")], engine="dp1"))
    store = EngineStore(tmp_path, history=5)
    store.refresh()
    write(tmp_path, state([report(2), report(3)]))  # the engine keeps only its last N
    os.utime(tmp_path / "dp0.json", ns=(1, 2 * 10**18))
    store.refresh()
    with TestClient(create_app(store)) as c:
        ids = [r["checkpoint_id"] for r in
               c.get("/v1/checkpoints", params={"engine": "dp0"}).json()["checkpoints"]]
        assert ids == [1, 2, 3]
        assert len(c.get("/v1/checkpoints").json()["checkpoints"]) == 4
        r = c.get("/v1/checkpoints", params={"engine": "nope"})
        assert r.status_code == 404 and "dp0" in r.json()["detail"]
        assert c.get("/v1/checkpoints", params={"limit": 0}).status_code == 422
        assert c.get("/v1/checkpoints", params={"engine": "a/b"}).status_code == 422


def test_a_corrupt_state_file_is_reported_and_does_not_hide_the_others(tmp_path: Path) -> None:
    write(tmp_path, state([report(1)]))
    (tmp_path / "broken.json").write_text('{"schema_version": 1, "engine": ')
    (tmp_path / "future.json").write_text('{"schema_version": 99}')
    with _client(tmp_path) as c:
        h = c.get("/healthz").json()
        assert h["engines"] == 1
        assert "not a valid kvguard state" in h["read_errors"]["broken.json"]
        assert "same kvguard version" in h["read_errors"]["future.json"]
        assert _metrics(c)["kvguard_sidecar_read_errors_total"][0][1] == 2.0


@pytest.mark.parametrize("header,status", [(None, 401), ("Bearer wrong", 403),
                                           ("Basic s3cret", 403), ("Bearer s3cret", 202)])
def test_checkpoint_requests_need_the_control_token(tmp_path: Path, header: str | None,
                                                    status: int) -> None:
    write(tmp_path, state([report(1)]))
    with _client(tmp_path, token="s3cret") as c:
        headers = {"Authorization": header} if header else {}
        r = c.post("/v1/checkpoints", headers=headers)
        assert r.status_code == status, r.text
        assert request_path(tmp_path, "dp0").exists() == (status == 202)
        if status == 202:
            assert r.json()["requested"] == ["dp0"]
        else:
            assert r.json()["detail"]


def test_without_a_configured_token_checkpoint_requests_are_open_on_loopback(
    tmp_path: Path,
) -> None:
    write(tmp_path, state([report(1)]))
    with _client(tmp_path) as c:
        assert c.post("/v1/checkpoints", params={"engine": "dp0"}).status_code == 202
        assert c.post("/v1/checkpoints", params={"engine": "dp9"}).status_code == 404


def test_stale_engine_state_is_reported_down(tmp_path: Path) -> None:
    write(tmp_path, state([report(1)], updated_at=1.0))
    with _client(tmp_path) as c:
        assert c.get("/v1/report").json()["engines"][0]["up"] is False
        assert _metrics(c)["kvguard_engine_up"][0][1] == 0.0


def test_drain_eta_is_exported_and_infinite_when_the_workload_does_not_drain(
    tmp_path: Path,
) -> None:
    from kvguard.core.drain_model import predict

    s = state([report(1)]).model_copy(update={"drain": predict(
        12, 3.1, 2.9, at=1.0, window_seconds=30.0)})
    write(tmp_path, s)
    with _client(tmp_path) as c:
        [(labels, value, typ)] = _metrics(c)["kvguard_drain_eta_seconds"]
        body = c.get("/v1/report").text
    assert labels == {"engine_name": "dp0", "model_name": "tiny-llama", "engine": "0"}
    assert value == float("inf") and typ == "gauge"
    # Strict JSON for clients: no bare Infinity; "never" is null plus drains=false.
    assert "Infinity" not in body
    drain = json.loads(body)["engines"][0]["drain"]
    assert drain["drains"] is False and drain["eta_seconds"] is None
    assert "λ=3.10/s ≥ μ=2.90/s, backlog 12" in drain["explanation"]


def test_every_engine_series_carries_vllms_join_labels_and_a_fleet_unique_name(
    tmp_path: Path,
) -> None:
    """Contract 2: two engines with vLLM's same ``model_name`` and ``engine`` (a prefill
    and a decode server on one host, each vLLM's engine 0) stay two series, told apart by
    ``engine_name``; every per-engine series carries the three labels."""
    write(tmp_path, state([report(1, engine="node-a-prefill")], engine="node-a-prefill"))
    write(tmp_path, state([report(1, engine="node-a-decode", holding=1)],
                          engine="node-a-decode"))
    with _client(tmp_path) as c:
        metrics = _metrics(c)
    per_engine = {n: samples for n, samples in metrics.items()
                  if n.startswith("kvguard_") and n != "kvguard_host_swap_used_bytes"
                  and n != "kvguard_sidecar_read_errors_total"}
    assert len(per_engine) >= 10
    for name, samples in per_engine.items():
        for labels, _, _ in samples:
            assert labels["model_name"] == "tiny-llama" and labels["engine"] == "0", name
            assert labels["engine_name"] in {"node-a-prefill", "node-a-decode"}, name
    holding = {labels["engine_name"]: v for labels, v, _ in
               metrics["kvguard_finished_requests_holding_blocks"]}
    assert holding == {"node-a-prefill": 0.0, "node-a-decode": 1.0}
    [info, _] = sorted(metrics["kvguard_engine_info"], key=lambda s: s[0]["engine_name"])
    assert info[0]["metrics_contract"] == "2"


def test_trace_counters_are_exported_only_for_engines_that_trace(tmp_path: Path) -> None:
    from kvguard.core.state import TracingState

    traced = state([report(1)], engine="dp0").model_copy(update={"tracing": TracingState(
        service_name="kvguard", spans_queued_total=9, spans_dropped_total=3,
        spans_exported_total=7, export_failures_total=2)})
    write(tmp_path, traced)
    write(tmp_path, state([report(1, engine="dp1")], engine="dp1", engine_index=1))
    with _client(tmp_path) as c:
        m = _metrics(c)
    for name, value in (("kvguard_trace_spans_exported_total", 7.0),
                        ("kvguard_trace_spans_dropped_total", 3.0),
                        ("kvguard_trace_export_failures_total", 2.0)):
        [(labels, v, typ)] = m[name]
        assert (labels["engine_name"], v, typ) == ("dp0", value, "counter")
