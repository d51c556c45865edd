"""The sidecar in front of a real engine: before it, after it, asking it for checkpoints."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvguard.chaos.harness import EngineHarness as Harness
from kvguard.chaos.harness import prompt
from kvguard.sidecar.app import create_app
from kvguard.sidecar.store import EngineStore


def _wait(cond: Callable[[], Any], seconds: float = 10.0) -> Any:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not reached in time")


def test_sidecar_before_and_after_the_engine_and_checkpoint_requests(
    engines: Callable[..., Harness], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVGUARD_RUN_DIR", str(tmp_path))
    early = TestClient(create_app(EngineStore(tmp_path), poll_interval_seconds=0.05))
    with early:
        assert early.get("/healthz").json()["engines"] == 0  # sidecar first: fine
        h = engines()
        h.guard.config = dataclasses.replace(h.guard.config, publish_interval_seconds=0.0)
        engine = h.guard.engine
        _wait(lambda: early.get("/healthz").json()["engines_up"] == 1)

        for i in range(3):
            h.add(prompt(1000 + i, 40), max_tokens=8)
        h.run_to_completion()
        latest = _wait(lambda: early.get("/v1/report").json()["engines"][0]["latest"])
        assert latest["verdict"] in ("clean", "saturated") and latest["drained"]

        # Ask for a checkpoint while a request runs: the engine answers "skipped" with why.
        assert early.post("/v1/checkpoints", params={"engine": engine}).status_code == 202
        h.add(prompt(1100, 40), max_tokens=30)
        for _ in range(3):
            h.engine.step()
        skipped = _wait(lambda: [r for r in early.get("/v1/checkpoints").json()["checkpoints"]
                                 if r["verdict"] == "skipped"])
        reason = skipped[-1]["skip_reason"]
        assert "running" in reason and "backlog" in reason and "λ=" in reason
        h.run_to_completion()
        n_early = len(early.get("/v1/checkpoints").json()["checkpoints"])

    # A sidecar started after the engine resynchronises from the state file alone.
    late = TestClient(create_app(EngineStore(tmp_path), poll_interval_seconds=0.05))
    with late:
        got = _wait(lambda: late.get("/v1/checkpoints").json()["checkpoints"])
        assert len(got) >= n_early
        assert late.get("/v1/report").json()["engines"][0]["engine"] == engine
        metrics = late.get("/metrics").text
        # Labels that join vLLM's own series: its model_name and engine index (0, alone).
        model = h.scheduler.vllm_config.model_config.served_model_name
        [cap] = [(s.labels, s.value) for fam in text_string_to_metric_families(metrics)
                 for s in fam.samples if s.name == "kvguard_pool_capacity_blocks"]
        assert cap == ({"engine_name": engine, "model_name": model, "engine": "0"}, 63.0)
