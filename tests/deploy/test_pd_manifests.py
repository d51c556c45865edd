"""deploy/kubernetes/pd: the P/D example is valid, strictly, and wired to the base's scrape."""

from __future__ import annotations

import json
from typing import Any

import kubernetes_validate
import pytest
from _deploy import K8S, container, load_documents, the_object

PD = K8S / "pd"


def _docs() -> list[dict[str, Any]]:
    return load_documents(PD / "pd-pair.yaml")


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("version", ["1.29.0", kubernetes_validate.latest_version()])
def test_every_pd_object_validates_strictly(version: str) -> None:
    for doc in _docs():
        kubernetes_validate.validate(doc, version, strict=True)


def test_one_prefill_and_one_decode_pod_each_scraped_by_the_base_service_monitor() -> None:
    docs = _docs()
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    services = [d for d in docs if d["kind"] == "Service"]
    monitor = the_object("ServiceMonitor")["spec"]["selector"]["matchLabels"]
    base_service = the_object("Service")["spec"]["selector"]
    roles = {}
    for dep in deployments.values():
        pod = dep["spec"]["template"]
        vllm = container(pod["spec"], "vllm")
        cfg = json.loads(next(a.split("=", 1)[1] for a in vllm["args"]
                              if a.startswith("--kv-transfer-config=")))
        env = {e["name"]: e.get("value") for e in vllm["env"]}
        roles[env["KVGUARD_ENGINE_NAME"]] = cfg["kv_role"]
        assert cfg["kv_connector"] == "NixlConnector"
        assert env["VLLM_PLUGINS"] == "kvguard" and env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
        assert container(pod["spec"], "kvguard")  # its own sidecar
        # Exactly one pd Service selects this pod; the base Service selects none of them.
        assert sum(_selects(s["spec"]["selector"], pod["metadata"]["labels"])
                   for s in services) == 1
        assert not _selects(base_service, pod["metadata"]["labels"])
    assert roles == {"prefill": "kv_producer", "decode": "kv_consumer"}
    for s in services:
        assert _selects(monitor, s["metadata"]["labels"])  # one Prometheus scrapes both
        assert {p["name"] for p in s["spec"]["ports"]} >= {"kvguard-metrics", "nixl-side"}
