"""deploy/kubernetes/pd: an overlay of the base, rendered by the real ``kubectl kustomize``.

The rendered objects are validated as the base's are (``kubernetes-validate --strict``
for the plain kinds, the prometheus-operator models for the CRDs, ``promtool`` through
the base's tests for the rule file), and compared with the base they come from: the
overlay may change only what makes a pod a prefill or decode engine.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import kubernetes_validate
import pytest
import yaml
from _deploy import BASE, K8S, RULE_FILE, container, kustomize, load_documents
from test_manifests import CRD_MODELS, K8S_VERSIONS, PLAIN_KINDS, _model_roundtrip

PD = K8S / "pd"
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
NIXL_PORT = 5600


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return kustomize(PD)


def _base(kind: str) -> dict[str, Any]:
    (doc,) = [d for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml"
              for d in load_documents(p) if d["kind"] == kind]
    return doc


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_the_overlay_uses_the_base_and_copies_no_manifest() -> None:
    """Every kustomization under pd/ names the base (or a component) as a directory; the
    only Kubernetes object file under pd/ is the pair's NetworkPolicy, a kind the base does
    not render."""
    files = sorted(PD.rglob("*.yaml"))
    assert {p.relative_to(PD).as_posix() for p in files if p.name != "kustomization.yaml"} \
        == {"networkpolicy.yaml"}, files
    assert [d["kind"] for d in load_documents(PD / "networkpolicy.yaml")] == ["NetworkPolicy"]
    assert "NetworkPolicy" not in {d["kind"] for d in kustomize(BASE)}
    kustomizations = [p for p in files if p.name == "kustomization.yaml"]
    bases = {r for p in kustomizations for r in (load_documents(p)[0].get("resources") or [])}
    assert "../../base" in bases


def test_renders_two_roles_and_the_monitoring_once(rendered: list[dict[str, Any]]) -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in rendered)
    assert kinds == sorted([
        ("Deployment", "vllm-kvguard-prefill"), ("Deployment", "vllm-kvguard-decode"),
        ("Service", "vllm-kvguard-prefill"), ("Service", "vllm-kvguard-decode"),
        ("ServiceMonitor", "vllm-kvguard"), ("PrometheusRule", "kvguard"),
        ("NetworkPolicy", "vllm-kvguard-pd")])


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_rendered_plain_object_validates_strictly(rendered: list[dict[str, Any]],
                                                        version: str) -> None:
    plain = [d for d in rendered if d["kind"] in PLAIN_KINDS]
    assert len(plain) == 5
    for doc in plain:
        kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_catches_a_misspelled_field_in_the_rendering(
        rendered: list[dict[str, Any]]) -> None:
    doc = copy.deepcopy(_one(rendered, "Deployment", "vllm-kvguard-decode"))
    container(doc["spec"]["template"]["spec"], "vllm")["env"][0]["valueFrm"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


def test_rendered_crds_match_their_models_and_equal_the_base(
        rendered: list[dict[str, Any]]) -> None:
    for kind, model in CRD_MODELS.items():
        (doc,) = [d for d in rendered if d["kind"] == kind]
        assert _model_roundtrip(model, doc) == doc
        assert doc == _base(kind), f"the overlay changed the base's {kind}"
    rule = _one(rendered, "PrometheusRule", "kvguard")
    assert rule["spec"] == yaml.safe_load(RULE_FILE.read_text())


def _kv_transfer_config(vllm: dict[str, Any]) -> dict[str, Any]:
    (arg,) = [a for a in vllm["args"] if a.startswith("--kv-transfer-config=")]
    cfg: dict[str, Any] = json.loads(arg.split("=", 1)[1])
    return cfg


@pytest.mark.parametrize("role", ROLES)
def test_each_role_is_the_base_pod_plus_nixl_and_its_kv_role(
        rendered: list[dict[str, Any]], role: str) -> None:
    """The role's Deployment equals the base's but for its name, its component label
    (selector and template), the --kv-transfer-config argument, the NIXL side channel's
    env and container port, UCX's env (vLLM's NixlConnector guide: UCX_TLS,
    UCX_NET_DEVICES) and the vllm container's IPC_LOCK (RDMA pins the KV cache)."""
    dep = copy.deepcopy(_one(rendered, "Deployment", f"vllm-kvguard-{role}"))
    pod = dep["spec"]["template"]
    vllm = container(pod["spec"], "vllm")
    cfg = _kv_transfer_config(vllm)
    assert cfg["kv_connector"] == "NixlConnector" and cfg["kv_role"] == ROLES[role]
    assert cfg["kv_connector_extra_config"]["kv_lease_duration"] > 0
    env = {e["name"]: e for e in vllm["env"]}
    assert env["VLLM_PLUGINS"]["value"] == "kvguard"
    assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"]["valueFrom"] == {
        "fieldRef": {"fieldPath": "status.podIP"}}
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"] == str(NIXL_PORT)
    assert "KVGUARD_ENGINE_NAME" not in env  # the fleet-unique default: pod name + -dp<rank>
    assert {"name": "nixl-side", "containerPort": NIXL_PORT, "protocol": "TCP"} in vllm["ports"]
    assert container(pod["spec"], "kvguard")  # its own sidecar
    assert env["UCX_TLS"]["value"] and env["UCX_NET_DEVICES"]["value"]
    caps = vllm["securityContext"]["capabilities"]
    assert caps == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert "add" not in container(pod["spec"], "kvguard")["securityContext"]["capabilities"]
    # Undo exactly the overlay's changes: what is left is the base's Deployment.
    del caps["add"]
    vllm["args"] = [a for a in vllm["args"] if not a.startswith("--kv-transfer-config=")]
    vllm["env"] = [e for e in vllm["env"]
                   if not e["name"].startswith(("VLLM_NIXL_", "UCX_"))]
    vllm["ports"] = [p for p in vllm["ports"] if p["name"] != "nixl-side"]
    base = _base("Deployment")
    for labels in (dep["metadata"]["labels"], pod["metadata"]["labels"],
                   dep["spec"]["selector"]["matchLabels"]):
        assert labels.pop("app.kubernetes.io/component") == role
    for labels in (base["metadata"]["labels"], base["spec"]["template"]["metadata"]["labels"],
                   base["spec"]["selector"]["matchLabels"]):
        labels.pop("app.kubernetes.io/component", None)
    dep["metadata"]["name"] = base["metadata"]["name"]
    assert dep == base


def test_each_service_selects_its_role_only_and_the_base_monitor_scrapes_both(
        rendered: list[dict[str, Any]]) -> None:
    monitor = _one(rendered, "ServiceMonitor", "vllm-kvguard")["spec"]
    pods = {r: _one(rendered, "Deployment", f"vllm-kvguard-{r}")["spec"]["template"]
            for r in ROLES}
    for role in ROLES:
        svc = _one(rendered, "Service", f"vllm-kvguard-{role}")
        selected = [r for r, pod in pods.items()
                    if _selects(svc["spec"]["selector"], pod["metadata"]["labels"])]
        assert selected == [role]
        dep = _one(rendered, "Deployment", f"vllm-kvguard-{role}")
        assert _selects(dep["spec"]["selector"]["matchLabels"], pods[role]["metadata"]["labels"])
        assert _selects(monitor["selector"]["matchLabels"], svc["metadata"]["labels"])
        ports = {p["name"]: p for p in svc["spec"]["ports"]}
        assert {e["port"] for e in monitor["endpoints"]} <= set(ports)  # kvguard-metrics
        assert ports["nixl-side"]["port"] == NIXL_PORT


def test_the_decode_side_reaches_the_prefill_side_channel_on_the_pod_ip(
        rendered: list[dict[str, Any]]) -> None:
    """NIXL's side channel is announced at VLLM_NIXL_SIDE_CHANNEL_HOST: the pod IP, so a
    decode pod on another node reaches it; the port the env names is a container port."""
    for role in ROLES:
        vllm = container(_one(rendered, "Deployment", f"vllm-kvguard-{role}")
                         ["spec"]["template"]["spec"], "vllm")
        env = {e["name"]: e for e in vllm["env"]}
        port = int(env["VLLM_NIXL_SIDE_CHANNEL_PORT"]["value"])
        assert port in {p["containerPort"] for p in vllm["ports"]}


def _selected(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels, matchExpressions with In) against a pod's labels."""
    if not _selects(selector.get("matchLabels", {}), labels):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def _admits(policy: dict[str, Any], source: dict[str, str] | None, port: int,
            named: dict[str, int]) -> bool:
    """Whether an ingress rule admits TCP ``port`` from a pod with labels ``source`` in
    the policy's namespace (None: a client outside it, e.g. Prometheus's namespace)."""
    for rule in policy["spec"]["ingress"]:
        peers = rule.get("from")
        if peers is not None and not any(
                "podSelector" in p and source is not None and _selected(p["podSelector"], source)
                for p in peers):
            continue
        for p in rule["ports"]:
            assert p.get("protocol", "TCP") == "TCP"
            low = named[p["port"]] if isinstance(p["port"], str) else p["port"]
            if low <= port <= p.get("endPort", low):
                return True
    return False


def test_the_pairs_network_policy_admits_nixl_and_ucx_between_prefill_and_decode_only(
        rendered: list[dict[str, Any]]) -> None:
    """NIXL's side channel and UCX's TCP data ports are open between the pair's pods and
    closed to any other pod; vLLM's API stays open; the sidecar's metrics only to the
    pair and to Prometheus's namespace."""
    policy = _one(rendered, "NetworkPolicy", "vllm-kvguard-pd")
    pods = {r: _one(rendered, "Deployment", f"vllm-kvguard-{r}")["spec"]["template"]
            for r in ROLES}
    for pod in pods.values():
        assert _selected(policy["spec"]["podSelector"], pod["metadata"]["labels"])
    named = {p["name"]: p["containerPort"] for pod in pods.values()
             for c in pod["spec"]["containers"] for p in c.get("ports", [])}
    assert named["nixl-side"] == NIXL_PORT
    decode = pods["decode"]["metadata"]["labels"]
    prefill = pods["prefill"]["metadata"]["labels"]
    stranger = {"app.kubernetes.io/name": "web"}
    same_app_other_instance = {**decode, "app.kubernetes.io/instance": "another"}
    ucx_port = 41234
    for source in (decode, prefill):
        assert _admits(policy, source, NIXL_PORT, named)
        assert _admits(policy, source, ucx_port, named)
        assert _admits(policy, source, named["kvguard-metrics"], named)
    for source in (stranger, same_app_other_instance, None):
        assert not _admits(policy, source, NIXL_PORT, named)
        assert not _admits(policy, source, ucx_port, named)
        assert _admits(policy, source, named["http"], named)
    assert not _admits(policy, stranger, named["kvguard-metrics"], named)
    (metrics_rule,) = [r for r in policy["spec"]["ingress"]
                       if {p["port"] for p in r["ports"]} == {"kvguard-metrics"}]
    assert {"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}} in metrics_rule["from"]
