"""Child process of tests/chaos/test_offload_engine.py: one case on a fresh real engine.

``python _offload_child.py CASE [sync|async]`` prints one line ``OFFLOAD-CASE <json>``:
what vLLM measured (its metrics, scheduler and connector state) and what kvguard said.
A process per case because vLLM keeps one worker-side KV connector per process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from kvguard.chaos import offload_scenarios as o
from kvguard.chaos.harness import EngineHarness, prompt
from kvguard.core.state import EngineState
from kvguard.testing.engine import EngineSpec
from kvguard.testing.scheduling import Scheduling
from kvguard.testing.tiny_model import make_tiny_model


def build(workdir: Path, scheduling: Scheduling, **faults: object) -> EngineHarness:
    spec: dict[str, Any] = {**o.offload_engine(**faults), "scheduling": scheduling}
    h = EngineHarness(EngineSpec(model_dir=make_tiny_model(workdir / "model"), **spec))
    h.guard.config = dataclasses.replace(h.guard.config, delayed_free_bound_seconds=1.0)
    return h


def offload(h: EngineHarness) -> dict[str, Any]:
    state = h.guard.poll_offload()
    assert state is not None
    return state.model_dump(mode="json")


def published(h: EngineHarness) -> dict[str, Any]:
    """The offload section of the state file, as written after this call (the writer is a
    thread of its own: an older file can still be there for a moment)."""
    since = time.time()
    h.guard.publish()
    path = Path(os.environ["KVGUARD_RUN_DIR"]) / f"{h.guard.engine}.json"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = EngineState.model_validate_json(path.read_text())
            if state.updated_at >= since and state.offload is not None:
                return state.offload.model_dump(mode="json")
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"no offload state published in {path}")


def waiting_on_store(h: EngineHarness) -> None:
    """A lost store of the shared prefix, evicted from the pool, then ``waits`` asks for it."""
    o.worker_of(h).arm_loss(stores=1)
    h.add(prompt(7300, o.PREFIX_TOKENS), max_tokens=4, rid="lost-store")
    h.run_to_completion()
    for i in range(6):
        h.add(prompt(7400 + i, 150), max_tokens=4)
    h.run_to_completion()
    h.add(prompt(7300, o.PREFIX_TOKENS), max_tokens=4, rid="waits")
    h.step_until(lambda: bool(o._stuck_with_waiters(h)), max_steps=10**6, pause_seconds=0.005,
                 max_seconds=30)


def case_released(h: EngineHarness) -> dict[str, Any]:
    waiting_on_store(h)
    stuck = offload(h)
    cs = o.connector_scheduler(h)
    during = {"pending_push_work": bool(cs.has_pending_push_work()),
              "waits_computed": o.rid_computed(h, "waits"), "waits_blocks": h.blocks_of("waits"),
              "free": int(h.pool.get_num_free_blocks()), "usable": h.num_usable()}
    hits0 = h.vllm_metric("vllm:external_prefix_cache_hits")
    released = o.worker_of(h).release_lost()
    h.run_to_completion()
    o._settle_jobs(h)
    h.drain_scheduler()
    h.guard.on_idle()  # an in-process engine is judged when its driver says it is idle
    return {"stuck": stuck, "during": during, "released": released,
            "hits_after_release": h.vllm_metric("vllm:external_prefix_cache_hits") - hits0,
            "after": offload(h), "published": published(h),
            "reports": [r.model_dump(mode="json") for r in h.reports()]}


def case_reset(h: EngineHarness) -> dict[str, Any]:
    waiting_on_store(h)
    stuck = offload(h)
    h.abort("waits")
    h.step_until(lambda: not h.scheduler.requests)
    ok = bool(h.engine.reset_prefix_cache(reset_connector=True))
    cs = o.connector_scheduler(h)
    vllm_after = {"jobs": len(cs._jobs), "pending_push_work": bool(cs.has_pending_push_work())}
    after_reset = offload(h)
    h.add(prompt(7500, o.PREFIX_TOKENS), max_tokens=4)
    h.run_to_completion()
    o._settle_jobs(h)
    h.drain_scheduler()
    return {"stuck": stuck, "reset_ok": ok, "vllm_after": vllm_after,
            "after_reset": after_reset, "after": offload(h),
            "reports": [r.model_dump(mode="json") for r in h.reports()]}


def case_healthy(h: EngineHarness) -> dict[str, Any]:
    """Prefixes stored, evicted, reloaded, shared, aborted, preempted: no false finding."""
    hits0 = h.vllm_metric("vllm:external_prefix_cache_hits")
    stored0 = h.vllm_metric("vllm:kv_offload_store_bytes")
    copied0 = o.worker_of(h).bytes_copied[0]
    for round_ in range(3):
        for i in range(4):
            h.add(prompt(8000 + i, 100 + 20 * i), max_tokens=12)
        ids = [h.add(prompt(8100 + round_ * 10 + i, 150), max_tokens=20) for i in range(4)]
        h.step(3)
        h.abort(ids[0])
        h.run_to_completion()
    o._settle_jobs(h)
    h.drain_scheduler()
    cs = o.connector_scheduler(h)
    m = cs.manager
    return {"hits": h.vllm_metric("vllm:external_prefix_cache_hits") - hits0,
            "stored_bytes": h.vllm_metric("vllm:kv_offload_store_bytes") - stored0,
            "copied_bytes": o.worker_of(h).bytes_copied[0] - copied0,
            "preemptions": h.vllm_metric("vllm:num_preemptions"),
            "vllm_tier": {"capacity": m._num_chunks,
                          "used": m._num_allocated_chunks - len(m._free_list),
                          "write_pending": m._num_write_pending_chunks},
            "after": offload(h),
            "reports": [r.model_dump(mode="json") for r in h.reports()]}


def _ready(h: EngineHarness, until_ready: bool) -> dict[str, Any]:
    """``/v1/ready`` from a sidecar on the engine's run dir, once it says ``until_ready``."""
    from fastapi.testclient import TestClient

    from kvguard.sidecar.app import create_app
    from kvguard.sidecar.store import EngineStore

    h.guard.publish()
    body: dict[str, Any] = {}
    for _ in range(200):
        store = EngineStore(Path(os.environ["KVGUARD_RUN_DIR"]))
        store.refresh()
        with TestClient(create_app(store)) as c:
            r = c.get("/v1/ready")
            body = {"status": r.status_code, **r.json()}
        if body.get("ready") is until_ready:
            return body
        time.sleep(0.05)
    raise AssertionError(f"/v1/ready never said ready={until_ready}: {body}")


def case_wedged_by_lost_loads(h: EngineHarness) -> dict[str, Any]:
    """Two loads whose completions never come, both clients gone: vLLM keeps both requests
    FINISHED_ABORTED with their blocks; the next request waits on what is left."""
    lost = ["lost-load-0", "lost-load-1"]
    seeds = (5100, 5150)
    for rid, seed in zip(lost, seeds, strict=True):
        o._store_prefix(h, "prefix-" + rid, seed)
    o._settle_jobs(h)
    o._evict_prefix(h, 5200)
    o.worker_of(h).arm_loss(loads=2)
    for rid, seed in zip(lost, seeds, strict=True):
        h.add(prompt(seed, o.PREFIX_TOKENS), max_tokens=8, rid=rid)
    h.step_until(lambda: all(o._status(h, r) == "WAITING_FOR_REMOTE_KVS" for r in lost),
                 max_steps=40)
    h.step(3)
    for rid in lost:
        h.abort(rid)
    h.step(2)
    before = {"status": {r: o._status(h, r) for r in lost},
              "blocks": {r: sorted(o._blocks(h, r)) for r in lost},
              "free": int(h.pool.get_num_free_blocks())}
    h.add(prompt(5900, 200), max_tokens=4, rid="starved")
    mon, reclaim = h.guard.wedge, h.guard.reclaim
    assert mon is not None and reclaim is not None, "KVGUARD_RECLAIM=1 did not attach"
    h.step_until(lambda: sum(reclaim.refused.values()) >= 2 or reclaim.reclaims_total > 0,
                 max_steps=10**6, pause_seconds=0.005, max_seconds=60)
    h.step(10)
    v = mon.last
    assert v is not None
    return {"before": before, "usable": h.num_usable(),
            "verdict": v.model_dump(mode="json"), "reclaim": reclaim.state().model_dump(
                mode="json"),
            "after": {"status": {r: o._status(h, r) for r in lost},
                      "blocks": {r: sorted(o._blocks(h, r)) for r in lost},
                      "free": int(h.pool.get_num_free_blocks()),
                      "starved_waiting": [r.request_id for r in h.scheduler.waiting]
                      == [h.internal_id("starved")],
                      "pending_loads": sum(1 for st in o.connector_scheduler(h)._jobs.values()
                                           if not st.is_store)},
            "ready": _ready(h, until_ready=False)}


CASES = {"released": (case_released, {}), "reset": (case_reset, {}),
         "healthy": (case_healthy, {"complete_after_steps": 3}),
         "wedged_by_lost_loads": (case_wedged_by_lost_loads, {})}


def main() -> None:
    name = sys.argv[1]
    scheduling = Scheduling(sys.argv[2]) if len(sys.argv) > 2 else Scheduling.SYNC
    fn, faults = CASES[name]
    h = build(Path(os.environ["KVGUARD_RUN_DIR"]).parent, scheduling, **faults)
    out = {"scheduling": h.scheduling.value, **fn(h)}
    sys.stdout.write("OFFLOAD-CASE " + json.dumps(out) + "\n")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
