"""Silence is never a clean bill: kvguard's self-monitoring alerts, and every join with
vLLM's series that the docs show, on a real Prometheus scraping real vLLM servers.

Prometheus is configured by the shipped ``deploy/prometheus/scrape-config.yaml`` (its
relabel rules unchanged; pod discovery replaced by static targets carrying the meta
labels a pod's ports get) and scrapes two pods (``conftest.watched_fleet``):

* ``vllm-kvguard-a``: the data-parallel server of this directory (two engines, kvguard
  loaded) and a kvguard sidecar of its own, which a test kills;
* ``vllm-plain-b``: a vLLM server started with ``VLLM_PLUGINS=kvgaurd``, the typo that
  loads no kvguard.

The alert rules are the shipped ``kvguard-self`` group with ``for`` shortened to 2 s
(``conftest._self_rule_file``: Prometheus cannot be made to wait 5 minutes faster; the
shipped durations are promtool-tested). Ground truth: vLLM's own ``/metrics`` (the engines
it serves, the blocks it holds), the run dirs (which engines published kvguard state), the
sidecar process (dead or alive).
"""

from __future__ import annotations

import re
import time
import urllib.request
from typing import Any

import pytest
from _fleet import UNWATCHED_POD, WATCHED_POD, WatchedFleet
from _obs_contract import REPO, PrometheusServer
from _observed import ObservedEngine, SaturatedEngine, vllm_blocks_in_use, vllm_samples

ALERT_TIMEOUT_S = 60.0
"""2 s ``for``, 1 s evaluations, 1 s scrapes; a stale series disappears at the next scrape."""

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "deploy" / "README.md"]
GENERATED = {REPO / "docs" / "runbooks.md"}
"""Rendered from the rule file, whose expressions promtool and these tests run already."""
_PROMQL = re.compile(r"^```promql\n(.*?)^```", re.S | re.M)


def documented_joins() -> list[str]:
    """Every PromQL query in a ```promql block of the docs that reads both vLLM's and
    kvguard's series, whitespace collapsed. Queries in a block are separated by blank
    lines or comment lines."""
    joins: list[str] = []
    for doc in DOCS:
        if doc in GENERATED:
            continue
        for block in _PROMQL.finditer(doc.read_text()):
            for chunk in re.split(r"\n\s*\n|^\s*#.*$", block.group(1), flags=re.M):
                query = " ".join(chunk.split())
                if "vllm:" in query and "kvguard_" in query:
                    joins.append(query)
    return joins


def _alerts(prom: PrometheusServer, name: str) -> list[dict[str, Any]]:
    alerts: list[dict[str, Any]] = prom.get("/api/v1/alerts")["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == name]


def _engines(alerts: list[dict[str, Any]], state: str | None = None) -> set[tuple[str, str]]:
    return {(a["labels"]["pod"], a["labels"]["engine"]) for a in alerts
            if state is None or a["state"] == state}


def _until(what: str, check: Any, prom: PrometheusServer) -> None:
    deadline = time.monotonic() + ALERT_TIMEOUT_S
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} within {ALERT_TIMEOUT_S:.0f} s: "
                        f"{prom.get('/api/v1/alerts')}\n{prom.log_tail()}")
        time.sleep(0.5)


def _vllm_engines(vllm_url: str) -> set[str]:
    """The engines a vLLM server reports, by its own /metrics."""
    return {labels["engine"] for labels, _ in vllm_samples(vllm_url, "vllm:num_requests_running")}


def test_an_engine_vllm_serves_without_kvguard_fires_engine_not_reporting_and_only_it(
        watched_fleet: WatchedFleet) -> None:
    prom = watched_fleet.prometheus
    # Truth: the plain server serves engine 0; kvguard published nothing for it.
    assert _vllm_engines(watched_fleet.unwatched_vllm_url) == {"0"}
    assert list(watched_fleet.unwatched_run_dir.iterdir()) == [], "kvguard was loaded"
    assert _vllm_engines(watched_fleet.watched_vllm_url) == {"0", "1"}

    def fired() -> bool:
        return _engines(_alerts(prom, "KvguardEngineNotReporting"), "firing") == {
            (UNWATCHED_POD, "0")}
    _until("KvguardEngineNotReporting did not fire for the plugin-less engine alone",
           fired, prom)
    time.sleep(3.0)  # three more evaluations: nothing else joins it
    assert _engines(_alerts(prom, "KvguardEngineNotReporting")) == {(UNWATCHED_POD, "0")}
    assert _alerts(prom, "KvguardSidecarDown") == []
    (alert,) = _alerts(prom, "KvguardEngineNotReporting")
    assert alert["labels"]["namespace"] == "llm"
    assert alert["annotations"]["runbook_url"].endswith("#kvguardenginenotreporting")


# The documented joins and what each must return here, from vLLM's own numbers. A join
# added to the docs without an entry here, or an entry whose join left the docs, fails.
EXPECTED_JOINS = {
    "vllm:kv_cache_usage_perc * on(namespace, pod, model_name, engine) group_left(engine_name)"
    " kvguard_pool_capacity_blocks": "blocks vLLM holds, per watched engine",
    "sum by (namespace, pod, model_name, engine) (kvguard_leaked_blocks) and on(namespace,"
    " pod, model_name, engine) vllm:num_requests_running": "blocks vLLM holds, per watched engine",
    "group by (namespace, pod, model_name, engine) (vllm:num_requests_running) unless"
    " on(namespace, pod, model_name, engine) (kvguard_engine_up == 1)": "the unwatched engine",
}


def test_every_documented_join_has_an_expectation() -> None:
    joins = documented_joins()
    assert len(joins) == len(set(joins)), joins
    assert set(joins) == set(EXPECTED_JOINS)


@pytest.mark.parametrize("join", documented_joins())
def test_documented_join_returns_vllms_series_per_engine(
        watched_fleet: WatchedFleet, leaking_engine: ObservedEngine,
        saturated_engine: SaturatedEngine, join: str) -> None:
    """Run as written, on the Prometheus the shipped scrape config configures: one series
    per engine of the watched pod, named by vLLM's engine label, valued as vLLM counts."""
    prom = watched_fleet.prometheus
    doc = prom.get("/api/v1/query", query=join)
    assert doc["status"] == "success", doc
    result = {(r["metric"]["pod"], r["metric"]["engine"]): r for r in doc["data"]["result"]}
    expected = EXPECTED_JOINS[join]
    if expected == "the unwatched engine":
        assert set(result) == {(UNWATCHED_POD, "0")}
        return
    engines = {e.vllm_engine: e for e in (leaking_engine, saturated_engine)}
    assert set(result) == {(WATCHED_POD, e) for e in engines}, result
    for (_, index), r in result.items():
        held = vllm_blocks_in_use(engines[index])
        assert float(r["value"][1]) == pytest.approx(held), (join, r)
        if "group_left(engine_name)" in join:
            assert r["metric"]["engine_name"] == engines[index].name
    assert vllm_blocks_in_use(leaking_engine) > 0  # a join of zeros proves little


def test_a_killed_sidecar_fires_sidecar_down_and_its_engines_not_reporting(
        watched_fleet: WatchedFleet) -> None:
    prom = watched_fleet.prometheus
    assert _alerts(prom, "KvguardSidecarDown") == []
    watched_fleet.kill_sidecar()
    assert watched_fleet.sidecar.poll() is not None
    with urllib.request.urlopen(watched_fleet.watched_vllm_url + "/health", timeout=5) as r:
        assert r.status == 200  # vLLM itself serves on: only kvguard went silent

    def fired() -> bool:
        down = [a for a in _alerts(prom, "KvguardSidecarDown") if a["state"] == "firing"]
        silent = _engines(_alerts(prom, "KvguardEngineNotReporting"), "firing")
        return ([a["labels"]["instance"] for a in down] == [watched_fleet.sidecar_netloc]
                and silent == {(WATCHED_POD, "0"), (WATCHED_POD, "1"), (UNWATCHED_POD, "0")})
    _until("KvguardSidecarDown and KvguardEngineNotReporting did not fire for the killed "
           "sidecar's pod", fired, prom)
    (down,) = _alerts(prom, "KvguardSidecarDown")
    assert (down["labels"]["job"], down["labels"]["pod"]) == ("kvguard", WATCHED_POD)
    assert down["annotations"]["runbook_url"].endswith("#kvguardsidecardown")


