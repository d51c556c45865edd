"""Fixtures for the observability tests: a metrics target and a real Prometheus scraping it.

``metrics_target`` is the only place that decides what Prometheus scrapes: the real
``kvguard sidecar`` in front of a real vLLM OpenAI server with an injected leak.
``static_metrics_target`` serves ``leak_exposition.txt`` (engine dp0 with an abort-path
leak, engine dp1 saturated but clean) for tests of the exposition format itself.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from _obs_contract import RULES, PrometheusServer, prometheus_binary

from kvguard.chaos.faults import SCHEDULER_CLS
from kvguard.demo.engine import EngineSpec, ServerProcess
from kvguard.demo.run import wait_for_checkpoint
from kvguard.demo.tiny_model import make_tiny_model
from kvguard.demo.workload import run_workload

EXPOSITION = Path(__file__).with_name("leak_exposition.txt")
_NOW = re.compile(r"__NOW(?:_MINUS_(\d+))?__")

PROMETHEUS_READY_TIMEOUT_S = 15.0


def render_exposition(now: float | None = None) -> str:
    """The fixture exposition with ``__NOW__`` / ``__NOW_MINUS_<s>__`` set to the clock."""
    t = time.time() if now is None else now
    return _NOW.sub(lambda m: f"{t - int(m.group(1) or 0):.3f}", EXPOSITION.read_text())


class _ExpositionHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] != "/metrics":
            self.send_error(404)
            return
        body = render_exposition().encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="session")
def static_metrics_target() -> Iterator[str]:
    """URL of a /metrics endpoint serving ``leak_exposition.txt`` (two engines, one leaking)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ExpositionHandler)
    thread = threading.Thread(target=server.serve_forever, name="leak-exposition", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture(scope="session")
def metrics_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real sidecar's /metrics, in front of a real vLLM server that leaked KV blocks.

    The server runs with the chaos scheduler's opt-in faults (in vLLM's own paths):
    ``refcount_bump=1`` (the first finishing request's last block keeps a reference nobody
    owns: deterministic) and ``skip_free_on_abort=1`` (the first request a hanging-up
    client aborts keeps its blocks).
    The sidecar is the real ``kvguard sidecar`` command, started as its own process.
    """
    root = tmp_path_factory.mktemp("observability")
    run_dir = root / "run"
    spec = EngineSpec(model_dir=make_tiny_model(root / "model"), max_num_seqs=8,
                      extra={"scheduler_cls": SCHEDULER_CLS})  # the faults' scheduler
    # The workload is short (a few hundred engine steps): the online audit gets 5 % of
    # scheduler time (default 0.5 %) so that its sweeps complete and its series exist.
    env = {"VLLM_PLUGINS": "kvguard", "KVGUARD_RUN_DIR": str(run_dir),
           "KVGUARD_ENGINE_NAME": "dp0", "KVGUARD_ALLOW_FAULTS": "1",
           "KVGUARD_FAULTS": "refcount_bump=1,skip_free_on_abort=1",
           "KVGUARD_ONLINE_BUDGET_FRACTION": "0.05"}
    with ServerProcess(spec, log_path=root / "server.log", env=env) as server:
        run_workload(server.base_url, spec.served_model_name, shared_prefix_streams=8,
                     disconnecting_streams=4)
        state = wait_for_checkpoint(run_dir, after=time.time() - 5.0, engine="dp0")
        assert state.latest_report is not None and state.latest_report.verdict.value == "leak"
        assert state.online is not None and state.online.sweeps_total >= 2, state.online
        port = _free_port()
        sidecar = subprocess.Popen(
            [sys.executable, "-m", "kvguard.cli.main", "sidecar", "--host", "127.0.0.1",
             "--port", str(port), "--run-dir", str(run_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    with urllib.request.urlopen(base + "/healthz", timeout=2) as resp:
                        if b'"engines":1' in resp.read():
                            break
                except OSError:
                    pass
                assert time.monotonic() < deadline, "the sidecar did not come up"
                time.sleep(0.2)
            yield base + "/metrics"
        finally:
            sidecar.terminate()
            sidecar.wait(timeout=10)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def prometheus(metrics_target: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[
    PrometheusServer
]:
    """A real Prometheus (Debian 2.42) scraping ``metrics_target`` every second, with the
    kvguard alert rules loaded and evaluated every second."""
    binary = prometheus_binary()
    work = tmp_path_factory.mktemp("prometheus")
    target = urllib.parse.urlsplit(metrics_target)
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{
            "job_name": "kvguard",
            "scheme": target.scheme,
            "metrics_path": target.path or "/metrics",
            "static_configs": [{"targets": [target.netloc]}],
        }],
    }
    config_file = work / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = _free_port()
    log = work / "prometheus.log"
    with log.open("wb") as log_fh:
        proc = subprocess.Popen(
            [binary, f"--config.file={config_file}", f"--storage.tsdb.path={work / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=info"],
            stdout=log_fh, stderr=subprocess.STDOUT, cwd=work,
        )
    server = PrometheusServer(f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + PROMETHEUS_READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"prometheus not ready after {PROMETHEUS_READY_TIMEOUT_S:.0f} s:\n"
                            f"{server.log_tail()}")
            time.sleep(0.2)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
