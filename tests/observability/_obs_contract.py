"""The public metric contract (design section 7) and helpers shared by the observability tests.

The contract is written out here on purpose, not imported from kvguard: dashboards and
alerts depend on these names, so a rename in the package must fail these tests.
"""

from __future__ import annotations

import json
import re
import shutil
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "kvguard-alerts.yaml"
RULE_TESTS = REPO / "deploy" / "prometheus" / "kvguard-alerts.test.yaml"
DASHBOARD = REPO / "dashboards" / "kvguard.json"
SCRAPE_CONFIG = REPO / "deploy" / "prometheus" / "scrape-config.yaml"


@dataclass(frozen=True)
class Metric:
    type: str  # "gauge" or "counter"
    labels: frozenset[str]
    # label -> allowed values, for the enumerated labels
    values: tuple[tuple[str, frozenset[str]], ...] = ()
    reserved: bool = False  # in the contract, exported only where a GPU probe reads it
    pd: bool = False  # in the contract, exported only by engines with a KV connector (P/D)
    kv_events: bool = False  # in the contract, exported only for engines publishing KV events
    offload: bool = False  # in the contract, exported only by engines with an offloading connector


def _m(type_: str, *labels: str, reserved: bool = False, pd: bool = False,
       kv_events: bool = False, offload: bool = False, **values: tuple[str, ...]) -> Metric:
    return Metric(type_, frozenset(labels), tuple((k, frozenset(v)) for k, v in values.items()),
                  reserved, pd, kv_events, offload)


ENGINE = ("engine_name", "model_name", "engine")
"""Every per-engine series' labels (metrics contract 2): kvguard's fleet-unique name, and
vLLM's own ``model_name`` and ``engine`` (its index), so that they join vLLM's series."""

CONTRACT: dict[str, Metric] = {
    "kvguard_pool_capacity_blocks": _m("gauge", *ENGINE),
    "kvguard_pool_blocks": _m(
        "gauge", *ENGINE, "state",
        state=("free", "cached", "active", "held_by_finished", "orphaned")),
    "kvguard_cache_saturation_ratio": _m("gauge", *ENGINE),
    "kvguard_finished_requests_holding_blocks": _m("gauge", *ENGINE),
    "kvguard_leaked_blocks": _m(
        "gauge", *ENGINE, "cause", "evidence",
        cause=("finished_request", "orphan", "refcount_drift", "double_free"),
        evidence=("drained", "online")),
    "kvguard_checkpoints_total": _m(
        "counter", *ENGINE, "verdict", "evidence",
        verdict=("clean", "saturated", "leak", "skipped"), evidence=("drained", "online")),
    "kvguard_online_audit_seconds_total": _m("counter", *ENGINE),
    "kvguard_online_sweep_steps": _m("gauge", *ENGINE),
    "kvguard_online_detection_latency_seconds": _m("gauge", *ENGINE),
    "kvguard_online_last_sweep_timestamp_seconds": _m("gauge", *ENGINE),
    "kvguard_last_checkpoint_timestamp_seconds": _m("gauge", *ENGINE),
    "kvguard_request_events_total": _m("counter", *ENGINE, "event"),
    "kvguard_hook_errors_total": _m("counter", *ENGINE),
    "kvguard_engine_up": _m("gauge", *ENGINE),
    "kvguard_engine_start_timestamp_seconds": _m("gauge", *ENGINE),
    "kvguard_leak_trend": _m("gauge", *ENGINE),
    "kvguard_allocator_bytes": _m(
        "gauge", *ENGINE, "kind", reserved=True,
        kind=("allocated", "reserved", "reserved_unallocated", "inactive_split")),
    "kvguard_device_memory_bytes": _m(
        "gauge", *ENGINE, "kind", reserved=True, kind=("used", "non_torch")),
    "kvguard_host_swap_used_bytes": _m("gauge"),
    "kvguard_drain_eta_seconds": _m("gauge", *ENGINE),
    "kvguard_cost_self_seconds_total": _m("counter", *ENGINE),
    "kvguard_cost_scheduler_seconds_total": _m("counter", *ENGINE),
    # P/D (issue 37): the P/D alerts and the dashboard's P/D row read these; only engines
    # with a KV connector export them, so the P/D replay (pd_replay/) serves their data.
    "kvguard_kv_connector_info": _m("gauge", *ENGINE, "connector", "kv_role", "kv_engine_id",
                                    "hold_source", pd=True),
    "kvguard_kv_transfers_pending": _m("gauge", *ENGINE, pd=True),
    "kvguard_kv_transfers_total": _m(
        "counter", *ENGINE, "outcome", pd=True,
        outcome=("read", "expired_unread", "expired_partly_read", "received", "failed",
                 "aborted_waiting", "released")),
    "kvguard_kv_transfer_hazards_total": _m("counter", *ENGINE, "kind", pd=True,
                                            kind=("freed_before_read",)),
    # The KV-event mirror check (issue 39): only engines run with --kv-events-config.
    "kvguard_kv_events_mirror_blocks": _m("gauge", *ENGINE, "state", kv_events=True,
                                          state=("matched", "stale", "missing")),
    "kvguard_kv_events_verdict": _m(
        "gauge", *ENGINE, "verdict", kv_events=True,
        verdict=("pending", "consistent", "cleared_missed", "gap", "stale", "missing")),
    "kvguard_kv_events_batches_lost_total": _m("counter", *ENGINE, kv_events=True),
    "kvguard_kv_events_replays_total": _m("counter", *ENGINE, kv_events=True),
    # The offload path (issue 45): only engines with an offloading KV connector.
    "kvguard_offload_tier_chunks": _m("gauge", *ENGINE, "state", offload=True,
                                      state=("ready", "read_pinned", "write_pending", "free")),
    "kvguard_offload_jobs_in_flight": _m("gauge", *ENGINE, "kind", offload=True,
                                         kind=("store", "load")),
    "kvguard_offload_oldest_job_age_seconds": _m("gauge", *ENGINE, offload=True),
    "kvguard_offload_stuck_jobs": _m("gauge", *ENGINE, offload=True),
    "kvguard_offload_jobs_stuck_total": _m("counter", *ENGINE, offload=True),
    "kvguard_offload_waiting_requests": _m("gauge", *ENGINE, offload=True),
    "kvguard_offload_verdict": _m("gauge", *ENGINE, "verdict", offload=True,
                                  verdict=("ok", "stuck", "tier_mismatch")),
    # The wedge verdict (issue 54): every vLLM engine exports these.
    "kvguard_engine_wedged": _m("gauge", *ENGINE),
    "kvguard_wedge_verdicts_total": _m("counter", *ENGINE),
    "kvguard_wedge_dead_blocks": _m("gauge", *ENGINE),
}
# The sidecar's own operational series: in docs/operator-guide.md, no dashboard panel.
OPERATIONAL: dict[str, Metric] = {
    "kvguard_engine_info": _m("gauge", *ENGINE, "epoch", "kvguard_version", "engine_kind",
                              "engine_version", "metrics_contract"),
    "kvguard_sidecar_read_errors_total": _m("counter"),
    "kvguard_drains_unaudited_total": _m("counter", *ENGINE),
    "kvguard_online_sweeps_total": _m("counter", *ENGINE),
    "kvguard_cost_sampled_steps_total": _m("counter", *ENGINE),
    "kvguard_cost_windows_skipped_total": _m("counter", *ENGINE),
    # The KV-event mirror check: only engines run with --kv-events-config export these.
    "kvguard_kv_events_batches_received_total": _m("counter", *ENGINE),
    "kvguard_kv_events_restarts_total": _m("counter", *ENGINE),
    "kvguard_kv_events_replays_truncated_total": _m("counter", *ENGINE),
    "kvguard_kv_events_gap_open": _m("gauge", *ENGINE),
    # Findings in the requests' traces (kvguard/tracing): only engines with an OTLP endpoint.
    "kvguard_trace_spans_exported_total": _m("counter", *ENGINE),
    "kvguard_trace_spans_dropped_total": _m("counter", *ENGINE),
    "kvguard_trace_export_failures_total": _m("counter", *ENGINE),
    # The opt-in reclaim (issue 54 part 3): only engines with KVGUARD_RECLAIM=1.
    "kvguard_reclaimed_blocks_total": _m("counter", *ENGINE, "cause"),
    "kvguard_reclaims_refused_total": _m("counter", *ENGINE, "reason"),
}

RESERVED = frozenset(n for n, m in CONTRACT.items() if m.reserved)
PD_METRICS = frozenset(n for n, m in CONTRACT.items() if m.pd)
"""Exported only by engines with a KV connector: the P/D replay's targets, not the
data-parallel server's."""
KV_EVENTS = frozenset(n for n, m in CONTRACT.items() if m.kv_events)
"""Exported only for engines that publish KV events (the observability targets do not)."""
OFFLOAD = frozenset(n for n, m in CONTRACT.items() if m.offload)
"""Exported only by engines with an offloading KV connector (the observability targets have
none; tests/sidecar/test_offload_metrics.py reads them)."""
HOST_METRICS = frozenset(n for n, m in CONTRACT.items() if "engine" not in m.labels)

METRIC_NAME = re.compile(r"\bkvguard_[a-z0-9_]+\b")
VLLM_SELECTOR = re.compile(r"\b(vllm:[a-z0-9_:]+)\s*(\{[^}]*\})?")
"""vLLM's own series in a query, with their matchers."""


def promtool() -> str:
    """The real promtool binary; a missing one is an error, never a skip."""
    path = shutil.which("promtool") or "/usr/bin/promtool"
    assert Path(path).is_file(), (
        "promtool not found: install Debian's `prometheus` package (scripts/bootstrap does)"
    )
    return path


def prometheus_binary() -> str:
    path = shutil.which("prometheus") or "/usr/bin/prometheus"
    assert Path(path).is_file(), (
        "prometheus not found: install Debian's `prometheus` package (scripts/bootstrap does)"
    )
    return path


def load_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def load_alerts() -> list[dict[str, Any]]:
    return [r for r in load_rules() if "alert" in r]


def load_dashboard() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return doc


def all_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    out: list[dict[str, Any]] = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


@dataclass(frozen=True)
class PanelQuery:
    panel_id: int
    title: str
    ref_id: str
    expr: str
    metrics: frozenset[str]

    @property
    def reserved(self) -> bool:
        return bool(self.metrics) and self.metrics <= RESERVED

    @property
    def pd(self) -> bool:
        """A P/D panel: its data comes from the P/D replay's Prometheus."""
        return bool(self.metrics & PD_METRICS)

    @property
    def diverged_mirrors(self) -> bool:
        """The KV-event panel's query that lists only mirrors whose verdict is a fault: the
        observability targets' mirrors are healthy, so it must give no data there."""
        return self.metrics == {"kvguard_kv_events_verdict"}

    @property
    def offload(self) -> bool:
        """Only offload series: the observability targets (no offloading connector) give no
        data."""
        return bool(self.metrics) and self.metrics <= OFFLOAD

    @property
    def label(self) -> str:
        return f"{self.title} [{self.ref_id}]"


def panel_queries(dashboard: dict[str, Any]) -> list[PanelQuery]:
    return [
        PanelQuery(p["id"], p["title"], t["refId"], t["expr"],
                   frozenset(METRIC_NAME.findall(t["expr"])))
        for p in all_panels(dashboard)
        for t in p.get("targets", [])
    ]


# What Grafana puts in for the template variables when everything is selected.
GRAFANA_SUBSTITUTIONS = {
    "$namespace": ".*",
    "$pod": ".*",
    "$model_name": ".*",
    "$engine_name": ".*",
    "$__rate_interval": "15s",
    "$__interval": "5s",
}


def grafana_expand(expr: str) -> str:
    # longest first: "$__rate_interval" before "$__interval"
    for key in sorted(GRAFANA_SUBSTITUTIONS, key=len, reverse=True):
        expr = expr.replace(key, GRAFANA_SUBSTITUTIONS[key])
    assert "$" not in expr, f"unexpanded variable in {expr!r}"
    return expr


class PrometheusServer:
    """A running Prometheus: its base URL, its log, and a JSON GET on its HTTP API."""

    def __init__(self, url: str, log: Path) -> None:
        self.url = url
        self.log = log

    def log_tail(self, n: int = 40) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(lines[-n:])

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=5) as resp:
            return json.loads(resp.read())
