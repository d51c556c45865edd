"""P/D in the fleet's monitoring: two sidecars, vLLM's own series, the rules and the P/D row.

A real Prometheus scrapes a prefill pod and a decode pod (each a kvguard sidecar and vLLM's
``/metrics``), played from a real P/D run's recording (``_pd_replay``: why a replay, what
is recorded). Ground truth is vLLM's: its recorded NIXL counters and request gauges, its
log lines and blocks in use counted by the recorder, and the requests the recorded
workload sent; never kvguard's counters.
"""

from __future__ import annotations

import time
import urllib.request
from typing import Any

import pytest
from _obs_contract import (
    CONTRACT,
    PD_METRICS,
    PrometheusServer,
    grafana_expand,
    load_dashboard,
    load_rules,
    panel_queries,
)
from _pd_replay import NAMESPACE, PODS, PdReplay, manifest, recorded_vllm_value
from prometheus_client.parser import text_string_to_metric_families

DECODE_LEAK_FIRING_TIMEOUT_S = 120.0
"""KvguardKvDecodeLeakedBlocks has ``for: 1m``; the leak is in the last phase played."""
MANIFEST = manifest()
LAST = MANIFEST["phases"][-1]["phase"]
PD_QUERIES = [q for q in panel_queries(load_dashboard()) if q.pd]


def _query(prom: PrometheusServer, expr: str) -> list[dict[str, Any]]:
    doc: Any = prom.get("/api/v1/query", query=expr)
    assert doc["status"] == "success", f"{expr}: {doc}"
    result: list[dict[str, Any]] = doc["data"]["result"]
    return result


def _by(result: list[dict[str, Any]], label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in result:
        key = r["metric"].get(label, "")
        out[key] = out.get(key, 0.0) + float(r["value"][1])
    return out


def _phase(name: str) -> dict[str, Any]:
    (p,) = [p for p in MANIFEST["phases"] if p["phase"] == name]
    return p


def _requests(kind: str) -> list[str]:
    return [r for p in MANIFEST["phases"] for r in p["requests"].get(kind, [])]


def test_the_replay_played_every_recorded_phase_in_order(pd_replay: PdReplay) -> None:
    assert list(pd_replay.played) == [p["phase"] for p in MANIFEST["phases"]]
    assert len(pd_replay.played) >= 5


@pytest.mark.parametrize("engine", sorted(PODS))
def test_each_sidecar_exports_the_pd_contract(pd_replay: PdReplay, engine: str) -> None:
    """Each pod's sidecar serves every P/D metric with exactly the contract's labels and
    label values, for its one engine."""
    with urllib.request.urlopen(pd_replay.sidecar_metrics_urls[engine], timeout=10) as resp:
        text = resp.read().decode()
    seen: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            metric = CONTRACT.get(sample.name)
            if sample.name not in PD_METRICS or metric is None:
                continue
            assert set(sample.labels) == metric.labels, (sample.name, sample.labels)
            for label, allowed in metric.values:
                assert sample.labels[label] in allowed, (sample.name, sample.labels)
            assert sample.labels["engine_name"] == engine
            assert sample.labels["model_name"] == MANIFEST["model_name"]
            seen.add(sample.name)
    assert seen == PD_METRICS


@pytest.mark.parametrize("q", PD_QUERIES, ids=lambda q: q.label)
def test_pd_panel_query_names_the_engines_of_both_pods_or_the_model(
        pd_replay: PdReplay, q: Any) -> None:
    """Every P/D panel query returns series on the two pods' data, named by kvguard's
    engine name (or, across pods, by model)."""
    result = _query(pd_replay.prometheus, grafana_expand(q.expr))
    assert result, q.label
    names = {r["metric"].get("engine_name") or r["metric"].get("model_name") for r in result}
    assert names <= {*PODS, MANIFEST["model_name"]}, names


def test_expired_leases_equal_vllms_own_count(pd_replay: PdReplay) -> None:
    """kvguard's expired_unread on the prefill engine, vLLM's
    vllm:nixl_num_kv_expired_reqs_total on that pod (joined as the panel joins them) and
    vLLM's "Releasing expired KV blocks" log lines agree."""
    prom = pd_replay.prometheus
    truth = recorded_vllm_value(LAST, "prefill", "vllm:nixl_num_kv_expired_reqs_total")
    assert truth == _phase(LAST)["engines"]["prefill"]["log_lines"]["lease_expired"] == 1
    kvguard = _by(_query(prom, 'kvguard_kv_transfers_total{outcome=~"expired_unread|'
                               'expired_partly_read"}'), "engine_name")
    assert kvguard == {"prefill": truth, "decode": 0.0}
    joined = _by(_query(prom, "vllm:nixl_num_kv_expired_reqs_total * on(namespace, pod, "
                              "model_name, engine) group_left(engine_name) "
                              "kvguard_kv_connector_info"), "engine_name")
    assert joined == {"prefill": truth, "decode": 0.0}


def test_freed_before_read_equals_vllms_reads_after_expiry(pd_replay: PdReplay) -> None:
    prom = pd_replay.prometheus
    truth = recorded_vllm_value(LAST, "prefill", "vllm:nixl_num_notifications_after_expiry_total")
    assert truth == _phase(LAST)["engines"]["prefill"]["log_lines"]["read_after_expiry"] == 1
    hazards = _by(_query(prom, 'kvguard_kv_transfer_hazards_total{kind="freed_before_read"}'),
                  "engine_name")
    assert hazards == {"prefill": truth, "decode": 0.0}
    joined = _by(_query(prom, "vllm:nixl_num_notifications_after_expiry_total * on(namespace, "
                              "pod, model_name, engine) group_left(engine_name) "
                              "kvguard_kv_connector_info"), "engine_name")
    assert joined["prefill"] == truth


def test_received_transfers_are_the_decodes_the_workload_completed(pd_replay: PdReplay) -> None:
    """The decode engine received the KV of every decode half that answered: the healthy
    completions and the late one (which read freed blocks)."""
    received = _by(_query(pd_replay.prometheus, 'kvguard_kv_transfers_total{outcome="received"}'),
                   "engine_name")
    assert received["decode"] == len(_requests("pd_complete")) + len(_requests("decode_late"))
    assert received["prefill"] == 0


def test_pending_followed_vllms_waiting_and_held_blocks(pd_replay: PdReplay) -> None:
    """Over the replay, pending peaked at 1 on each side: the decode request vLLM counted
    waiting (vllm:num_requests_waiting, phase decode_waiting) and the prefill hold vLLM
    kept blocks for with nothing running (phase prefill_holding); it is 0 at the end."""
    prom = pd_replay.prometheus
    peak = _by(_query(prom, "max_over_time(kvguard_kv_transfers_pending[10m])"), "engine_name")
    waiting = max(recorded_vllm_value(p["phase"], "decode", "vllm:num_requests_waiting")
                  for p in MANIFEST["phases"])
    holding = _phase("02-prefill_holding")["engines"]["prefill"]
    assert recorded_vllm_value("02-prefill_holding", "prefill", "vllm:num_requests_running") == 0
    assert holding["vllm_blocks_in_use"] > 0 and len(_requests("prefill_only")) == 1
    assert peak == {"prefill": 1.0, "decode": waiting} and waiting == 1
    assert _by(_query(prom, "kvguard_kv_transfers_pending"), "engine_name") == {
        "prefill": 0.0, "decode": 0.0}


def test_the_cross_pod_records_compare_both_sides_per_model(pd_replay: PdReplay) -> None:
    """One series per model, built from the prefill pod's reads and the decode pod's
    receipts. During the replay one transfer was read (abort-1's, whose decode was
    abandoned) and one received (the late decode of the lapsed lease's request)."""
    prom = pd_replay.prometheus
    model = MANIFEST["model_name"]
    for record, pod in (("read", PODS["prefill"]), ("received", PODS["decode"])):
        (r,) = _query(prom, f"namespace_model_name:kvguard_kv_transfers_{record}:increase15m")
        assert r["metric"] == {"__name__": f"namespace_model_name:kvguard_kv_transfers_"
                                           f"{record}:increase15m",
                               "namespace": NAMESPACE, "model_name": model}
        assert round(float(r["value"][1])) == 1, r
        assert _query(prom, f'kvguard_kv_transfers_total{{outcome="{record}", pod="{pod}"}}')
    (diff,) = _query(prom,
                     "namespace_model_name:kvguard_kv_transfers_read_minus_received:increase15m")
    assert round(float(diff["value"][1])) == 0, diff


def _alerts(prom: PrometheusServer) -> list[dict[str, Any]]:
    alerts: list[dict[str, Any]] = prom.get("/api/v1/alerts")["data"]["alerts"]
    return alerts


def test_the_read_after_expiry_fires_the_critical_alert_on_the_prefill_pod(
        pd_replay: PdReplay) -> None:
    """KvguardKvFreedBeforeRead fires (no ``for``) on the prefill engine and pod whose vLLM
    logged the read after expiry; KvguardKvReadAfterExpiryNotSeen never fired and is not
    even pending now: kvguard accounted for vLLM's count. (It may have been pending for a
    scrape or two: vLLM's counter and kvguard's state reach Prometheus a moment apart, as
    in a fleet, which is what its ``for: 5m`` absorbs.)"""
    prom = pd_replay.prometheus
    deadline = time.monotonic() + 10
    while True:
        firing = [a for a in _alerts(prom) if a["state"] == "firing"
                  and a["labels"]["alertname"] == "KvguardKvFreedBeforeRead"]
        if firing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    (alert,) = firing
    assert alert["labels"]["engine_name"] == "prefill"
    assert alert["labels"]["pod"] == PODS["prefill"] and alert["labels"]["severity"] == "critical"
    assert float(alert["value"]) > 0
    for name in ("KvguardKvReadAfterExpiryNotSeen", "KvguardKvReadNotReceived"):
        assert _query(prom, f'count_over_time(ALERTS{{alertname="{name}", '
                            f'alertstate="firing"}}[15m])') == [], name
        assert not [a for a in _alerts(prom) if a["labels"]["alertname"] == name], name


def test_the_decode_sides_remote_kv_wait_leak_fires_valued_at_vllms_held_blocks(
        pd_replay: PdReplay) -> None:
    """The decode request aborted while waiting keeps its blocks: the decode alert fires for
    the decode engine only, valued at the blocks vLLM still holds there with nothing
    running or waiting."""
    prom = pd_replay.prometheus
    truth = _phase(LAST)["engines"]["decode"]["vllm_blocks_in_use"]
    assert truth > 0
    assert recorded_vllm_value(LAST, "decode", "vllm:num_requests_running") == 0
    assert recorded_vllm_value(LAST, "decode", "vllm:num_requests_waiting") == 0
    deadline = time.monotonic() + DECODE_LEAK_FIRING_TIMEOUT_S
    while True:
        firing = [a for a in _alerts(prom) if a["state"] == "firing"
                  and a["labels"]["alertname"] == "KvguardKvDecodeLeakedBlocks"]
        if firing or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert len(firing) == 1, _alerts(prom)
    assert firing[0]["labels"]["engine_name"] == "decode"
    assert firing[0]["labels"]["pod"] == PODS["decode"]
    assert float(firing[0]["value"]) == truth


def test_every_rule_evaluates_without_error_on_the_pd_data(pd_replay: PdReplay) -> None:
    rules = pd_replay.prometheus.get("/api/v1/rules")
    evaluated = [r for g in rules["data"]["groups"] for r in g["rules"]]
    assert {r["name"] for r in evaluated} == {r.get("alert") or r["record"] for r in load_rules()}
    for rule in evaluated:
        assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))


def test_the_cli_joins_the_pair_over_the_two_pods_sidecars(pd_replay: PdReplay) -> None:
    """``kvguard report --transfers --sidecar URL --sidecar URL``: the cross-engine verdicts
    joined over each pod's sidecar's HTTP API (no shared run dir). Truth: the lease vLLM
    logged as lapsed and then read (``never-1``), and the decode half the workload
    abandoned while vLLM's decode engine still held blocks for it (``abort-1``)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    urls = [pd_replay.sidecar_metrics_urls[e].removesuffix("/metrics")
            for e in ("prefill", "decode")]
    cmd = [str(Path(sys.executable).with_name("kvguard")), "report", "--transfers", "--json"]
    for url in urls:
        cmd += ["--sidecar", url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    links = {(ln["kind"], ln["prefill_request_id"].split("-")[1]): ln
             for ln in json.loads(out.stdout)["links"]}
    prefill = _phase(LAST)["engines"]["prefill"]["log_lines"]
    assert prefill["lease_expired"] == prefill["read_after_expiry"] == 1
    (late,) = _requests("decode_late")
    (abandoned,) = _requests("prefill_then_decode_abandoned")
    assert _phase(LAST)["engines"]["decode"]["vllm_blocks_in_use"] > 0
    assert set(links) == {("freed_before_read", late.split("-")[0]),
                          ("read_not_received", abandoned.split("-")[0])}, links
    for ln in links.values():
        assert (ln["prefill_engine"], ln["decode_engine"]) == ("prefill", "decode")
    # A sidecar that is not there: exit 2 and a message that says what to check.
    bad = subprocess.run([*cmd[:-1], "http://127.0.0.1:9"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "is `kvguard sidecar` running there" in bad.stderr
