"""The alert rules: real ``promtool`` checks and unit tests, and their contract with users."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from _obs_contract import (
    CONTRACT,
    METRIC_NAME,
    RULE_TESTS,
    RULES,
    all_panels,
    load_alerts,
    load_dashboard,
    load_rules,
    promtool,
)

EXPECTED_ALERTS = {
    "KvguardLeakedBlocks": "warning",
    "KvguardFinishedRequestsHoldingBlocksGrowing": "warning",
    "KvguardNoDrainedCheckpoint": "info",
    "KvguardHookErrors": "warning",
    "KvguardDoubleFree": "critical",
    # P/D (group kvguard-pd)
    "KvguardKvFreedBeforeRead": "critical",
    "KvguardKvTransfersStuck": "warning",
    "KvguardKvDecodeLeakedBlocks": "warning",
    "KvguardKvReadNotReceived": "warning",
    "KvguardKvReadAfterExpiryNotSeen": "warning",
    "KvguardKvEventMirrorDiverged": "warning",
    "KvguardOffloadJobStuck": "warning",
    # kvguard itself (group kvguard-self)
    "KvguardSidecarDown": "warning",
    "KvguardEngineNotReporting": "warning",
    "KvguardNoAudit": "warning",
    # an engine wedged by dead owners (group kvguard-wedge)
    "KvguardEngineWedged": "critical",
}
PD_RECORDS = {
    "namespace_model_name:kvguard_kv_transfers_read:increase15m",
    "namespace_model_name:kvguard_kv_transfers_received:increase15m",
    "namespace_model_name:kvguard_kv_transfers_read_minus_received:increase15m",
}
SELF_RECORDS = {"kvguard:audit_max_age_seconds"}
"""The self-monitoring rules' one setting (seconds), a recording rule operators edit."""
SEVERITIES = {"info", "warning", "critical"}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], cwd=RULES.parent, capture_output=True,
                          text=True, timeout=60, check=False)


def test_promtool_check_rules() -> None:
    res = _run("check", "rules", RULES.name)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(load_rules())} rules found" in res.stdout, res.stdout


def test_recording_rules_are_the_pd_comparisons_and_the_audit_age_setting() -> None:
    records = {r["record"] for r in load_rules() if "record" in r}
    assert records == PD_RECORDS | SELF_RECORDS


def test_promtool_unit_tests_pass() -> None:
    res = _run("test", "rules", RULE_TESTS.name)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "SUCCESS" in res.stdout, res.stdout


def test_promtool_unit_tests_can_fail(tmp_path: Path) -> None:
    """Guard against a vacuous test file: a wrong expectation must make promtool fail."""
    text = RULE_TESTS.read_text()
    broken = text.replace("severity: critical", "severity: page", 1)
    assert broken != text
    shutil.copy(RULES, tmp_path / RULES.name)
    (tmp_path / RULE_TESTS.name).write_text(broken)
    res = subprocess.run([promtool(), "test", "rules", RULE_TESTS.name], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode != 0, res.stdout
    assert "KvguardDoubleFree" in res.stdout + res.stderr


def test_expected_alerts_and_severities() -> None:
    got = {a["alert"]: a.get("labels", {}).get("severity") for a in load_alerts()}
    assert got == EXPECTED_ALERTS


@pytest.mark.parametrize("alert", load_alerts(), ids=lambda a: a["alert"])
def test_alert_has_severity_summary_description_and_runbook(alert: dict[str, Any]) -> None:
    labels = alert.get("labels") or {}
    annotations = alert.get("annotations") or {}
    assert labels.get("severity") in SEVERITIES, f"{alert['alert']}: severity label"
    for key in ("summary", "description", "runbook"):
        assert str(annotations.get(key, "")).strip(), f"{alert['alert']}: no {key} annotation"
    runbook = annotations["runbook"]
    # concrete: where to look, not just "investigate"
    assert "kvguard report" in runbook or "/v1/" in runbook, runbook


def test_every_alert_fires_in_the_unit_tests() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())
    fired = {
        case["alertname"]
        for test in tests["tests"]
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert fired == set(EXPECTED_ALERTS)


def test_a_saturated_cache_is_unit_tested_against_every_alert() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())
    (sat,) = [t for t in tests["tests"] if t["name"] == "saturated cache does not alert"]
    ratio = [s for s in sat["input_series"]
             if s["series"].startswith("kvguard_cache_saturation_ratio")]
    assert ratio and ratio[0]["values"].startswith("0.98")
    silent = {c["alertname"] for c in sat["alert_rule_test"] if c["exp_alerts"] == []}
    assert silent == set(EXPECTED_ALERTS)
    assert all(c["exp_alerts"] == [] for c in sat["alert_rule_test"])


def test_no_rule_reads_saturation() -> None:
    """A full prefix cache is not a leak: no rule may depend on how full the cache is."""
    for alert in load_alerts():
        expr = alert["expr"]
        assert "kvguard_cache_saturation_ratio" not in expr, alert["alert"]
        assert 'state="cached"' not in expr, alert["alert"]


def _rule_metric_names() -> set[str]:
    """kvguard metrics the rules read; the file's own recorded series (``level:metric:ops``)
    are not metrics of the contract and are left out."""
    recorded = {r["record"] for r in load_rules() if "record" in r}
    names: set[str] = set()
    for rule in load_rules():
        texts = [rule["expr"], *(rule.get("annotations") or {}).values()]
        for text in texts:
            for name in recorded:
                text = text.replace(name, "")
            names |= set(METRIC_NAME.findall(text))
    return names


def test_a_pd_rule_joins_vllms_own_counter_on_the_pod_model_and_engine() -> None:
    """vLLM's NIXL counter joins kvguard's series on the labels docs/operator-guide.md documents."""
    (rule,) = [a for a in load_alerts() if a["alert"] == "KvguardKvReadAfterExpiryNotSeen"]
    assert "vllm:nixl_num_notifications_after_expiry_total" in rule["expr"]
    assert "on (namespace, pod, model_name, engine)" in rule["expr"]


def test_cross_pod_records_group_by_labels_both_roles_share() -> None:
    """Prefill and decode engines are different pods: the comparison may group only by
    labels both pods of a model have."""
    for rule in load_rules():
        if rule.get("record") in PD_RECORDS and "increase(" in rule["expr"]:
            assert "sum by (namespace, model_name)" in rule["expr"], rule["record"]


def _dashboard_metric_names() -> set[str]:
    dash = load_dashboard()
    names: set[str] = set()
    for panel in all_panels(dash):
        for target in panel.get("targets", []):
            names |= set(METRIC_NAME.findall(target["expr"]))
        names |= set(METRIC_NAME.findall(panel.get("description", "")))
        names |= set(METRIC_NAME.findall(panel.get("options", {}).get("content", "")))
    for var in dash["templating"]["list"]:
        names |= set(METRIC_NAME.findall(str(var.get("definition", ""))))
        names |= set(METRIC_NAME.findall(str(var.get("query", ""))))
    return names


def test_rules_use_only_contract_metrics() -> None:
    names = _rule_metric_names()
    assert names, "no kvguard metric found in the rules"
    assert names <= set(CONTRACT), f"not in the metric contract: {sorted(names - set(CONTRACT))}"


def test_dashboard_uses_only_contract_metrics() -> None:
    names = _dashboard_metric_names()
    assert names <= set(CONTRACT), f"not in the metric contract: {sorted(names - set(CONTRACT))}"


def test_dashboard_shows_every_contract_metric() -> None:
    dash = load_dashboard()
    queried = {
        name
        for panel in all_panels(dash)
        for target in panel.get("targets", [])
        for name in METRIC_NAME.findall(target["expr"])
    }
    assert queried == set(CONTRACT), f"no panel for: {sorted(set(CONTRACT) - queried)}"
