"""Fail soft on a vLLM nobody tested: each hook point removed in turn, on vLLM's real scheduler.

A future vLLM that drops or renames a method drops or renames its callers with it; removing
one from today's engine would only break vLLM's own calls. What kvguard sees is the same
either way: the name it looks for is not there. So each hook point is removed *while
kvguard installs* (an instance attribute ``None`` shadows vLLM's method, and is deleted
right after), and vLLM then runs its own, unhooked method; the test checks what a user
relies on:

* the engine is unharmed: the same workload gives the same schedule, the same finishes and
  the same pool at the end as with every hook on (vLLM's own outputs and pool are the truth);
* kvguard says so once: one warning naming the missing method and the feature that is off,
  and the published state's ``hooks_missing`` carries the same line;
* what is off is off, and what kvguard no longer sees raises no false alarm: without one
  pool hook none is installed (a release never seen would read as a double free: it did,
  for every block, before), and the session makes up from vLLM's own tables for a missing
  admission, finish or free (:mod:`kvguard.core.fail_soft`); the drained audit of a clean
  run is no leak and leaves no record behind;
* the features that do not need the missing hook still work: every fault class of
  ``test_faults`` is caught with exactly the blocks vLLM's pool still references.

Why the scheduler level, and not one engine per removal: the hooks sit on the scheduler and
its block pool, which are the same objects here as in EngineCore (built the same way, the
plugin attached through its entry point), and a real engine start costs seconds where this
costs milliseconds: twelve removals (each with five faults), three releases, well inside
CI's budget. The model runner adds nothing a removed hook could harm.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from _sched import Sched, leaked_ids, prompt
from test_faults import FAULTS

from kvguard.chaos.faults import FaultPlan
from kvguard.chaos.faults.scheduler import ChaosScheduler
from kvguard.core.types import LeakCause, LeakPath, Verdict
from kvguard.vllm_plugin import hooks
from kvguard.vllm_plugin.versions import Feature, feature_of, missing_message

REMOVABLE = [("BlockPool", m) for m in hooks.POOL_HOOKS] + \
            [("Scheduler", m) for m in hooks.SCHEDULER_HOOKS]


def _run(s: Sched) -> dict[str, Any]:
    """A small mixed workload (prefix hits, an abort, preemption from a small pool, finish by
    length and by stop) stepped as :meth:`Sched.step` does, and what vLLM itself did: per
    step the tokens it scheduled and the requests it finished, then each request's final
    status, its preemptions and the pool's free count."""
    shared = prompt(1, 48)
    for i in range(6):
        s.add(shared + prompt(10 + i, 20 + 9 * i), max_tokens=30 + 7 * i,
              stop_after=12 if i == 2 else None)
    trace: list[tuple[dict[str, int], list[str]]] = []
    for step in range(2_000):
        if not s.scheduler.has_unfinished_requests():
            break
        if step == 5:
            s.abort("req4")
        before = {r for r, q in s.requests.items() if q.is_finished()}
        scheduled = s.step()
        trace.append((scheduled, sorted({r for r, q in s.requests.items() if q.is_finished()}
                                        - before)))
    return {"trace": trace, "status": {r: s.status(r) for r in s.requests},
            "free": s.pool.get_num_free_blocks(), "preemptions": s.preemptions}


def _build(sched: Callable[..., Sched]) -> Sched:
    return sched(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=128)  # 3 preemptions


def _install_without(monkeypatch: pytest.MonkeyPatch, owner: str, method: str) -> None:
    """kvguard attaches from here on as if vLLM had no ``owner.method``."""
    install = hooks.install_hooks  # the plugin looks it up at each attach

    def install_without(g: Any) -> None:
        obj = g.block_pool if owner == "BlockPool" else g.scheduler
        setattr(obj, method, None)  # shadows vLLM's method: kvguard finds no hook point
        try:
            install(g)
        finally:
            delattr(obj, method)  # vLLM's own method again, unhooked

    monkeypatch.setattr(hooks, "install_hooks", install_without)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """Filled by the first test: the run with every hook on."""
    return {}


@pytest.mark.parametrize(("owner", "method"), REMOVABLE)
def test_a_missing_hook_point_turns_off_its_feature_and_leaves_vllm_unharmed(
        sched: Callable[..., Sched], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, owner: str, method: str,
        reference: dict[str, Any]) -> None:
    if not reference:  # every hook on, once per module
        reference.update(_run(_build(sched)))
        assert reference["preemptions"] > 0 and "FINISHED_ABORTED" in \
            reference["status"].values()  # the workload reaches the exceptional paths
    _install_without(monkeypatch, owner, method)
    with caplog.at_level(logging.WARNING, logger="kvguard"):
        s = _build(sched)
    label = f"{owner}.{method}"
    message = missing_message(label)
    assert not getattr(getattr(s.scheduler if owner == "Scheduler" else s.pool, method),
                       "__kvguard_hook__", False)
    # kvguard says so once, with the missing name and the feature that is off ...
    feature = feature_of(label)
    assert feature is not None
    warned = [r.getMessage() for r in caplog.records if label in r.getMessage()]
    assert len(warned) == 1 and feature.value in warned[0]
    assert s.guard.hooks_missing == [message] and message.endswith(f"(off: {feature.value})")
    # ... vLLM runs exactly as with every hook on ...
    assert _run(s) == reference
    # ... and the state kvguard publishes names it too.
    assert s.guard.state().hooks_missing == [message]
    # What is off is off: no pool hook at all without one of them (a release never seen
    # reads as a double free), and the session knows which events it does not get.
    hooked = set(s.guard.hooks_installed)
    assert not any(h.startswith("BlockPool.") for h in hooked) \
        if owner == "BlockPool" else {f"BlockPool.{m}" for m in hooks.POOL_HOOKS} <= hooked
    seen = s.guard.events_seen
    assert (seen.pool_events, seen.admissions, seen.finishes, seen.frees) == (
        owner != "BlockPool", method != "add_request", method != "_free_request",
        method != "_free_blocks")
    # No false alarm from what kvguard no longer sees, and no records left behind.
    report = s.drained_checkpoint()
    assert report.verdict is not Verdict.LEAK, report.explanation
    assert s.guard.ledger.num_records == 0


# What each missing hook point's feature leaves less precise in a finding (cause, path):
# never whether a leak is found, nor which blocks.
_VAGUER: dict[Feature, tuple[set[LeakCause], set[LeakPath]]] = {
    Feature.POOL_EVENTS: ({LeakCause.ORPHAN}, {LeakPath.UNKNOWN}),
    Feature.FINISH: (set(), {LeakPath.UNKNOWN}),
    Feature.PREEMPTION: (set(), {LeakPath.FINISH}),
}


@pytest.mark.parametrize(("owner", "method"), REMOVABLE)
def test_with_a_hook_point_missing_every_fault_is_still_caught_with_vllms_own_blocks(
        sched: Callable[..., Sched], monkeypatch: pytest.MonkeyPatch, owner: str,
        method: str) -> None:
    """The features that do not need the missing hook still work: each fault class that
    runs without a model (``test_faults``) is caught, with exactly the blocks vLLM's own
    pool still references, and the cause and path it gets with every hook on unless the
    feature that tells them is the one off (``_VAGUER``)."""
    _install_without(monkeypatch, owner, method)
    feature = feature_of(f"{owner}.{method}")
    assert feature is not None
    vaguer_causes, vaguer_paths = _VAGUER.get(feature, (set(), set()))
    for fault, (drive, build, cause, path) in FAULTS.items():
        s = sched(**{"num_blocks": 64, **build}, max_num_seqs=4, scheduler_cls=ChaosScheduler,
                  env={"KVGUARD_ONLINE_AUDIT": "0"})
        s.scheduler.arm(FaultPlan({fault: 1}))
        drive(s)
        assert s.scheduler.faults.times_fired(fault) == 1, fault
        truth = s.pool_truth()
        report = s.drained_checkpoint()
        assert report.verdict is Verdict.LEAK, (fault, report.explanation)
        assert leaked_ids(report) == truth.wrong_blocks, fault
        causes = {lk.cause for lk in report.leaks}
        assert causes == {cause} or (causes <= vaguer_causes and cause is not
                                     LeakCause.DOUBLE_FREE), (fault, causes)
        if path is not None:
            paths = {lk.path for lk in report.leaks}
            assert paths == {path} or paths <= vaguer_paths, (fault, paths)
