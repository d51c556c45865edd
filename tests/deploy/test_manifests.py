"""deploy/kubernetes: every manifest is valid, strictly, and wired together.

Plain objects go through kubernetes-validate in strict mode (unknown fields
fail); the prometheus-operator objects, which it does not know, through the
pydantic models of cloudcoil-models-prometheus-operator, with the input
compared to the model's dump because those models drop unknown fields; the
PrometheusRule's spec through `promtool check rules`; everything under deploy/
through yamllint.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from _deploy import (
    BASE,
    DEPLOY,
    K8S,
    METRICS_PORT_NAME,
    RULE_FILE,
    SIDECAR_CONTAINER,
    VLLM_CONTAINER,
    YAMLLINT_CONFIG,
    all_objects,
    cli_options,
    container,
    kustomize,
    load_documents,
    manifest_files,
    render_module,
    require_tool,
    the_object,
)
from cloudcoil.models.prometheus_operator.v1 import PrometheusRule, ServiceMonitor
from pydantic import BaseModel
from yamllint import linter
from yamllint.config import YamlLintConfig

PLAIN_KINDS = {"Deployment", "Service", "Secret", "NetworkPolicy"}
CRD_MODELS: dict[str, type[BaseModel]] = {
    "ServiceMonitor": ServiceMonitor,
    "PrometheusRule": PrometheusRule,
}
# The oldest Kubernetes these manifests promise to work on, and the newest the
# validator knows.
K8S_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]
RUN_DIR = "/run/kvguard"
# Never deploy a known token; the Prometheus namespace differs between clusters.
NOT_IN_KUSTOMIZATION = {"secret-example.yaml", "networkpolicy-example.yaml"}


def _plain_objects() -> list[Any]:
    return [pytest.param(doc, id=f"{path.name}:{doc['kind']}")
            for path, doc in all_objects() if doc["kind"] in PLAIN_KINDS]


def _crd_objects() -> list[Any]:
    return [pytest.param(doc, id=f"{path.name}:{doc['kind']}")
            for path, doc in all_objects() if doc["kind"] in CRD_MODELS]


def _pod_spec() -> dict[str, Any]:
    return the_object("Deployment")["spec"]["template"]["spec"]


def _sidecar() -> dict[str, Any]:
    return container(_pod_spec(), SIDECAR_CONTAINER)


def _vllm() -> dict[str, Any]:
    return container(_pod_spec(), VLLM_CONTAINER)


def _env(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def _model_roundtrip(model: type[BaseModel], doc: dict[str, Any]) -> dict[str, Any]:
    return model.model_validate(doc).model_dump(mode="json", by_alias=True, exclude_unset=True)


# --- every object is checked by some validator -------------------------------------------------

def test_every_manifest_is_a_known_kind_so_none_escapes_validation() -> None:
    objects = all_objects()
    assert objects, f"no manifests in {K8S}"
    for path, doc in objects:
        assert doc.get("kind") in PLAIN_KINDS | set(CRD_MODELS), \
            f"{path.name}: kind {doc.get('kind')!r} has no validator in this test"
    kinds = sorted(doc["kind"] for _, doc in objects)
    assert kinds == sorted(["Deployment", "Service", "Secret", "NetworkPolicy",
                            "ServiceMonitor", "PrometheusRule"])


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("doc", _plain_objects())
def test_plain_manifest_passes_kubernetes_validate_strict(doc: dict[str, Any],
                                                          version: str) -> None:
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} against {version}: "
                    f"{path}: {exc.message}")


def test_kubernetes_validate_strict_rejects_a_misspelled_field() -> None:
    doc = copy.deepcopy(the_object("Deployment"))
    doc["spec"]["template"]["spec"]["containers"][1]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSIONS[-1], strict=True)


def test_kubernetes_validate_cli_passes_the_plain_manifest_files() -> None:
    cli = require_tool("kubernetes-validate", "pip install kubernetes-validate")
    files = [str(p) for p in manifest_files()
             if {d["kind"] for d in load_documents(p)} <= PLAIN_KINDS]
    proc = subprocess.run([cli, "--strict", *files], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARN" not in proc.stdout and "ERROR" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("doc", _crd_objects())
def test_prometheus_operator_object_matches_its_model_exactly(doc: dict[str, Any]) -> None:
    dumped = _model_roundtrip(CRD_MODELS[doc["kind"]], doc)
    # The models ignore unknown fields: a misspelled one vanishes from the dump.
    assert dumped == doc


def test_model_comparison_catches_a_misspelled_servicemonitor_field() -> None:
    doc = copy.deepcopy(the_object("ServiceMonitor"))
    doc["spec"]["endpoints"][0]["scrapeInterval"] = "15s"  # the field is `interval`
    assert _model_roundtrip(ServiceMonitor, doc) != doc


# --- PrometheusRule = the plain rule file ------------------------------------------------------

def test_prometheusrule_spec_is_exactly_the_alert_rule_file() -> None:
    assert RULE_FILE.exists(), f"{RULE_FILE} is missing"
    assert the_object("PrometheusRule")["spec"] == yaml.safe_load(RULE_FILE.read_text())


def test_prometheusrule_is_up_to_date_with_its_renderer() -> None:
    render = render_module()
    assert render.render(RULE_FILE.read_text()) == (BASE / "prometheusrule.yaml").read_text(), \
        "deploy/kubernetes/base/prometheusrule.yaml is stale: run " \
        "python deploy/kubernetes/render_prometheusrule.py"
    proc = subprocess.run([sys.executable, str(K8S / "render_prometheusrule.py"), "--check"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr


def test_prometheusrule_spec_passes_promtool_check_rules(tmp_path: Path) -> None:
    promtool = require_tool("promtool", "apt-get install prometheus (Debian)")
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(the_object("PrometheusRule")["spec"], sort_keys=False))
    proc = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


def test_promtool_check_rules_rejects_a_broken_expression(tmp_path: Path) -> None:
    promtool = require_tool("promtool", "apt-get install prometheus (Debian)")
    spec = copy.deepcopy(the_object("PrometheusRule")["spec"])
    spec["groups"][0]["rules"][0]["expr"] = "kvguard_leaked_blocks >"
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(spec))
    proc = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode != 0


# --- the pod: plugin, shared volume, sidecar ---------------------------------------------------

def test_vllm_container_loads_the_plugin_and_publishes_to_the_run_dir() -> None:
    vllm = _vllm()
    assert vllm["command"][:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    env = _env(vllm)
    assert "kvguard" in env["VLLM_PLUGINS"]["value"].split(",")
    assert env["KVGUARD_RUN_DIR"]["value"] == RUN_DIR


def test_shared_memory_volume_is_mounted_at_the_run_dir_in_both_containers() -> None:
    pod = _pod_spec()
    run_dir = _env(_vllm())["KVGUARD_RUN_DIR"]["value"]
    assert cli_options(_sidecar()["command"])["run-dir"] == run_dir
    mounts = {c["name"]: {m["mountPath"]: m for m in c.get("volumeMounts", [])}
              for c in pod["containers"]}
    vllm_mount = mounts[VLLM_CONTAINER][run_dir]
    sidecar_mount = mounts[SIDECAR_CONTAINER][run_dir]
    assert vllm_mount["name"] == sidecar_mount["name"]
    # The engine writes state there; the sidecar writes checkpoint requests there.
    assert not vllm_mount.get("readOnly") and not sidecar_mount.get("readOnly")
    volume = next(v for v in pod["volumes"] if v["name"] == vllm_mount["name"])
    assert volume["emptyDir"]["medium"] == "Memory"


def test_both_containers_run_as_the_same_uid_so_the_0600_state_files_are_readable() -> None:
    pod = _pod_spec()
    uids = {c["name"]: c.get("securityContext", {}).get("runAsUser",
                                                          pod["securityContext"].get("runAsUser"))
            for c in pod["containers"]}
    assert uids[VLLM_CONTAINER] is not None
    assert uids[VLLM_CONTAINER] == uids[SIDECAR_CONTAINER] != 0


def test_sidecar_listens_on_the_pod_ip_at_its_named_metrics_port() -> None:
    sidecar = _sidecar()
    assert sidecar["command"][:2] == ["kvguard", "sidecar"]
    options = cli_options(sidecar["command"])
    # Default is 127.0.0.1; Prometheus scrapes the pod IP, so 0.0.0.0 on purpose.
    assert options["host"] == "0.0.0.0"
    ports = {p["name"]: p for p in sidecar["ports"]}
    assert ports[METRICS_PORT_NAME]["containerPort"] == int(options["port"])


@pytest.mark.parametrize(("probe", "path"), [("livenessProbe", "/healthz"),
                                           ("readinessProbe", "/v1/ready")])
def test_sidecar_probe_hits_its_path_on_the_metrics_port(probe: str, path: str) -> None:
    """Liveness: the sidecar serves. Readiness: the engine is neither wedged nor silent
    (the pod leaves the Service's endpoints, the sidecar is not restarted)."""
    sidecar = _sidecar()
    get = sidecar[probe]["httpGet"]
    assert get["path"] == path
    by_name = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    port = by_name[get["port"]] if isinstance(get["port"], str) else get["port"]
    assert port == by_name[METRICS_PORT_NAME]


def test_sidecar_is_locked_down_and_bounded() -> None:
    pod = _pod_spec()
    sidecar = _sidecar()
    ctx = sidecar["securityContext"]
    assert ctx.get("runAsNonRoot", pod["securityContext"].get("runAsNonRoot")) is True
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"]["drop"] == ["ALL"]
    assert "add" not in ctx["capabilities"]
    for bound in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(sidecar["resources"][bound]), bound


def test_control_token_comes_from_the_example_secrets_name_and_key() -> None:
    token = _env(_sidecar())["KVGUARD_CONTROL_TOKEN"]["valueFrom"]["secretKeyRef"]
    secret = the_object("Secret")
    assert token["name"] == secret["metadata"]["name"]
    assert token["key"] in secret["stringData"]
    assert token.get("optional") is False, "the sidecar must not start without its token"
    assert "REPLACE" in secret["stringData"][token["key"]], "the example must not look real"


def test_images_are_pinned_placeholders() -> None:
    for c in _pod_spec()["containers"]:
        image = c["image"]
        assert image.startswith("ghcr.io/example/"), image
        assert ":" in image and not image.endswith(":latest"), image


# --- Service and ServiceMonitor wiring ---------------------------------------------------------

def test_service_selects_the_pods_and_exposes_both_named_ports() -> None:
    service = the_object("Service")
    pod_labels = the_object("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    container_ports = {p["name"]: (c["name"], p["containerPort"])
                       for c in _pod_spec()["containers"] for p in c.get("ports", [])}
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports[METRICS_PORT_NAME]["targetPort"] == METRICS_PORT_NAME
    assert container_ports[METRICS_PORT_NAME][0] == SIDECAR_CONTAINER
    assert container_ports[ports["http"]["targetPort"]][0] == VLLM_CONTAINER


def test_servicemonitor_scrapes_the_sidecar_and_vllms_own_metrics_of_that_service() -> None:
    """Two endpoints of the same pods: the sidecar's port (job kvguard, which
    KvguardSidecarDown watches) and vLLM's API port (job vllm), both at /metrics, so that
    the operator gives both targets the pod's namespace and pod labels to join on."""
    monitor = the_object("ServiceMonitor")
    service = the_object("Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        service["metadata"]["labels"].items()
    assert "namespaceSelector" not in monitor["spec"]  # same namespace as the Service
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    container_of = {p["name"]: c["name"] for c in _pod_spec()["containers"]
                    for p in c.get("ports", [])}
    jobs = {}
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint.get("path", "/metrics") == "/metrics"
        target = service_ports[endpoint["port"]]["targetPort"]
        (relabel,) = endpoint["relabelings"]
        assert relabel["targetLabel"] == "job" and relabel.get("action", "replace") == "replace"
        jobs[container_of[target]] = relabel["replacement"]
    assert jobs == {SIDECAR_CONTAINER: "kvguard", VLLM_CONTAINER: "vllm"}


def test_network_policy_example_guards_the_metrics_port_of_these_pods() -> None:
    policy = the_object("NetworkPolicy")["spec"]
    pod_labels = the_object("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= pod_labels.items()
    open_ports = {p["port"] for rule in policy["ingress"] if "from" not in rule
                  for p in rule["ports"]}
    guarded = {p["port"] for rule in policy["ingress"] if rule.get("from")
               for p in rule["ports"]}
    assert open_ports == {"http"}
    assert guarded == {METRICS_PORT_NAME}


def test_kustomization_lists_every_manifest_but_the_examples() -> None:
    (top,) = load_documents(K8S / "kustomization.yaml")
    assert top["kind"] == "Kustomization" and top["resources"] == ["base"]
    (kustomization,) = load_documents(BASE / "kustomization.yaml")
    assert kustomization["kind"] == "Kustomization"
    listed = kustomization["resources"]
    assert len(listed) == len(set(listed))
    expected = {p.name for p in manifest_files()} - NOT_IN_KUSTOMIZATION
    assert set(listed) == expected
    assert {p.name for p in BASE.glob("*.yaml")} - {"kustomization.yaml"} == expected


def test_kubectl_kustomize_renders_the_base_unchanged() -> None:
    """``kubectl apply -k deploy/kubernetes`` applies exactly the base's files."""
    rendered = kustomize(K8S)
    files = [doc for p in manifest_files() if p.name not in NOT_IN_KUSTOMIZATION
             for doc in load_documents(p)]
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(rendered, key=key) == sorted(files, key=key)


# --- style -------------------------------------------------------------------------------------

def test_yamllint_passes_on_every_yaml_file_under_deploy() -> None:
    config = YamlLintConfig(file=str(YAMLLINT_CONFIG))
    files = sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")])
    assert files
    problems = [f"{path.relative_to(DEPLOY)}:{p.line}:{p.column}: {p.level}: {p.desc} ({p.rule})"
                for path in files
                for p in linter.run(path.read_text(), config, str(path))]
    assert problems == []
