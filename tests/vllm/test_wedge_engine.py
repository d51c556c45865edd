"""The wedge verdict and readiness on a real vLLM engine, sync and async scheduling.

One engine per mode, two phases, vLLM's own scheduler and pool as the truth:

1. *Busy, not wedged*: one long live request holds most of the pool and a second one
   waits behind it, none admitted for many steps. The monitor judges the stall (past its
   thresholds) and finds no dead owner: 0 wedge verdicts, ``/v1/ready`` 200.
2. *Wedged*: an abort whose free the chaos scheduler skips (vllm #29987, the chaos
   suite's ``skip_free_on_abort``) leaves 10 of 15 blocks held by a finished request; the
   next request needs 6 blocks, vLLM has 5 free, runs nothing and keeps it waiting. The
   wedge is named online with the aborted request, its blocks and the one block that
   must come back; ``/v1/ready`` answers 503 with that reason and
   ``kvguard_engine_wedged`` is 1. Aborting the waiting request un-wedges it (200).
3. *Reclaimed* (``KVGUARD_RECLAIM=1``): the next request wedges the engine again (503);
   at the third consecutive verdict reclaim frees the aborted request's blocks through
   ``KVCacheManager.free``, the request is admitted, readiness is 200 again,
   ``kvguard_reclaimed_blocks_total`` counts the blocks, vLLM's pool drains idle, and the
   greedy outputs of prompts that reuse the reclaimed (cached) blocks equal those the same
   engine served before any fault (a clean engine).
4. *Refused* (the chaos suite's ``refcount_bump``): references taken behind every hook
   leave blocks that no owner holds (orphans, found by the online audit); the next large
   request waits, the wedge is named with them, ``/v1/ready`` is 503, and reclaim refuses
   (``owner_unknown``): vLLM's ref counts are untouched, the request keeps waiting and the
   engine stays out of rotation until it is restarted, as docs/wedge.md says.

The stated time to a verdict: the stall's thresholds (``KVGUARD_WEDGE_AFTER_SECONDS``
and ``_STEPS``, here 1 s and 10 steps) plus at most one judge interval (0.5 s) and one
step; the measured time is printed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from _modes import in_mode
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvguard.chaos.faults import SCHEDULER_CLS, Fault, FaultPlan
from kvguard.chaos.harness import EngineHarness as Harness
from kvguard.chaos.harness import prompt
from kvguard.core.reclaim import RefusalReason
from kvguard.core.wedge import DeadOwnerKind
from kvguard.core.wedge_monitor import JUDGE_INTERVAL_SECONDS
from kvguard.sidecar.app import create_app
from kvguard.sidecar.store import EngineStore
from kvguard.testing.scheduling import Scheduling

AFTER_SECONDS = 1.0
AFTER_STEPS = 10
BLOCK = 32
ORPHANS = 5
"""Blocks phase 4's ref-count bumps leave referenced by no owner."""

pytestmark = pytest.mark.timeout(900)


def _ready(run_dir: Path, engine: str, *, until: Callable[[dict[str, object]], bool]
           ) -> tuple[int, dict[str, object], float]:
    """``/v1/ready`` from a sidecar on the engine's run dir, once ``until(body)`` holds
    (the engine's publisher writes its state file on its own thread); and the engine's
    ``kvguard_engine_wedged``."""
    for _ in range(200):
        store = EngineStore(run_dir)
        store.refresh()
        with TestClient(create_app(store)) as c:
            r = c.get("/v1/ready")
            body = r.json()
            wedged = [s.value for fam in text_string_to_metric_families(c.get("/metrics").text)
                      if fam.name == "kvguard_engine_wedged" for s in fam.samples
                      if s.labels["engine_name"] == engine]
        if until(body):
            return r.status_code, body, wedged[0] if wedged else -1.0
        time.sleep(0.05)
    raise AssertionError(f"the sidecar never showed the expected state: {body}")


@pytest.mark.parametrize("scheduling", list(Scheduling), ids=str)
def test_a_skipped_free_wedges_the_engine_and_a_busy_pool_never_does(
    engines: Callable[..., Harness], scheduling: Scheduling, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVGUARD_RUN_DIR", str(tmp_path))
    monkeypatch.setenv("KVGUARD_WEDGE_AFTER_SECONDS", str(AFTER_SECONDS))
    monkeypatch.setenv("KVGUARD_WEDGE_AFTER_STEPS", str(AFTER_STEPS))
    monkeypatch.setenv("KVGUARD_RECLAIM", "1")
    monkeypatch.setenv("KVGUARD_RECLAIM_AFTER_VERDICTS", "3")
    # the online audit confirms phase 4's orphans within a few steps (default: 0.5 % of
    # scheduler time, minutes on a workload this short)
    monkeypatch.setenv("KVGUARD_ONLINE_BUDGET_FRACTION", "0.5")
    h = in_mode(engines, scheduling)(num_gpu_blocks_override=16, max_model_len=448,
                                     scheduler_cls=SCHEDULER_CLS)
    s, g = h.scheduler, h.guard
    mon, reclaim = g.wedge, g.reclaim
    assert mon is not None and mon.opts.after_seconds == AFTER_SECONDS
    assert reclaim is not None and reclaim.after_verdicts == 3
    assert h.num_usable() == 15
    # ---- 0. a clean engine's greedy outputs (the first prompt is the victim's, below)
    prompts = [prompt(3, 10 * BLOCK), prompt(4, 2 * BLOCK), prompt(9, 40)]
    clean = h.greedy_tokens(prompts, 8, prefix="clean")

    # ---- 1. busy: a live request holds 10+ blocks, the next one (6 blocks) waits
    h.add(prompt(1, 10 * BLOCK), max_tokens=110, rid="long")
    h.step_until(lambda: h.blocks_of("long") >= 10)
    h.add(prompt(2, 6 * BLOCK), max_tokens=4, rid="behind")
    judged_busy = 0
    while h.vllm_status("long") is None:
        h.step()
        time.sleep(0.01)  # the stall must outlast the thresholds in seconds too
        if mon.last is not None and mon.last.waiting_requests:
            judged_busy += 1
            assert not mon.last.wedged and mon.last.dead_blocks == 0, mon.last
    assert judged_busy > 0, "the busy stall never reached the wedge thresholds"
    assert mon.verdicts_total == 0
    g.publish()
    code, body, gauge = _ready(tmp_path, g.engine, until=lambda b: bool(b["engines"]))
    assert (code, body["ready"], gauge) == (200, True, 0.0)
    h.run_to_completion()
    assert mon.verdicts_total == 0 and not mon.wedged

    # ---- 2. wedged: an abort skips its free, the next request cannot be admitted
    h.chaos.arm(FaultPlan({Fault.SKIP_FREE_ON_ABORT: 1}))
    h.add(prompt(3, 10 * BLOCK), max_tokens=100, rid="victim")
    h.step_until(lambda: h.blocks_of("victim") >= 10)
    held = h.blocks_of("victim")
    h.abort("victim")
    h.step(2)
    h.add(prompt(4, 6 * BLOCK), max_tokens=4, rid="starved")
    t0 = time.monotonic()
    h.step_until(lambda: mon.wedged, max_steps=100_000, max_seconds=120, pause_seconds=0.01)
    named_after = time.monotonic() - t0
    v = mon.last
    assert v is not None and v.wedged and mon.verdicts_total == 1
    # vLLM's own view: nothing runs, the request waits, its free count is short of it.
    assert h.vllm_status("victim") == "FINISHED_ABORTED"
    free = int(h.pool.get_num_free_blocks())
    assert (len(s.running), len(s.waiting), free) == (0, 1, h.num_usable() - held)
    assert (v.running_requests, v.waiting_requests, v.free_blocks) == (0, 1, free)
    assert v.head_blocks_needed == 6 and v.blocks_to_return == 6 - free
    [owner] = v.dead_owners
    assert (owner.kind, owner.request_id, owner.blocks) == \
        (DeadOwnerKind.FINISHED_REQUEST, "victim", held)
    assert v.stalled_steps >= AFTER_STEPS and v.stalled_seconds >= AFTER_SECONDS
    print(f"[wedge {scheduling}] named {named_after:.2f} s after the starved request arrived "
          f"(stall {v.stalled_seconds:.2f} s / {v.stalled_steps} steps; stated: "
          f"{AFTER_SECONDS} s + {AFTER_STEPS} steps + <= {JUDGE_INTERVAL_SECONDS} s + 1 step)")
    g.publish()
    code, body, gauge = _ready(tmp_path, g.engine, until=lambda b: b["ready"] is False)
    assert code == 503 and gauge == 1.0
    reason = str(body["reason"])
    assert g.engine in reason and "victim" in reason and f"{held} block(s)" in reason

    # ---- the waiting request goes (client gave up): nothing waits, ready again
    h.abort("starved")
    h.step_until(lambda: not mon.wedged and len(s.waiting) == 0)
    g.publish()
    code, body, gauge = _ready(tmp_path, g.engine, until=lambda b: b["ready"] is True)
    assert (code, gauge) == (200, 0.0) and mon.verdicts_total == 1
    assert reclaim.reclaims_total == 0  # one verdict only: nothing reclaimed

    # ---- 3. reclaimed: wedged again by the same dead owner, then freed by vLLM's path
    h.add(prompt(5, 6 * BLOCK), max_tokens=4, rid="starved2")
    h.step_until(lambda: mon.wedged, max_steps=100_000, max_seconds=120, pause_seconds=0.01)
    assert mon.verdicts_total == 2 and reclaim.reclaims_total == 0
    g.publish()
    code, _, _ = _ready(tmp_path, g.engine, until=lambda b: b["ready"] is False)
    assert code == 503
    h.step_until(lambda: reclaim.reclaims_total > 0, max_steps=100_000, max_seconds=120,
                 pause_seconds=0.01)
    [entry] = reclaim.state().recent
    assert (entry.request_id, entry.blocks, entry.path) == ("victim", held,
                                                           "KVCacheManager.free")
    h.step_until(lambda: not mon.wedged)
    g.publish()
    code, body, gauge = _ready(tmp_path, g.engine, until=lambda b: b["ready"] is True)
    assert (code, gauge) == (200, 0.0)
    h.run_to_completion()
    assert h.vllm_status("starved2") == "FINISHED_LENGTH_CAPPED"
    assert h.greedy_tokens(prompts, 8, prefix="after") == clean
    h.drain_scheduler()
    assert not h.pool_truth().wrong_blocks, "vLLM's pool is not idle after the reclaim"
    store = EngineStore(tmp_path)
    store.refresh()
    with TestClient(create_app(store)) as c:
        counted = [s.value for fam in text_string_to_metric_families(c.get("/metrics").text)
                   if fam.name == "kvguard_reclaimed_blocks" for s in fam.samples
                   if s.name.endswith("_total") and s.labels["engine_name"] == g.engine
                   and s.labels["cause"] == "finished_request"]
    assert counted == [float(held)] and g.errors.total == 0

    # ---- 4. ref-count bump: a reference nobody owns wedges it; reclaim refuses, frees none
    h.chaos.arm(FaultPlan({Fault.REFCOUNT_BUMP: ORPHANS}))
    for i in range(ORPHANS):  # each finishing request's last block keeps one reference
        h.add(prompt(20 + i, 2 * BLOCK + 3), max_tokens=4, rid=f"bumped{i}")
        h.run_to_completion()
    h.drain_scheduler()
    bumped = {b.block_id for b in h.pool.blocks if not b.is_null and b.ref_cnt > 0}
    assert len(bumped) == ORPHANS, "vLLM's pool does not hold the bumped references"
    need = h.num_usable() - ORPHANS + 2  # more than vLLM has free, fewer than capacity
    h.add(prompt(30, need * BLOCK - 8), max_tokens=4, rid="starved3")
    h.step_until(lambda: bool(reclaim.refused), max_steps=100_000, max_seconds=120,
                 pause_seconds=0.01)
    v = mon.last
    assert v is not None and v.wedged and len(s.waiting) == 1 and len(s.running) == 0
    assert {o.kind for o in v.dead_owners} <= {DeadOwnerKind.ORPHAN,
                                               DeadOwnerKind.REFCOUNT_DRIFT}
    assert v.dead_blocks == ORPHANS and v.free_blocks == h.pool.get_num_free_blocks()
    r = reclaim.state()
    assert r.refused_total == {RefusalReason.OWNER_UNKNOWN.value: 1} and r.reclaims_total == 1
    assert {b.block_id for b in h.pool.blocks if not b.is_null and b.ref_cnt > 0} == bumped
    g.publish()
    code, body, gauge = _ready(tmp_path, g.engine, until=lambda b: b["ready"] is False)
    assert code == 503 and gauge == 1.0, body
    for _ in range(AFTER_STEPS):  # refused stays refused: no free, still out of rotation
        h.step()
    assert reclaim.state().reclaims_total == 1 and h.vllm_status("starved3") is None
    assert len(s.waiting) == 1 and len(s.running) == 0
