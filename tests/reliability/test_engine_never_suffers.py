"""Failures inside kvguard never reach the engine: same outputs, counted, logged once.

Every test runs the same deterministic round (``mixed_round``: prefix hits,
preemption, aborts while waiting and mid-decode) on a real engine with kvguard
while a fault is injected into kvguard itself, and compares the generated
token ids with the same round on an engine without kvguard (KVGUARD_ENABLED=0).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import signal
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from _reliability import (
    WAIT_SECONDS,
    EngineFactory,
    Outputs,
    ReliabilityEngine,
    Sidecar,
    metric_samples,
    one_value,
    wait_for,
)
from prometheus_client import CollectorRegistry, generate_latest

import kvguard.vllm_plugin.hooks as hooks_module
from kvguard.core.types import Verdict
from kvguard.sidecar.metrics import KvguardCollector
from kvguard.sidecar.store import EngineStore
from kvguard.transport.control import request_path
from kvguard.transport.reader import read_state_file
from kvguard.transport.state import EngineState
from kvguard.vllm_plugin.guard import EngineGuard

pytestmark = pytest.mark.engine

ENGINE = "rel-faults"

HOOKS_FILE = hooks_module.__file__
_WRAPPERS = {"get_new_blocks": "get_new_blocks", "touch": "touch",
             "add_request": "add_request", "_preempt_request": "preempt",
             "_free_request": "finish", "_free_request_blocks": "free_request_blocks",
             "_free_blocks": "free", "update_from_output": "update_from_output"}
"""Hook wrapper function (in hooks.py) -> the name its errors are counted under."""
_LABELLED = ("release", "step_end")
"""Wrappers shared by several hooks: the name is their ``hook`` closure variable."""

LEDGER_METHODS = ("on_request_admitted", "on_request_preempted", "on_request_finished",
                  "on_delayed_free_started", "on_deferred_free_started", "on_request_freed",
                  "on_blocks_acquired", "claim", "on_blocks_released")

HOOKS = ["get_new_blocks", "touch", "free_blocks", "add_request", "preempt", "finish",
         "free", "finish_requests", "update_from_output"]
"""Every hook in which this workload makes kvguard work. ``unpin_blocks`` is only called by
vLLM's hisparse; ``_free_request_blocks`` claims only where no finish or preemption around
it did (a delayed-free completion: ``tests/vllm/test_delayed_free.py`` fails it there)."""


def _current_hook() -> str | None:
    """The kvguard hook the caller runs in: the innermost hook wrapper frame on the stack."""
    f: FrameType | None = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename == HOOKS_FILE:
            name = f.f_code.co_name
            if name in _WRAPPERS:
                return _WRAPPERS[name]
            if name in _LABELLED:
                return str(f.f_locals.get("hook"))
        f = f.f_back
    return None


class HookFault:
    """Makes every ledger method (and the guard's step-end) raise inside one hook only."""

    def __init__(self, guard: EngineGuard, hook: str) -> None:
        self.guard = guard
        self.hook = hook
        self.fired = 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        targets: list[tuple[Any, str]] = [(self.guard.ledger, m) for m in LEDGER_METHODS]
        targets.append((self.guard, "on_step_end"))
        for obj, name in targets:
            monkeypatch.setattr(obj, name, self._wrap(getattr(obj, name)))

    def _wrap(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        def maybe_fail(*args: Any, **kwargs: Any) -> Any:
            if _current_hook() == self.hook:
                self.fired += 1
                raise RuntimeError(f"injected failure inside kvguard hook {self.hook}")
            return orig(*args, **kwargs)
        return maybe_fail


@pytest.fixture(scope="module")
def guarded(rel_engines: EngineFactory, tmp_path_factory: pytest.TempPathFactory,
            baseline_outputs: Outputs) -> Iterator[ReliabilityEngine]:
    """A real engine with kvguard, publishing every step; shared by this module's tests."""
    run_dir = tmp_path_factory.mktemp("rel-faults-run")
    e = rel_engines(run_dir=run_dir, name=ENGINE,
                    extra_env={"KVGUARD_PUBLISH_INTERVAL_SECONDS": "0"})
    assert e.g.engine == ENGINE
    assert e.mixed_round() == baseline_outputs  # kvguard itself changes nothing
    yield e


def _published(g: EngineGuard) -> EngineState:
    g.publish()
    assert g.publisher.flush(WAIT_SECONDS)
    return read_state_file(g.publisher.path)


def _hook_errors_metric(run_dir: Path, engine: str) -> float | None:
    store = EngineStore(run_dir)
    store.refresh()
    registry = CollectorRegistry()
    registry.register(KvguardCollector(store))
    samples = metric_samples(generate_latest(registry).decode())
    return one_value(samples, "kvguard_hook_errors_total", engine)


def _hook_logs(caplog: pytest.LogCaptureFixture, hook: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kvguard" and r.msg.startswith("kvguard hook ")
            and r.args and r.args[0] == hook]


@pytest.mark.parametrize("hook", HOOKS)
def test_an_exception_in_a_hook_leaves_outputs_unchanged_and_is_counted_and_logged_once(
    hook: str, guarded: ReliabilityEngine, baseline_outputs: Outputs,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    g = guarded.g
    before = Counter(g.errors.by_hook)
    fault = HookFault(g, hook)
    fault.install(monkeypatch)
    with caplog.at_level(logging.INFO, logger="kvguard"):
        out = guarded.mixed_round()
    monkeypatch.undo()

    assert out == baseline_outputs
    assert fault.fired >= 2, f"hook {hook} was reached {fault.fired} times"
    delta = Counter(g.errors.by_hook)
    delta.subtract(before)
    assert +delta == Counter({hook: fault.fired})  # counted under this hook, nowhere else
    assert len(_hook_logs(caplog, hook)) == 1  # however many times it failed
    state = _published(g)
    assert state.hook_errors_by_hook == dict(g.errors.by_hook)
    assert _hook_errors_metric(g.publisher.path.parent, ENGINE) == g.errors.total
    print(f"[reliability] hook {hook}: {fault.fired} failures injected, outputs unchanged")


def test_an_exception_while_publishing_is_contained(
    guarded: ReliabilityEngine, baseline_outputs: Outputs, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    g = guarded.g
    fired = 0

    def broken_offer(state: EngineState) -> None:
        nonlocal fired
        fired += 1
        raise RuntimeError("injected failure handing the state to the publisher")

    before = g.errors.by_hook["publish"]
    monkeypatch.setattr(g.publisher, "offer", broken_offer)
    with caplog.at_level(logging.INFO, logger="kvguard"):
        out = guarded.mixed_round()
    monkeypatch.undo()
    assert out == baseline_outputs
    assert fired >= 10 and g.errors.by_hook["publish"] - before == fired
    assert len(_hook_logs(caplog, "publish")) == 1
    assert _published(g).hook_errors_by_hook["publish"] == g.errors.by_hook["publish"]
    print(f"[reliability] publish: {fired} failures injected, outputs unchanged")


def test_a_full_disk_is_counted_and_warned_once_and_the_engine_goes_on(
    guarded: ReliabilityEngine, baseline_outputs: Outputs, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    g = guarded.g
    pub = g.publisher
    assert pub.flush(WAIT_SECONDS)
    errors0 = pub.errors

    def full(state: EngineState) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pub, "_write", full)
    with caplog.at_level(logging.INFO, logger="kvguard.transport"):
        out = guarded.mixed_round()
        g.publish()
        assert pub.flush(WAIT_SECONDS)
    monkeypatch.undo()
    assert out == baseline_outputs
    failed = pub.errors - errors0
    assert failed >= 2
    warnings = [r for r in caplog.records if "cannot write its state" in r.getMessage()]
    assert len(warnings) == 1
    # The disk has room again: the next publish carries everything, nothing was lost.
    state = _published(g)
    assert state.reports[-1].checkpoint_id == g.reports[-1].checkpoint_id
    print(f"[reliability] full disk: {failed} failed writes, outputs unchanged")


def test_an_unusable_run_dir_never_stops_the_engine(
    rel_engines: EngineFactory, baseline_outputs: Outputs, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    blocker = tmp_path / "a-regular-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.INFO, logger="kvguard"):
        e = rel_engines(run_dir=blocker / "run", name="rel-badrun",
                        extra_env={"KVGUARD_PUBLISH_INTERVAL_SECONDS": "0"})
        out = e.mixed_round()
        e.g.publish()
        assert e.g.publisher.flush(WAIT_SECONDS)
    assert out == baseline_outputs
    assert e.g.publisher.writes == 0 and e.g.publisher.errors >= 2
    assert len([r for r in caplog.records if "cannot write its state" in r.getMessage()]) == 1
    # kvguard still did its job in memory: the drained checkpoint exists.
    assert e.g.reports and e.g.reports[-1].verdict in (Verdict.CLEAN, Verdict.SATURATED)
    print(f"[reliability] unwritable run dir: {e.g.publisher.errors} failed writes, "
          "outputs unchanged")


def test_the_engine_never_waits_for_a_blocked_state_writer(
    guarded: ReliabilityEngine, baseline_outputs: Outputs, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A writer stuck in ``write`` (a hung volume): ``offer`` returns, states are dropped."""
    g = guarded.g
    pub = g.publisher
    assert pub.flush(WAIT_SECONDS)
    entered, release = threading.Event(), threading.Event()
    write = pub._write

    def stuck(state: EngineState) -> None:
        entered.set()
        release.wait(120)
        write(state)

    offers = 0
    offer = pub.offer

    def counting_offer(state: EngineState) -> None:
        nonlocal offers
        offers += 1
        offer(state)

    monkeypatch.setattr(pub, "_write", stuck)
    monkeypatch.setattr(pub, "offer", counting_offer)
    drops0, writes0 = pub.drops, pub.writes
    try:
        g.publish()
        wait_for(entered.is_set, what="writer blocked")
        out = guarded.mixed_round()
        # The whole round ran while the writer thread sat blocked inside write().
        assert not release.is_set() and pub._writing and pub.writes == writes0
    finally:
        release.set()
    assert out == baseline_outputs
    assert offers >= 50 and pub.drops - drops0 >= offers - 2
    assert pub.flush(WAIT_SECONDS)
    monkeypatch.undo()
    state = _published(g)
    assert state.publish_drops_total == pub.drops
    assert state.reports[-1].checkpoint_id == g.reports[-1].checkpoint_id
    print(f"[reliability] blocked writer: {offers} offers returned, {pub.drops - drops0} "
          "states dropped, outputs unchanged")


def test_a_hung_then_killed_sidecar_does_not_touch_the_engine(
    guarded: ReliabilityEngine, baseline_outputs: Outputs, tmp_path: Path,
) -> None:
    g = guarded.g
    run_dir = g.publisher.path.parent
    sidecar = Sidecar(run_dir, tmp_path / "sidecar.log").start()
    try:
        sidecar.wait_healthy()
        sidecar.wait_engine_up(g)
        # Hung: the sidecar is stopped and another reader holds the state file open and locked.
        with g.publisher.path.open("rb") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            sidecar.signal(signal.SIGSTOP)
            out = guarded.mixed_round()
            state = _published(g)
            sidecar.signal(signal.SIGCONT)
        assert out == baseline_outputs
        last = g.reports[-1].checkpoint_id
        assert state.reports[-1].checkpoint_id == last
        wait_for(lambda: sidecar.get("/v1/checkpoints", engine=ENGINE)
                 .json()["checkpoints"][-1]["checkpoint_id"] == last, what="sidecar caught up")

        # Gone: killed mid-round, and its run directory removed under the engine.
        def vanish(step: int) -> None:
            if step == 5:
                sidecar.kill()
            if step == 6:
                shutil.rmtree(run_dir, ignore_errors=True)  # the writer may race us

        assert guarded.mixed_round(vanish) == baseline_outputs
        assert _published(g).reports[-1].checkpoint_id == g.reports[-1].checkpoint_id
        assert g.errors.by_hook.get("publish", 0) == _published(g).hook_errors_by_hook.get(
            "publish", 0)
    finally:
        sidecar.stop()
    print("[reliability] sidecar SIGSTOPped + state file locked, then SIGKILLed + run dir "
          "removed: outputs unchanged")


def test_a_corrupt_state_file_where_the_sidecar_reads_is_rejected_and_replaced(
    guarded: ReliabilityEngine, baseline_outputs: Outputs, monkeypatch: pytest.MonkeyPatch,
) -> None:
    g = guarded.g
    run_dir = g.publisher.path.parent
    _published(g)
    store = EngineStore(run_dir)
    store.refresh()
    assert ENGINE in store.engines and not store.read_errors
    junk = {"junk.json": b"\x00\xffnot json{", "fifo.json": None, "zero.json": None,
            "dir.json": None}
    corrupted: dict[str, str] = {}

    def corrupt(step: int) -> None:
        if step != 5:
            return
        assert g.publisher.flush(WAIT_SECONDS)
        hold = threading.Event()
        write = g.publisher._write

        def held(state: EngineState) -> None:  # keep the writer from repairing it at once
            hold.wait(30)
            write(state)

        monkeypatch.setattr(g.publisher, "_write", held)
        try:
            g.publisher.path.write_bytes(b'{"schema_version": 1, "engine": "rel-faults", "ep')
            (run_dir / "junk.json").write_bytes(b"\x00\xffnot json{")
            os.mkfifo(run_dir / "fifo.json")
            os.symlink("/dev/zero", run_dir / "zero.json")
            (run_dir / "dir.json").mkdir()
            request_path(run_dir, ENGINE).write_bytes(os.urandom(64))
            store.refresh()  # never blocks on the FIFO, never reads /dev/zero
            store.refresh()
            corrupted.update(store.read_errors)
        finally:
            hold.set()
            monkeypatch.undo()

    try:
        out = guarded.mixed_round(corrupt)
        assert out == baseline_outputs
        assert set(corrupted) == {f"{ENGINE}.json", *junk}
        assert "not a valid kvguard state" in corrupted[f"{ENGINE}.json"]
        assert all("not a regular file" in corrupted[n] for n in ("fifo.json", "zero.json",
                                                                   "dir.json"))
        assert store.num_read_errors == 5  # each bad file counted once, not per refresh
        # The engine's next publish replaces the garbage; the reader takes it up again.
        state = _published(g)
        store.refresh()
        assert f"{ENGINE}.json" not in store.read_errors
        assert store.engines[ENGINE].state.updated_at >= state.updated_at  # (a heartbeat)
        assert store.num_read_errors == 5
    finally:
        for name in junk:
            p = run_dir / name
            if p.is_dir() and not p.is_symlink():
                p.rmdir()
            elif p.exists() or p.is_symlink():
                p.unlink()
    print("[reliability] corrupt/truncated state file, FIFO, /dev/zero symlink, directory, "
          "garbage checkpoint request during a round: outputs unchanged")
