"""Every alert links its runbook: ``runbook_url`` points at an anchor of the shipped
``docs/runbooks.md``, the anchor exists, and the page says what the rule file says.

Anchors are computed here as GitHub computes them for a heading (lower case, spaces to
``-``, punctuation dropped), independently of the renderer.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from _deploy import REPO, RULE_FILE

RUNBOOKS = REPO / "docs" / "runbooks.md"
RENDERER = REPO / "deploy" / "prometheus" / "render_runbooks.py"
URL_BASE = "https://github.com/example/kvguard/blob/main/"
"""The documented placeholder base (deploy/prometheus/kvguard-alerts.yaml's header says to
replace it with where the docs are hosted)."""


def _alerts() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULE_FILE.read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def _github_anchor(heading: str) -> str:
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def _anchors() -> set[str]:
    text = re.sub(r"^```.*?^```", "", RUNBOOKS.read_text(), flags=re.S | re.M)
    return {_github_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def _section(alert: str) -> str:
    text = RUNBOOKS.read_text()
    start = text.index(f"\n## {alert}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def _renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_runbooks", RENDERER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("alert", _alerts(), ids=lambda a: a["alert"])
def test_every_alert_links_an_anchor_that_the_runbooks_page_has(alert: dict[str, Any]) -> None:
    url = alert["annotations"].get("runbook_url")
    assert url, f"{alert['alert']} has no runbook_url annotation"
    assert url.startswith(URL_BASE), url
    parts = urlsplit(url)
    page = url[len(URL_BASE):].split("#")[0]
    assert (REPO / page) == RUNBOOKS, url
    assert parts.fragment == alert["alert"].lower(), url
    assert parts.fragment in _anchors(), f"{url}: no such heading in {RUNBOOKS.name}"


@pytest.mark.parametrize("alert", _alerts(), ids=lambda a: a["alert"])
def test_the_runbook_section_shows_the_rules_expression_and_steps(alert: dict[str, Any]) -> None:
    section = _section(alert["alert"])
    assert f"```promql\n{alert['expr'].rstrip()}\n```" in section
    steps = re.findall(r"(?:^|\s)(\d+)\. ", alert["annotations"]["runbook"])
    listed = re.findall(r"^(\d+)\. ", section, re.M)
    assert listed == steps, (alert["alert"], listed, steps)


def test_runbooks_page_is_rendered_from_the_current_rules() -> None:
    proc = subprocess.run([sys.executable, str(RENDERER), "--check"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


def test_a_changed_rule_makes_the_page_stale() -> None:
    """The check compares with what the rules render to: a changed runbook changes it."""
    module = _renderer()
    text = RULE_FILE.read_text()
    changed = text.replace("1. Treat as urgent", "1. Treat as very urgent", 1)
    assert changed != text
    assert module.render(changed) != RUNBOOKS.read_text()
    assert module.render(text) == RUNBOOKS.read_text()
