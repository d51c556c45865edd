"""``kvguard chaos --url``: client-side scenarios against a real server and its sidecar."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvguard.testing.engine import EngineSpec, ServerProcess
from kvguard.testing.ports import free_loopback_port
from kvguard.testing.tiny_model import make_tiny_model


def test_chaos_against_a_running_deployment_reads_the_verdict_from_its_sidecar(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    spec = EngineSpec(model_dir=make_tiny_model(tmp_path / "model"), max_num_seqs=8)
    env = {"VLLM_PLUGINS": "kvguard", "KVGUARD_RUN_DIR": str(run_dir)}
    port = free_loopback_port()
    with ServerProcess(spec, log_path=tmp_path / "server.log", env=env) as server:
        sidecar = subprocess.Popen([sys.executable, "-m", "kvguard.cli.main", "sidecar",
                                    "--port", str(port), "--run-dir", str(run_dir)])
        side = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    if httpx.get(side + "/healthz").json()["engines"] == 1:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline
                time.sleep(0.2)
            out = tmp_path / "remote.json"
            proc = subprocess.run(
                [sys.executable, "-m", "kvguard.cli.main", "chaos", "--url", server.base_url,
                 "--sidecar", side, "--json", str(out)],
                capture_output=True, text=True, timeout=400, check=False)
        finally:
            sidecar.terminate()
            sidecar.wait(10)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    [row] = json.loads(out.read_text())
    assert row["status"] == "passed" and row["verdict"] in ("clean", "saturated")
    assert "shared-prefix streams" in row["injected"]
