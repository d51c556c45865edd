"""The Grafana dashboard: its structure, and every panel query run on a real Prometheus.

Prometheus (Debian 2.42) scrapes the sidecar of a real data-parallel server (see
conftest.py: rank ``obs-dp1`` leaks, rank ``obs-dp0`` is healthy with a saturated prefix
cache) every second with the kvguard alert rules loaded; each panel query is evaluated
through ``/api/v1/query`` with the template variables expanded the way Grafana does when
"All" is selected. Panel values are compared with vLLM's own numbers per rank, read from
the vLLM server's ``/metrics``.
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
    OFFLOAD,
    OPERATIONAL,
    PD_METRICS,
    RESERVED,
    VLLM_SELECTOR,
    PanelQuery,
    PrometheusServer,
    all_panels,
    grafana_expand,
    load_alerts,
    load_dashboard,
    load_rules,
    panel_queries,
)
from _observed import (
    LEAKING,
    SATURATED,
    ObservedEngine,
    SaturatedEngine,
    vllm_blocks_in_use,
    vllm_capacity_blocks,
)
from _pd_replay import PdReplay
from prometheus_client.parser import text_string_to_metric_families

# The first sample of a new target lands after about 5 s (target discovery is
# throttled); rate()/increase() over 15s need two samples.
DATA_TIMEOUT_S = 20.0
ALERT_FIRING_TIMEOUT_S = 150.0
"""KvguardLeakedBlocks has ``for: 1m``; its series appear about 5 s after Prometheus starts."""

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


@pytest.fixture(scope="module")
def pd_scraped(pd_replay: PdReplay) -> PrometheusServer:
    """The P/D replay's Prometheus, every phase played."""
    return pd_replay.prometheus


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


@pytest.mark.parametrize("name", ["namespace", "pod", "model_name", "engine_name"])
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


@pytest.mark.parametrize("q", [q for q in QUERIES if VLLM_SELECTOR.search(q.expr)],
                         ids=lambda q: q.label)
def test_vllm_series_in_a_query_filter_on_the_pod_and_model_and_join_kvguards(
        q: PanelQuery) -> None:
    """vLLM's own series carry no engine_name: they are filtered on the pod and model and
    named through the documented join with a kvguard series."""
    for metric, matchers in VLLM_SELECTOR.findall(q.expr):
        for label in ("namespace", "pod", "model_name"):
            assert f'{label}=~"${label}"' in matchers, (metric, q.expr)
    assert "on(namespace, pod, model_name, engine) group_left(engine_name)" in q.expr


@pytest.mark.parametrize("q", QUERIES, ids=lambda q: q.label)
def test_query_filters_on_the_template_variables(q: PanelQuery) -> None:
    selectors = _SELECTOR.findall(q.expr)
    assert selectors, q.expr
    for metric, matchers in selectors:
        assert metric in CONTRACT, metric
        assert 'namespace=~"$namespace"' in matchers, (metric, q.expr)
        assert 'pod=~"$pod"' in matchers, (metric, q.expr)
        if metric not in HOST_METRICS:  # the host metric has no engine label
            assert 'model_name=~"$model_name"' in matchers, (metric, q.expr)
            assert 'engine_name=~"$engine_name"' in matchers, (metric, q.expr)


def test_reserved_panels_say_so() -> None:
    reserved = [q for q in QUERIES if q.reserved]
    assert {m for q in reserved for m in q.metrics} == RESERVED
    by_id = {p["id"]: p for p in all_panels(DASHBOARD)}
    for q in reserved:
        assert by_id[q.panel_id]["description"].startswith("Reserved"), q.title


# ------------------------------------------------------------------ the target


def test_target_exposes_the_contract(metrics_target: str) -> None:
    """What the target serves is the contract: known names, types, labels, label values."""
    # The mirror's block counts exist once the sidecar has compared a mirror with its pool
    # (it joined after the workload and replays first): read again until they are there.
    deadline = time.monotonic() + DATA_TIMEOUT_S
    while True:
        with urllib.request.urlopen(metrics_target, timeout=10) as resp:
            text = resp.read().decode()
        if "kvguard_kv_events_mirror_blocks{" in text or time.monotonic() > deadline:
            break
        time.sleep(0.5)
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
    # The P/D metrics come only from engines with a KV connector (test_pd_observability).
    assert not seen & PD_METRICS, "an engine without a KV connector exports P/D series"
    # Both ranks publish KV events (conftest.py): the KV-event series are expected too.
    missing = set(CONTRACT) - RESERVED - PD_METRICS - OFFLOAD - seen
    assert not missing, f"target does not export {sorted(missing)}"


# --------------------------------------------------------- queries on Prometheus


@pytest.mark.parametrize("q", QUERIES, ids=lambda q: q.label)
def test_panel_query_returns_data(request: pytest.FixtureRequest, q: PanelQuery) -> None:
    """Each panel on the Prometheus that has its data: the data-parallel server's, or the
    P/D replay's for the P/D row (only engines with a KV connector export its series)."""
    scraped: PrometheusServer = request.getfixturevalue("pd_scraped" if q.pd else "scraped")
    expr = grafana_expand(q.expr)
    if q.reserved or q.offload:
        # exported by a later release, or only for engines with an offloading connector
        # (tests/sidecar/test_offload_metrics.py): the query must be valid, data is optional
        _query(scraped, expr)
        return
    if q.diverged_mirrors:  # both ranks' mirrors are consistent (test_data_parallel.py)
        assert _poll(scraped, 'count(kvguard_kv_events_verdict{verdict="consistent"} == 1) == 2',
                     DATA_TIMEOUT_S), "both ranks' mirrors to be judged consistent"
        assert _query(scraped, expr) == [], f"panel {q.title!r} shows a healthy mirror"
        return
    result = _poll(scraped, expr, DATA_TIMEOUT_S)
    assert result, f"panel {q.title!r}: no series for {expr}"


def _by_engine(result: list[dict[str, Any]], *label: str) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for r in result:
        key = (r["metric"]["engine_name"], *(r["metric"][name] for name in label))
        out[key] = out.get(key, 0.0) + float(r["value"][1])
    return out


def _panel(metrics: set[str]) -> PanelQuery:
    (q,) = [q for q in QUERIES if q.metrics == metrics]
    return q


def test_leaked_blocks_panel_equals_the_blocks_vllm_still_holds_at_idle(
        scraped: PrometheusServer, leaking_engine: ObservedEngine,
        saturated_engine: SaturatedEngine) -> None:
    """The panel's leaked blocks are the blocks vLLM's own pool still references with
    nothing running: ``vllm:kv_cache_usage_perc`` x usable blocks (``num_gpu_blocks - 1``
    from ``vllm:cache_config_info``), exactly; zero on the saturated engine."""
    _poll(scraped, f'kvguard_leaked_blocks{{engine_name="{SATURATED}"}}', DATA_TIMEOUT_S)
    result = _query(scraped, grafana_expand(_panel({"kvguard_leaked_blocks"}).expr))
    assert {r["metric"]["cause"] for r in result} <= dict(
        CONTRACT["kvguard_leaked_blocks"].values)["cause"]
    leaked = _by_engine(result)
    truth = vllm_blocks_in_use(leaking_engine)
    assert truth > 0, "the leaking engine holds no block by vLLM's count: the fault did not fire"
    assert leaked == {(LEAKING,): truth, (SATURATED,): vllm_blocks_in_use(saturated_engine)}
    assert leaked[(SATURATED,)] == 0


def test_pool_panel_matches_vllms_own_pool(scraped: PrometheusServer,
                                           leaking_engine: ObservedEngine,
                                           saturated_engine: SaturatedEngine) -> None:
    """Per engine: capacity is vLLM's; referenced blocks (held by finished requests or
    orphaned; none active at idle) are those vLLM counts as used; the saturated engine's
    cached blocks are those vLLM served from its prefix cache when its prompts came again."""
    states_q, capacity_q = _panel({"kvguard_pool_blocks"}), _panel(
        {"kvguard_pool_capacity_blocks"})
    _poll(scraped, f'kvguard_pool_blocks{{engine_name="{SATURATED}"}}', DATA_TIMEOUT_S)
    states = _by_engine(_query(scraped, grafana_expand(states_q.expr)), "state")
    capacity = _by_engine(_query(scraped, grafana_expand(capacity_q.expr)))
    for engine in (leaking_engine, saturated_engine):
        assert capacity[(engine.name,)] == vllm_capacity_blocks(engine.vllm_url, engine.vllm_engine)
        assert states[(engine.name, "active")] == 0
        referenced = states[(engine.name, "held_by_finished")] + states[(engine.name, "orphaned")]
        assert referenced == vllm_blocks_in_use(engine), engine.name
    assert states[(SATURATED, "cached")] == saturated_engine.cached_blocks_truth
    ratio_q = _panel({"kvguard_cache_saturation_ratio"})
    ratio = _by_engine(_query(scraped, grafana_expand(ratio_q.expr)))
    assert ratio[(SATURATED,)] == pytest.approx(
        saturated_engine.cached_blocks_truth / vllm_capacity_blocks(saturated_engine.vllm_url,
                                                            saturated_engine.vllm_engine))


def test_pool_states_sum_to_capacity(scraped: PrometheusServer) -> None:
    result = _poll(
        scraped,
        "sum by (engine_name) (kvguard_pool_blocks)"
        " - sum by (engine_name) (kvguard_pool_capacity_blocks)",
        DATA_TIMEOUT_S)
    assert {r["metric"]["engine_name"] for r in result} == {LEAKING, SATURATED}
    assert all(float(r["value"][1]) == 0 for r in result), result


def _alerts(prom: PrometheusServer) -> list[dict[str, Any]]:
    alerts: list[dict[str, Any]] = prom.get("/api/v1/alerts")["data"]["alerts"]
    return alerts


def test_every_alert_is_silent_on_saturation_while_the_leak_alert_fires(
        scraped: PrometheusServer, leaking_engine: ObservedEngine,
        saturated_engine: SaturatedEngine) -> None:
    """The rule file, loaded in the same Prometheus as both engines. The leak alert fires
    (its ``for`` ran out) on the leaking engine, valued at the blocks vLLM still holds;
    meanwhile no rule has ever been pending or firing for the saturated engine (whose
    series Prometheus does hold), no rule's expression selects it, and no rule errors."""
    truth = vllm_blocks_in_use(leaking_engine)
    deadline = time.monotonic() + ALERT_FIRING_TIMEOUT_S
    while True:
        alerts = _alerts(scraped)
        firing = [a for a in alerts if a["state"] == "firing"
                  and a["labels"]["alertname"] == "KvguardLeakedBlocks"
                  and a["labels"]["engine_name"] == LEAKING]
        if sum(float(a["value"]) for a in firing) == truth:
            break
        if time.monotonic() > deadline:
            pytest.fail(f"KvguardLeakedBlocks did not fire for {truth} blocks within "
                        f"{ALERT_FIRING_TIMEOUT_S:.0f} s: {alerts}")
        time.sleep(1.0)

    sat = f'{{engine_name="{SATURATED}"}}'
    ratio = _query(scraped, f"kvguard_cache_saturation_ratio{sat}")
    assert ratio and float(ratio[0]["value"][1]) >= 0.8, "the saturated engine is not scraped"
    assert not [a for a in alerts if a["labels"].get("engine_name") == SATURATED], alerts
    assert _query(scraped, f"count_over_time(ALERTS{sat}[15m])") == []
    for rule in load_alerts():
        selected = {r["metric"].get("engine_name") for r in _query(scraped, rule["expr"])}
        assert SATURATED not in selected, rule["alert"]

    on_leaking = {a["labels"]["alertname"] for a in alerts
                  if a["labels"].get("engine_name") == LEAKING}
    assert on_leaking <= LEAK_ALERTS, f"unexpected alerts: {on_leaking - LEAK_ALERTS}"
    assert {a["labels"].get("engine_name") for a in alerts} == {LEAKING}, alerts

    rules = scraped.get("/api/v1/rules")
    evaluated = [r for g in rules["data"]["groups"] for r in g["rules"]]
    assert {r["name"] for r in evaluated} == {r.get("alert") or r["record"] for r in load_rules()}
    for rule in evaluated:
        assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))


# The join of "Joining vLLM's series" (docs/operator-guide.md): kvguard's series carry vLLM's own
# model_name and engine, and the scrape's pod label comes with both targets.
VLLM_JOIN = ("vllm:kv_cache_usage_perc * on(pod, model_name, engine) "
             "group_left(engine_name) kvguard_pool_capacity_blocks")


def test_kvguard_series_join_vllms_own_on_model_name_and_engine(
        scraped: PrometheusServer, leaking_engine: ObservedEngine,
        saturated_engine: SaturatedEngine) -> None:
    """vLLM's usage ratio times kvguard's capacity, joined per engine, is the number of
    blocks vLLM itself says are in use: one series per rank, named by kvguard."""
    result = _poll(scraped, f"count({VLLM_JOIN})", DATA_TIMEOUT_S)
    assert float(result[0]["value"][1]) == 2, result
    joined = {r["metric"]["engine"]: r for r in _query(scraped, VLLM_JOIN)}
    assert set(joined) == {leaking_engine.vllm_engine, saturated_engine.vllm_engine}
    for engine in (leaking_engine, saturated_engine):
        r = joined[engine.vllm_engine]
        assert r["metric"]["engine_name"] == engine.name
        assert float(r["value"][1]) == pytest.approx(vllm_blocks_in_use(engine)), r
    assert vllm_blocks_in_use(leaking_engine) > 0


def test_kv_event_mirror_panel_shows_the_blocks_vllm_keeps_cached(
        scraped: PrometheusServer, saturated_engine: SaturatedEngine) -> None:
    """The KV-event panel's mirror blocks on the saturated rank: every block vLLM keeps
    cached there is matched in the mirror, none stale or missing."""
    expr = grafana_expand(_panel({"kvguard_kv_events_mirror_blocks"}).expr)
    truth = saturated_engine.cached_blocks_truth
    deadline = time.monotonic() + DATA_TIMEOUT_S
    while True:
        shown = _by_engine(_query(scraped, expr), "state")
        if shown.get((SATURATED, "matched")) == truth or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {k[1]: v for k, v in shown.items() if k[0] == SATURATED} == {
        "matched": truth, "stale": 0, "missing": 0}, shown
