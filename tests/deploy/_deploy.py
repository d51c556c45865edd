"""Paths and helpers shared by the deploy/ tests.

Every tool these tests use must be present: a missing one fails the test that
needs it, with the way to install it; nothing is skipped.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"
BASE = K8S / "base"
"""The base kustomization (``kubectl apply -k deploy/kubernetes`` applies it); ``pd/`` is an
overlay of it."""
RULE_FILE = DEPLOY / "prometheus" / "kvguard-alerts.yaml"
SCRAPE_CONFIG = DEPLOY / "prometheus" / "scrape-config.yaml"
YAMLLINT_CONFIG = DEPLOY / ".yamllint"
VENV_BIN = Path(sys.executable).parent

METRICS_PORT_NAME = "kvguard-metrics"
SIDECAR_CONTAINER = "kvguard"
VLLM_CONTAINER = "vllm"


def load_documents(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for doc in docs:
        assert isinstance(doc, dict), f"{path}: a document is not a mapping"
    return docs


def manifest_files() -> list[Path]:
    """Every Kubernetes object file of the base and its examples (not the kustomizations,
    not the P/D overlay: tests/deploy/test_pd_manifests.py renders that)."""
    return sorted(p for p in [*K8S.glob("*.yaml"), *BASE.glob("*.yaml")]
                  if p.name != "kustomization.yaml")


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """The objects the real ``kubectl kustomize`` renders from ``directory``."""
    kubectl = require_tool("kubectl", "install kubectl (v1.32 bundles kustomize v5)")
    proc = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d is not None]
    assert all(isinstance(d, dict) for d in docs)
    return docs


def all_objects() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in manifest_files() for doc in load_documents(path)]


def the_object(kind: str) -> dict[str, Any]:
    found = [doc for _, doc in all_objects() if doc.get("kind") == kind]
    assert len(found) == 1, f"expected exactly one {kind} in {K8S}, found {len(found)}"
    return found[0]


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in pod_spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"expected one container named {name!r}"
    return found[0]


def cli_options(argv: list[str]) -> dict[str, str]:
    """``--key=value`` and ``--key value`` options of a command line."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--"):
            if "=" in arg:
                key, value = arg[2:].split("=", 1)
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                key, value = arg[2:], argv[i + 1]
                i += 1
            else:
                key, value = arg[2:], ""
            out[key] = value
        i += 1
    return out


def require_tool(name: str, how: str) -> str:
    path = shutil.which(name) or (str(VENV_BIN / name) if (VENV_BIN / name).exists() else None)
    if path is None:
        pytest.fail(f"`{name}` is required by the deploy tests and was not found: {how}")
    return path


def render_module() -> ModuleType:
    """deploy/kubernetes/render_prometheusrule.py, imported from its path."""
    path = K8S / "render_prometheusrule.py"
    spec = importlib.util.spec_from_file_location("render_prometheusrule", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
