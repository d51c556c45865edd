"""The docs agree with what kvguard exports and ships: every metric name, alert name and
dashboard variable the docs mention exists, and every exported metric and shipped alert is
documented.

What is exported is the metric contract of ``_obs_contract`` (``CONTRACT``, ``OPERATIONAL``),
which ``test_dashboard_queries.test_target_exposes_the_contract`` checks against a real
sidecar reading real engines; what is shipped is the rule file and the dashboard.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _obs_contract import CONTRACT, OPERATIONAL, REPO, load_alerts, load_dashboard, load_rules

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "deploy" / "README.md"]
OPERATOR_GUIDE = REPO / "docs" / "operator-guide.md"
NOT_METRICS = {
    "kvguard_version": "a label of kvguard_engine_info",
    "kvguard_complete_after_steps": "a key of the test offload spec's kv_connector_extra_config",
    "kvguard_lose_store_every": "a key of the test offload spec's kv_connector_extra_config",
    "kvguard_lose_load_every": "a key of the test offload spec's kv_connector_extra_config",
}
_METRIC = re.compile(r"\bkvguard_[a-z0-9_]+\b")
_ALERT = re.compile(r"\bKvguard[A-Z][A-Za-z]+\b")
_NAMES = r"((?:`[a-z_]+`(?:, | and |/|, and )?)+)"
_VARIABLES = [re.compile(r"variables?(?: are|:)? " + _NAMES), re.compile(_NAMES + r"\s+variables")]


def _exported() -> set[str]:
    """Sample names as a scrape shows them (counters with ``_total``)."""
    return {n + "_total" if m.type == "counter" and not n.endswith("_total") else n
            for n, m in {**CONTRACT, **OPERATIONAL}.items()}


def _text(doc: Path) -> str:
    text = doc.read_text()
    for rule in load_rules():  # recorded series (level:metric:ops) are not metric names
        if "record" in rule:
            text = text.replace(rule["record"], "")
    return text


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(REPO).as_posix())
def test_every_metric_name_in_the_docs_is_exported(doc: Path) -> None:
    exported = _exported()
    for name in set(_METRIC.findall(_text(doc))):
        if name.endswith("_"):  # a family, as in `kvguard_kv_*`
            assert any(m.startswith(name) for m in exported), f"{doc.name}: {name}*"
        else:
            assert name in exported or name in NOT_METRICS, \
                f"{doc.name} names {name}, which kvguard does not export"


def test_every_exported_metric_is_documented() -> None:
    """Named in the docs, and in the operator guide at least by its family (the KV-event
    mirror's series are listed in docs/kv-events.md, the guide names `kvguard_kv_events_*`)."""
    named = {n for doc in DOCS for n in _METRIC.findall(_text(doc))}
    assert not _exported() - named, sorted(_exported() - named)
    guide = set(_METRIC.findall(_text(OPERATOR_GUIDE)))
    missing = {m for m in _exported() if not any(m == n or (n.endswith("_") and
                                                            m.startswith(n)) for n in guide)}
    assert not missing, f"not in {OPERATOR_GUIDE.name}: {sorted(missing)}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.relative_to(REPO).as_posix())
def test_every_alert_name_in_the_docs_is_shipped(doc: Path) -> None:
    shipped = {a["alert"] for a in load_alerts()}
    unknown = set(_ALERT.findall(doc.read_text())) - shipped
    assert not unknown, f"{doc.name} names alerts the rule file does not have: {unknown}"


def test_every_shipped_alert_is_in_the_operator_guide() -> None:
    missing = {a["alert"] for a in load_alerts()} - set(_ALERT.findall(OPERATOR_GUIDE.read_text()))
    assert not missing, missing


def _documented_variables() -> list[tuple[str, set[str]]]:
    found = []
    for doc in DOCS:
        text = " ".join(doc.read_text().split())
        for pattern in _VARIABLES:
            for m in pattern.finditer(text):
                found.append((doc.name, set(re.findall(r"`([a-z_]+)`", m.group(1)))))
    return found


def test_dashboard_variables_in_the_docs_are_the_dashboards() -> None:
    """Wherever the docs list the dashboard's variables, the list is the dashboard's own
    label variables (the data-source variable may be left out)."""
    variables = {v["name"] for v in load_dashboard()["templating"]["list"]}
    labels = variables - {"datasource"}
    mentions = [(doc, names) for doc, names in _documented_variables()
                if names & labels]
    assert {doc for doc, _ in mentions} >= {"operator-guide.md", "README.md"}, mentions
    for doc, names in mentions:
        assert labels <= names <= variables, (doc, sorted(names), sorted(variables))
