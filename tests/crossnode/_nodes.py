"""What runs on each of the two nodes (``_netns``): a vLLM server, a kvguard sidecar, and
on the decode node a Prometheus and the P/D proxy. Every process binds its node's own
address and is stopped by its pid (or process group)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from _netns import Node, TwoNodes, entered

from kvguard.testing.engine import ServerProcess
from kvguard.testing.hang import raise_if_hung

PD_DIR = Path(__file__).resolve().parents[1] / "pd"
"""The P/D pair and its proxy live with their tests (``tests/pd``), not in the package."""
sys.path.insert(0, str(PD_DIR))
from pd_pair import START_TIMEOUT_SECONDS, THREAD_LIMITS, nixl_spec  # noqa: E402

WAIT_SECONDS = 180.0
"""The longest any one wait may take on 2 loaded cores."""
LEASE_SECONDS = 12
NIXL_SIDE_CHANNEL_PORT = 5600
SIDECAR_PORT = 9400
PROXY_PORT = 8100
PROMETHEUS_PORT = 9090


def get(node: Node, url: str, *, timeout: float = 30.0) -> bytes:
    """GET ``url`` from ``node`` (this thread enters its namespace for the request)."""
    with entered(node.netns), urllib.request.urlopen(url, timeout=timeout) as resp:
        body: bytes = resp.read()
        return body


def get_json(node: Node, url: str) -> Any:
    return json.loads(get(node, url))


def post_json(node: Node, url: str, body: Mapping[str, Any],
              headers: Mapping[str, str] | None = None, *, timeout: float = WAIT_SECONDS) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json", **(headers or {})})
    with entered(node.netns), urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def until(what: str, cond: Callable[[], Any], timeout: float = WAIT_SECONDS) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        raise_if_hung(what)  # a server the hang watch stopped never answers again
        try:
            v = cond()
        except (TimeoutError, urllib.error.URLError, ConnectionError):
            v = None
        if v:
            return v
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def start_servers(nodes: TwoNodes, model_dir: Path, work: Path, *, scheduler_cls: str,
                  env: Mapping[str, Mapping[str, str]],
                  extra: Mapping[str, Any] | None = None) -> dict[str, ServerProcess]:
    """The prefill server on the prefill node and the decode server on the decode node,
    started at once, each from a thread in its own namespace, each with its own run dir.

    NIXL crosses the veth only with ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES`` set to the
    node's veth: with UCX's defaults both namespaces look like one host, UCX reads the
    peer's memory directly and nothing crosses the link (measured: requests stalled
    10-21 s with lapsed leases). UCX finds the device in ``/sys/class/net``, which only
    ``ip netns exec`` shows as the node's (it mounts the namespace's own ``/sys``): the
    server is started through it, from a thread in the node (for the health checks)."""
    servers: dict[str, ServerProcess] = {}
    errors: list[BaseException] = []
    for name, role, node, core in (("prefill", "kv_producer", nodes.prefill, "0"),
                                   ("decode", "kv_consumer", nodes.decode, "1")):
        spec = nixl_spec(model_dir, role, lease_seconds=LEASE_SECONDS,
                         scheduler_cls=scheduler_cls)
        if extra:
            spec = type(spec)(**{**spec.__dict__, "extra": {**spec.extra, **extra}})
        servers[name] = ServerProcess(
            spec, log_path=work / "logs" / f"{name}.log", host=node.address,
            command_prefix=("ip", "netns", "exec", node.netns),
            health_timeout_seconds=START_TIMEOUT_SECONDS, engine_nice=True,
            env={**THREAD_LIMITS, "KVGUARD_RUN_DIR": str(work / name / "run"),
                 "KVGUARD_ENGINE_NAME": name, "VLLM_PLUGINS": "kvguard",
                 "VLLM_NIXL_SIDE_CHANNEL_HOST": node.address,
                 "VLLM_NIXL_SIDE_CHANNEL_PORT": str(NIXL_SIDE_CHANNEL_PORT),
                 "UCX_TLS": "tcp", "UCX_NET_DEVICES": node.device,
                 "VLLM_CPU_OMP_THREADS_BIND": core, **env.get(name, {})})

    def start(node: Node, server: ServerProcess) -> None:
        try:
            with entered(node.netns):
                server.start()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(n, servers[k]))
               for k, n in (("prefill", nodes.prefill), ("decode", nodes.decode))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in servers.values():
            s.stop()
        raise errors[0]
    return servers


class NodeProcess:
    """One process started in a node's namespace, in its own session; stopped by pid."""

    def __init__(self, node: Node, argv: Sequence[str], log: Path, *,
                 ready_url: str, cwd: Path | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.node = node
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        with entered(node.netns), log.open("wb") as fh:
            self.proc = subprocess.Popen(list(argv), stdout=fh, stderr=subprocess.STDOUT,
                                         cwd=cwd, start_new_session=True,
                                         env={**os.environ, **(env or {})})
        try:
            until(f"{argv[0]} on {node.netns} to answer {ready_url}",
                  lambda: self._alive() and get(node, ready_url, timeout=2), 120.0)
        except BaseException:
            self.stop()
            raise

    def _alive(self) -> bool:
        if self.proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-3000:]
            raise AssertionError(f"exited with {self.proc.returncode}:\n{tail}")
        return True

    def stop(self) -> None:
        """SIGTERM to its session, SIGKILL after 10 s."""
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def kvguard_cli() -> str:
    return str(Path(sys.executable).with_name("kvguard"))


def sidecar(node: Node, run_dir: Path, work: Path) -> NodeProcess:
    """``kvguard sidecar`` over the node's own run dir, on the node's address."""
    return NodeProcess(node, [kvguard_cli(), "sidecar", "--host", node.address,
                              "--port", str(SIDECAR_PORT), "--run-dir", str(run_dir)],
                       work / "logs" / f"sidecar-{node.netns}.log",
                       ready_url=f"http://{node.address}:{SIDECAR_PORT}/healthz")


def proxy(node: Node, prefill_url: str, decode_url: str, work: Path) -> NodeProcess:
    """The P/D proxy (``tests/pd/pd_proxy.py``'s ``create_proxy``) as its own server on
    ``node``: it forwards the client's ``traceparent`` to both halves."""
    code = ("import sys, uvicorn; sys.path.insert(0, sys.argv[5]); "
            "from pd_proxy import create_proxy; "
            "uvicorn.run(create_proxy(sys.argv[1], sys.argv[2]), host=sys.argv[3], "
            "port=int(sys.argv[4]), log_level='warning')")
    return NodeProcess(node, [sys.executable, "-c", code, prefill_url, decode_url,
                              node.address, str(PROXY_PORT), str(PD_DIR)],
                       work / "logs" / "proxy.log",
                       ready_url=f"http://{node.address}:{PROXY_PORT}/docs")


def prometheus(node: Node, targets: Mapping[str, str], work: Path,
               binary: str = "prometheus") -> NodeProcess:
    """A real Prometheus on ``node`` scraping ``targets`` (job -> host:port) every second."""
    work.mkdir(parents=True, exist_ok=True)
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [t]}]}
                                 for job, t in targets.items()]}
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    return NodeProcess(node, [binary, f"--config.file={work / 'prometheus.yml'}",
                              f"--storage.tsdb.path={work / 'data'}",
                              f"--web.listen-address={node.address}:{PROMETHEUS_PORT}"],
                       work / "prometheus.log", cwd=work,
                       ready_url=f"http://{node.address}:{PROMETHEUS_PORT}/-/ready")


def promql(node: Node, expr: str) -> list[dict[str, Any]]:
    from urllib.parse import urlencode

    doc = get_json(node, f"http://{node.address}:{PROMETHEUS_PORT}/api/v1/query?"
                         + urlencode({"query": expr}))
    assert doc["status"] == "success", doc
    result: list[dict[str, Any]] = doc["data"]["result"]
    return result
