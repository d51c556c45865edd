"""Nothing is lost: a sidecar restart resynchronises; an engine restart is a new epoch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _reliability import (
    WAIT_SECONDS,
    EngineFactory,
    Outputs,
    Sidecar,
    by_label,
    metric_samples,
    one_value,
    summed_by_label,
    wait_for,
)
from fastapi.testclient import TestClient

from kvguard.core.trend import TREND_WINDOW
from kvguard.core.types import BlockState, Evidence, LeakCause, Verdict
from kvguard.sidecar.app import create_app
from kvguard.sidecar.store import EngineStore
from kvguard.vllm_plugin.guard import EngineGuard

pytestmark = pytest.mark.engine

HERE = Path(__file__).resolve().parent


def _ground_truth(g: EngineGuard) -> dict[str, Any]:
    """What the sidecar must show for ``g``'s engine, from the guard's own state."""
    assert g.last_pool is not None
    drained = [r for r in g.reports if r.drained]
    last = drained[-1]
    pool = g.last_pool
    return {
        "capacity": float(pool.capacity),
        "pool": {s.value: float(getattr(pool, s.value)) for s in BlockState},
        "checkpoints": {v.value: float(g.checkpoints_total.get(v.value, 0)) for v in Verdict},
        "leaked": {c.value: float(last.leaked_blocks_by_cause.get(c, 0)) for c in LeakCause},
        "events": {k: float(v) for k, v in g.ledger.num_events.items()},
        "hook_errors": float(g.errors.total),
        "holding": float(len(g.ledger.finished_holding())),
        "last_checkpoint": last.taken_at,
        "history": [(r.checkpoint_id, r.epoch, r.verdict.value) for r in g.reports],
        "latest": g.reports[-1].model_dump(mode="json"),
        "epoch": g.epoch,
    }


def _sidecar_view(metrics_text: str, checkpoints: list[dict[str, Any]],
                  report: dict[str, Any], engine: str) -> dict[str, Any]:
    m = metric_samples(metrics_text)
    [info] = [lbl for lbl, _ in m["kvguard_engine_info"] if lbl["engine_name"] == engine]
    return {
        "capacity": one_value(m, "kvguard_pool_capacity_blocks", engine),
        "pool": by_label(m, "kvguard_pool_blocks", engine, "state"),
        "checkpoints": summed_by_label(m, "kvguard_checkpoints_total", engine, "verdict"),
        "leaked": by_label(m, "kvguard_leaked_blocks", engine, "cause"),
        "events": by_label(m, "kvguard_request_events_total", engine, "event"),
        "hook_errors": one_value(m, "kvguard_hook_errors_total", engine),
        "holding": one_value(m, "kvguard_finished_requests_holding_blocks", engine),
        "last_checkpoint": one_value(m, "kvguard_last_checkpoint_timestamp_seconds", engine),
        "history": [(c["checkpoint_id"], c["epoch"], c["verdict"]) for c in checkpoints],
        "latest": report["latest"],
        "epoch": info["epoch"],
    }


def test_a_killed_sidecar_restarts_and_resynchronises_to_the_engines_ground_truth(
    rel_engines: EngineFactory, baseline_outputs: Outputs, tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    e = rel_engines(run_dir=run_dir, name="rel-sync",
                    extra_env={"KVGUARD_PUBLISH_INTERVAL_SECONDS": "0"})
    g = e.g
    sidecar = Sidecar(run_dir, tmp_path / "sidecar.log").start()
    try:
        sidecar.wait_healthy()
        sidecar.wait_engine_up(g)
        assert e.mixed_round() == baseline_outputs

        def kill_and_restart(step: int) -> None:
            if step == 5:
                sidecar.kill()  # SIGKILL mid-workload: no goodbye, nothing flushed
            if step == 40:
                sidecar.start()  # same port; the engine keeps stepping while it starts

        assert e.mixed_round(kill_and_restart) == baseline_outputs  # the engine never noticed
        assert e.mixed_round() == baseline_outputs  # the next drained checkpoint
        g.publish()
        assert g.publisher.flush(WAIT_SECONDS)
        sidecar.wait_healthy()
        truth = _ground_truth(g)

        def synced() -> bool:
            checkpoints = sidecar.get("/v1/checkpoints", engine="rel-sync").json()
            return bool(checkpoints["checkpoints"]) and \
                checkpoints["checkpoints"][-1]["checkpoint_id"] == g.reports[-1].checkpoint_id

        wait_for(synced, what="restarted sidecar resynchronised")
        view = _sidecar_view(sidecar.get("/metrics").text,
                             sidecar.get("/v1/checkpoints", engine="rel-sync")
                             .json()["checkpoints"],
                             sidecar.get("/v1/report").json()["engines"][0], "rel-sync")
    finally:
        sidecar.stop()
    assert view == truth
    assert truth["leaked"] == {c.value: 0.0 for c in LeakCause}
    assert len(truth["history"]) >= 3 and all(v in ("clean", "saturated")
                                              for _, _, v in truth["history"])


def test_an_engine_restart_is_a_new_epoch_and_never_mixed_with_the_old_one(
    rel_model_dir: Path, rel_engines: EngineFactory, baseline_outputs: Outputs, tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD_")}
    env |= {"KVGUARD_RUN_DIR": str(run_dir), "KVGUARD_ENGINE_NAME": "phoenix",
            "KVGUARD_ALLOW_FAULTS": "1", "KVGUARD_FAULTS": "skip_free_on_abort=1",
            "VLLM_PLUGINS": "kvguard"}
    # Epoch 1: an engine process that leaks (injected) and then ends.
    done = subprocess.run([sys.executable, str(HERE / "_engine_once.py"), str(rel_model_dir)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    first = json.loads(done.stdout.strip().splitlines()[-1])
    old = first["epoch"]
    assert first["verdict"] == "leak"

    store = EngineStore(run_dir)
    client = TestClient(create_app(store))  # not started: refreshed by hand below
    store.refresh()

    def metrics() -> dict[str, list[tuple[dict[str, str], float]]]:
        return metric_samples(client.get("/metrics").text)

    def history(**params: str) -> list[tuple[int, str]]:
        got = client.get("/v1/checkpoints", params={"engine": "phoenix", **params}).json()
        return [(c["checkpoint_id"], c["epoch"]) for c in got["checkpoints"]]

    m = metrics()
    assert [lbl["epoch"] for lbl, _ in m["kvguard_engine_info"]] == [old]
    # Exactly the blocks vLLM's own pool still referenced when that engine ended.
    assert first["held_blocks"] > 0
    assert by_label(m, "kvguard_leaked_blocks", "phoenix", "cause")["finished_request"] == \
        first["held_blocks"]
    old_history = history()
    assert old_history and {ep for _, ep in old_history} == {old}
    old_file = (run_dir / "phoenix.json").read_bytes()

    # Epoch 2: the engine restarts under the same name (here an in-process engine). Its
    # warm-up request (build_engine) gave it one drained checkpoint of its own, clean.
    e = rel_engines(run_dir=run_dir, name="phoenix",
                    extra_env={"KVGUARD_PUBLISH_INTERVAL_SECONDS": "0"})
    new = e.g.epoch
    assert new != old
    [warmup] = e.g.reports
    assert warmup.verdict is not Verdict.LEAK
    assert e.g.publisher.flush(WAIT_SECONDS)  # its state after the warm-up is on disk
    store.refresh()
    m = metrics()
    # The old epoch's series are gone; nothing of it is carried into the new one: every
    # series is the new epoch's own (its warm-up checkpoint), the old leak is not there.
    assert [lbl["epoch"] for lbl, _ in m["kvguard_engine_info"]] == [new]
    assert set(by_label(m, "kvguard_leaked_blocks", "phoenix", "cause").values()) == {0.0}
    assert by_label(m, "kvguard_pool_blocks", "phoenix", "state")["held_by_finished"] == 0
    assert summed_by_label(m, "kvguard_checkpoints_total", "phoenix", "verdict") == {
        v.value: float(e.g.checkpoints_total.get(v.value, 0)) for v in Verdict}
    assert one_value(m, "kvguard_last_checkpoint_timestamp_seconds", "phoenix") == \
        pytest.approx(warmup.taken_at, abs=1e-3)
    [rep] = client.get("/v1/report").json()["engines"]
    assert rep["epoch"] == new and rep["latest"]["checkpoint_id"] == warmup.checkpoint_id
    assert rep["latest"]["epoch"] == new and rep["trend"]["checkpoints"] == 1
    # The history keeps the old epoch, labelled as such, beside the new one.
    assert history(epoch=old) == old_history
    assert history(epoch=new) == [(warmup.checkpoint_id, new)]

    assert e.mixed_round() == baseline_outputs
    e.g.publish()
    assert e.g.publisher.flush(WAIT_SECONDS)
    store.refresh()
    m = metrics()
    assert [lbl["epoch"] for lbl, _ in m["kvguard_engine_info"]] == [new]
    assert set(by_label(m, "kvguard_leaked_blocks", "phoenix", "cause").values()) == {0.0}
    assert e.g.last_pool is not None
    assert by_label(m, "kvguard_pool_blocks", "phoenix", "state")["held_by_finished"] == 0
    assert summed_by_label(m, "kvguard_checkpoints_total", "phoenix", "verdict") == {
        v.value: float(e.g.checkpoints_total.get(v.value, 0)) for v in Verdict}
    assert history(epoch=new) == [(r.checkpoint_id, new) for r in e.g.reports]
    assert history(epoch=old) == old_history
    [rep] = client.get("/v1/report").json()["engines"]
    assert rep["latest"]["epoch"] == new and rep["latest"]["verdict"] != "leak"
    # The trend rests on this epoch's judged reports only: drained verdicts, and online
    # reports if the online audit got to confirm (how many depends on the machine's speed).
    judged = [r for r in e.g.reports if r.evidence is Evidence.ONLINE
              or (r.drained and r.verdict is not Verdict.SKIPPED)]
    assert rep["trend"]["checkpoints"] == min(len(judged), TREND_WINDOW)
    view = store.engines["phoenix"]
    assert view.epochs_seen == [old, new] and view.restarts == 1

    # A stale copy of the old epoch's file that reappears is rejected, not mixed in.
    errors = store.num_read_errors
    (run_dir / "phoenix.json").write_bytes(old_file)
    store.refresh()
    assert "out of order" in store.read_errors["phoenix.json"]
    assert store.num_read_errors == errors + 1 and store.engines["phoenix"].state.epoch == new
    e.g.publish()
    assert e.g.publisher.flush(WAIT_SECONDS)
    store.refresh()
    assert "phoenix.json" not in store.read_errors
