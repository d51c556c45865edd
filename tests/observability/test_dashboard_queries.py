"""The Grafana dashboard: its structure, and every panel query run on a real Prometheus.

Prometheus (Debian 2.42) scrapes ``metrics_target`` (see conftest.py) every second with the
kvguard alert rules loaded; each panel query is evaluated through ``/api/v1/query`` with the
template variables expanded the way Grafana does when "All" is selected.
"""

from __future__ import annotations

import re
import time
import urllib.request
from typing import Any

import pytest
from _obs_contract import (
    CONTRACT,
    HOST_METRICS,
    OPERATIONAL,
    RESERVED,
    PanelQuery,
    PrometheusServer,
    all_panels,
    grafana_expand,
    load_dashboard,
    panel_queries,
)
from prometheus_client.parser import text_string_to_metric_families

# The first sample of a new target lands after about 5 s (target discovery is
# throttled); rate()/increase() over 15s need two samples.
DATA_TIMEOUT_S = 20.0
ALERT_TIMEOUT_S = 20.0

DASHBOARD = load_dashboard()
QUERIES = panel_queries(DASHBOARD)
LEAK_ALERTS = {"KvguardLeakedBlocks", "KvguardDoubleFree",
               "KvguardFinishedRequestsHoldingBlocksGrowing"}


def _query(prom: PrometheusServer, expr: str) -> list[dict[str, Any]]:
    doc: Any = prom.get("/api/v1/query", query=expr)
    assert doc["status"] == "success", f"{expr}: {doc}"
    assert doc["data"]["resultType"] == "vector", doc["data"]["resultType"]
    result: list[dict[str, Any]] = doc["data"]["result"]
    return result


def _poll(prom: PrometheusServer, expr: str, timeout: float) -> list[dict[str, Any]]:
    """Evaluate ``expr`` until it returns a series or ``timeout`` passes (then the last,
    empty result). A query Prometheus rejects fails at once."""
    deadline = time.monotonic() + timeout
    while True:
        result = _query(prom, expr)
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


@pytest.fixture(scope="module")
def scraped(prometheus: PrometheusServer) -> PrometheusServer:
    """Prometheus once it holds at least two scrapes of the target."""
    result = _poll(prometheus, "count_over_time(kvguard_pool_capacity_blocks[1m]) >= 2",
                   DATA_TIMEOUT_S)
    if not result:
        targets = prometheus.get("/api/v1/targets")
        pytest.fail(f"no kvguard samples after {DATA_TIMEOUT_S:.0f} s; targets: {targets}\n"
                    f"{prometheus.log_tail()}")
    return prometheus


# ------------------------------------------------------------------ structure


def test_dashboard_schema_and_datasource_variable() -> None:
    assert DASHBOARD["schemaVersion"] >= 36
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for panel in all_panels(DASHBOARD):
        if panel.get("targets"):
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            for target in panel["targets"]:
                assert target["datasource"] == panel["datasource"]


@pytest.mark.parametrize("name", ["namespace", "pod", "engine"])
def test_label_variables_match_everything_by_default(name: str) -> None:
    var = {v["name"]: v for v in DASHBOARD["templating"]["list"]}[name]
    assert var["type"] == "query"
    assert var["datasource"]["uid"] == "${datasource}"
    assert var["definition"].startswith("label_values(kvguard_pool_capacity_blocks")
    assert var["definition"].endswith(f", {name})")
    # "All" must also match series without the label (a local, non-Kubernetes scrape)
    assert var["includeAll"] is True and var["allValue"] == ".*"
    assert var["current"]["value"] == ["$__all"]


def test_panel_ids_are_unique() -> None:
    ids = [p["id"] for p in all_panels(DASHBOARD)]
    assert len(ids) == len(set(ids))


_SELECTOR = re.compile(r"\b(kvguard_[a-z0-9_]+)\s*(\{[^}]*\})?")


@pytest.mark.parametrize("q", QUERIES, ids=lambda q: q.label)
def test_query_filters_on_the_template_variables(q: PanelQuery) -> None:
    selectors = _SELECTOR.findall(q.expr)
    assert selectors, q.expr
    for metric, matchers in selectors:
        assert metric in CONTRACT, metric
        assert 'namespace=~"$namespace"' in matchers, (metric, q.expr)
        assert 'pod=~"$pod"' in matchers, (metric, q.expr)
        if metric not in HOST_METRICS:  # the host metric has no engine label
            assert 'engine=~"$engine"' in matchers, (metric, q.expr)


def test_reserved_panels_say_so() -> None:
    reserved = [q for q in QUERIES if q.reserved]
    assert {m for q in reserved for m in q.metrics} == RESERVED
    by_id = {p["id"]: p for p in all_panels(DASHBOARD)}
    for q in reserved:
        assert by_id[q.panel_id]["description"].startswith("Reserved"), q.title


# ------------------------------------------------------------------ the target


def test_target_exposes_the_contract(metrics_target: str) -> None:
    """What the target serves is the contract: known names, types, labels, label values."""
    with urllib.request.urlopen(metrics_target, timeout=10) as resp:
        text = resp.read().decode()
    seen: set[str] = set()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("kvguard_"):
                continue
            if sample.name.endswith("_created") and family.type == "counter":
                continue  # prometheus_client's creation timestamps of counters
            metric = CONTRACT.get(sample.name) or OPERATIONAL.get(sample.name)
            assert metric is not None, f"{sample.name} is not in the metric contract"
            assert family.type == metric.type, (sample.name, family.type)
            extra = set(sample.labels) - metric.labels
            assert set(sample.labels) >= metric.labels, (sample.name, sample.labels)
            assert not extra, f"{sample.name}: labels outside the contract {extra}"
            for label, allowed in metric.values:
                assert sample.labels[label] in allowed, (sample.name, sample.labels)
            seen.add(sample.name)
    missing = set(CONTRACT) - RESERVED - seen
    assert not missing, f"target does not export {sorted(missing)}"


# --------------------------------------------------------- queries on Prometheus


@pytest.mark.parametrize("q", QUERIES, ids=lambda q: q.label)
def test_panel_query_returns_data(scraped: PrometheusServer, q: PanelQuery) -> None:
    expr = grafana_expand(q.expr)
    if q.reserved:
        # exported by a later release: the query must be valid, data is optional
        _query(scraped, expr)
        return
    result = _poll(scraped, expr, DATA_TIMEOUT_S)
    assert result, f"panel {q.title!r}: no series for {expr}"


def test_leaked_blocks_panel_shows_the_leak(scraped: PrometheusServer) -> None:
    (q,) = [q for q in QUERIES if q.metrics == {"kvguard_leaked_blocks"}]
    result = _poll(scraped, grafana_expand(q.expr), DATA_TIMEOUT_S)
    leaking = [r for r in result if float(r["value"][1]) > 0]
    assert leaking, f"the leaked-blocks panel shows no leak: {result}"
    assert {r["metric"]["cause"] for r in result} <= dict(
        CONTRACT["kvguard_leaked_blocks"].values)["cause"]


def test_pool_states_sum_to_capacity(scraped: PrometheusServer) -> None:
    result = _poll(
        scraped,
        "sum by (engine) (kvguard_pool_blocks) - sum by (engine) (kvguard_pool_capacity_blocks)",
        DATA_TIMEOUT_S)
    assert result
    assert all(float(r["value"][1]) == 0 for r in result), result


def test_alerts_fire_on_the_leak_and_not_on_saturation(scraped: PrometheusServer) -> None:
    """The rule file, loaded in the same Prometheus: the leak raises an alert (pending
    while its ``for`` runs), a saturated clean engine raises none, and no rule errors."""
    deadline = time.monotonic() + ALERT_TIMEOUT_S
    while True:
        doc = scraped.get("/api/v1/alerts")
        alerts = doc["data"]["alerts"]
        if {a["labels"]["alertname"] for a in alerts} & {"KvguardLeakedBlocks",
                                                           "KvguardDoubleFree"}:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"no leak alert after {ALERT_TIMEOUT_S:.0f} s: {alerts}")
        time.sleep(0.5)
    names = {a["labels"]["alertname"] for a in alerts}
    assert names <= LEAK_ALERTS, f"unexpected alerts on this target: {names - LEAK_ALERTS}"

    # every alerting engine has leak evidence; the others (saturated or clean) are silent
    evidence = _query(scraped, "sum by (engine) (kvguard_leaked_blocks) > 0 "
                               "or max by (engine) (kvguard_leak_trend) == 1")
    leaking = {r["metric"]["engine"] for r in evidence}
    alerting = {a["labels"]["engine"] for a in alerts}
    assert alerting <= leaking, f"alerts on engines without a leak: {alerting - leaking}"

    rules = scraped.get("/api/v1/rules")
    evaluated = [r for g in rules["data"]["groups"] for r in g["rules"]]
    assert {r["name"] for r in evaluated} >= {
        "KvguardLeakedBlocks", "KvguardFinishedRequestsHoldingBlocksGrowing",
        "KvguardNoDrainedCheckpoint", "KvguardHookErrors", "KvguardDoubleFree"}
    for rule in evaluated:
        assert rule["health"] in {"ok", "unknown"}, (rule["name"], rule.get("lastError"))
