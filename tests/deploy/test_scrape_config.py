"""deploy/prometheus/scrape-config.yaml: valid, and its relabeling yields the labels
the dashboard groups by (`namespace`, `pod`), against a real Prometheus scraping
a real ``kvguard sidecar`` started with the Deployment's own command line.

Debian's Prometheus (the one ``scripts/bootstrap`` installs) is built without
Kubernetes service discovery, so the tests swap the ``kubernetes_sd_configs``
block for ``static_configs`` that carry the same ``__meta_kubernetes_*`` labels
a pod target has; the relabel rules under test are the file's own, unchanged.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from _deploy import (
    METRICS_PORT_NAME,
    RULE_FILE,
    SCRAPE_CONFIG,
    SIDECAR_CONTAINER,
    VENV_BIN,
    cli_options,
    container,
    require_tool,
    the_object,
)

from kvguard.testing.ports import free_loopback_port

TOKEN = "test-control-token"
NAMESPACE = "inference"
POD = "vllm-kvguard-7d9f8-abcde"
KUBERNETES_SD_KEYS = {"role", "namespaces", "selectors", "api_server", "kubeconfig_file",
                      "attach_metadata", "basic_auth", "authorization", "oauth2",
                      "tls_config", "follow_redirects", "enable_http2", "proxy_url"}


def _config() -> dict[str, Any]:
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    assert isinstance(config, dict)
    return config


def _job(config: dict[str, Any], name: str) -> dict[str, Any]:
    (job,) = [j for j in config["scrape_configs"] if j["job_name"] == name]
    return job


def _pod_target(address: str, *, pod: str, container: str, port_name: str,
                phase: str = "Running", app: str = "vllm") -> dict[str, Any]:
    """A static target with the meta labels Kubernetes pod discovery would attach."""
    return {"targets": [address], "labels": {
        "__meta_kubernetes_pod_label_app_kubernetes_io_name": app,
        "__meta_kubernetes_namespace": NAMESPACE,
        "__meta_kubernetes_pod_name": pod,
        "__meta_kubernetes_pod_container_name": container,
        "__meta_kubernetes_pod_container_port_name": port_name,
        "__meta_kubernetes_pod_phase": phase,
        "__meta_kubernetes_pod_node_name": "gpu-node-1",
        "__meta_kubernetes_pod_label_app_kubernetes_io_instance": "vllm-kvguard",
    }}


def _offline_config(sidecar: str, elsewhere: str, interval: str) -> dict[str, Any]:
    """The file's config with Kubernetes discovery replaced by equivalent static targets."""
    config = copy.deepcopy(_config())
    config["global"]["scrape_interval"] = interval
    config["global"]["evaluation_interval"] = interval
    config["global"]["scrape_timeout"] = interval
    job = _job(config, "kvguard")
    del job["kubernetes_sd_configs"]
    job["static_configs"] = [
        _pod_target(sidecar, pod=POD, container=SIDECAR_CONTAINER, port_name=METRICS_PORT_NAME),
        # vLLM's own port on the same pod: not kvguard's, must be dropped.
        _pod_target(elsewhere, pod=POD, container="vllm", port_name="http"),
        # A pod still starting: must be dropped.
        _pod_target(sidecar, pod="vllm-kvguard-7d9f8-pendng", container=SIDECAR_CONTAINER,
                    port_name=METRICS_PORT_NAME, phase="Pending"),
    ]
    # vLLM's own job: the same pod's targets; only the vllm container's http port stays.
    vllm = _job(config, "vllm")
    del vllm["kubernetes_sd_configs"]
    vllm["static_configs"] = [
        _pod_target(elsewhere, pod=POD, container="vllm", port_name="http"),
        _pod_target(sidecar, pod=POD, container=SIDECAR_CONTAINER, port_name=METRICS_PORT_NAME),
        # another application's http port: not vLLM's
        _pod_target(elsewhere, pod="web-5c4d", container="web", port_name="http", app="web"),
    ]
    # The static examples point at a sidecar (and a vLLM) on Prometheus's own host.
    static = _job(config, "kvguard-static")
    static["static_configs"][0]["targets"] = [sidecar]
    _job(config, "vllm-static")["static_configs"][0]["targets"] = [elsewhere]
    return config


def _write_config(tmp_path: Path, config: dict[str, Any]) -> Path:
    # rule_files are relative to the config file: bring the rule file along.
    for rule_file in config.get("rule_files", []):
        shutil.copy(SCRAPE_CONFIG.parent / rule_file, tmp_path / rule_file)
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)


def _status(url: str, *, method: str = "GET", token: str | None = None) -> int:
    req = urllib.request.Request(url, method=method)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _wait_until_up(url: str, proc: subprocess.Popen[bytes], log: Path, what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError):
            if _status(url) == 200:
                return
        time.sleep(0.1)
    pytest.fail(f"{what} did not answer {url} within 30 s:\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def _background(argv: list[str], log: Path, env: dict[str, str] | None = None,
                ) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real sidecar, run with the Deployment's command line (loopback, a free port)."""
    work = tmp_path_factory.mktemp("sidecar")
    run_dir = work / "run"
    run_dir.mkdir(mode=0o700)
    command = container(the_object("Deployment")["spec"]["template"]["spec"],
                        SIDECAR_CONTAINER)["command"]
    executable = VENV_BIN / command[0]
    assert executable.exists(), f"{executable} missing: pip install -e . into the venv"
    options = cli_options(command)
    assert set(options) == {"host", "port", "run-dir"}, options
    port = free_loopback_port()
    argv = [str(executable), *command[1:2], "--host=127.0.0.1", f"--port={port}",
            f"--run-dir={run_dir}"]
    env = {**os.environ, "KVGUARD_CONTROL_TOKEN": TOKEN}
    log = work / "sidecar.log"
    with _background(argv, log, env) as proc:
        _wait_until_up(f"http://127.0.0.1:{port}/healthz", proc, log, "kvguard sidecar")
        yield f"127.0.0.1:{port}"


def test_scrape_config_discovers_pods_and_keeps_only_the_named_port() -> None:
    job = _job(_config(), "kvguard")
    (sd,) = job["kubernetes_sd_configs"]
    assert sd["role"] == "pod"
    assert set(sd) <= KUBERNETES_SD_KEYS, set(sd) - KUBERNETES_SD_KEYS
    keep = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
    assert keep == [{"source_labels": ["__meta_kubernetes_pod_container_port_name"],
                     "regex": METRICS_PORT_NAME, "action": "keep"}]
    targets = {r.get("target_label"): r.get("source_labels") for r in job["relabel_configs"]}
    assert targets["namespace"] == ["__meta_kubernetes_namespace"]
    assert targets["pod"] == ["__meta_kubernetes_pod_name"]


def test_scrape_config_passes_promtool_check_config(tmp_path: Path) -> None:
    promtool = require_tool("promtool", "apt-get install prometheus (Debian)")
    # The alert rules load with it (rule_files are relative to the config file).
    assert [SCRAPE_CONFIG.parent / f for f in _config()["rule_files"]] == [RULE_FILE]
    as_is = subprocess.run([promtool, "check", "config", str(SCRAPE_CONFIG)],
                           capture_output=True, text=True, timeout=60, check=False)
    if as_is.returncode != 0:
        # Only acceptable failure: a promtool built without Kubernetes discovery.
        assert "field kubernetes_sd_configs not found" in as_is.stdout + as_is.stderr, \
            as_is.stdout + as_is.stderr
    offline = _write_config(tmp_path, _offline_config("127.0.0.1:9400", "127.0.0.1:8000",
                                                      "15s"))
    proc = subprocess.run([promtool, "check", "config", str(offline)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


def test_sidecar_started_as_in_the_manifest_serves_probes_and_guards_post(sidecar: str) -> None:
    base = f"http://{sidecar}"
    assert _status(f"{base}/healthz") == 200
    assert _status(f"{base}/metrics") == 200
    assert _status(f"{base}/v1/checkpoints", method="POST") == 401
    assert _status(f"{base}/v1/checkpoints", method="POST", token="wrong") == 403
    assert _status(f"{base}/v1/checkpoints", method="POST", token=TOKEN) == 202


def test_prometheus_scrapes_the_sidecar_with_namespace_and_pod_labels(
        sidecar: str, tmp_path: Path) -> None:
    prometheus = require_tool("prometheus", "apt-get install prometheus (Debian)")
    nobody_listens = f"127.0.0.1:{free_loopback_port()}"
    config = _write_config(tmp_path, _offline_config(sidecar, nobody_listens, "1s"))
    port = free_loopback_port()
    api = f"http://127.0.0.1:{port}/api/v1"
    argv = [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}"]
    log = tmp_path / "prometheus.log"
    with _background(argv, log) as proc:
        _wait_until_up(f"http://127.0.0.1:{port}/-/ready", proc, log, "prometheus")
        query = urllib.parse.quote('up{job=~"kvguard.*"} == 1')
        deadline = time.monotonic() + 20
        series: list[dict[str, Any]] = []
        while time.monotonic() < deadline and len(series) < 2:
            series = _get_json(f"{api}/query?query={query}")["data"]["result"]
            time.sleep(0.25)
        targets = _get_json(f"{api}/targets")["data"]
    labels = sorted((s["metric"] for s in series), key=lambda m: m["job"])
    assert len(labels) == 2, f"scraped: {labels}\n{log.read_text()[-3000:]}"
    k8s, static = labels
    assert k8s["job"] == "kvguard"
    assert (k8s["namespace"], k8s["pod"], k8s["container"]) == (NAMESPACE, POD, "kvguard")
    assert not any(name.startswith("__") for name in set(k8s) - {"__name__"})
    assert static["job"] == "kvguard-static"
    assert {"namespace", "pod"} <= set(static)
    # vLLM's port and the pending pod never become targets.
    dropped = [t["discoveredLabels"] for t in targets["droppedTargets"]
               if t["discoveredLabels"].get("job") == "kvguard"]
    assert sorted((d["__meta_kubernetes_pod_container_port_name"],
                   d["__meta_kubernetes_pod_phase"]) for d in dropped) == \
        [("http", "Running"), (METRICS_PORT_NAME, "Pending")]
    # vLLM's own /metrics: one target, the vllm container's http port, labelled with the
    # same namespace and pod as the sidecar's target (the labels kvguard's series join on).
    active = {t["labels"]["job"]: t["labels"] for t in targets["activeTargets"]}
    assert [t["labels"]["job"] for t in targets["activeTargets"]].count("vllm") == 1
    assert (active["vllm"]["namespace"], active["vllm"]["pod"], active["vllm"]["container"]) \
        == (k8s["namespace"], k8s["pod"], "vllm")
    assert (active["vllm-static"]["namespace"], active["vllm-static"]["pod"]) == \
        (static["namespace"], static["pod"])
    vllm_dropped = [t["discoveredLabels"] for t in targets["droppedTargets"]
                    if t["discoveredLabels"].get("job") == "vllm"]
    assert sorted(d["__meta_kubernetes_pod_container_name"] for d in vllm_dropped) == \
        ["kvguard", "web"]
