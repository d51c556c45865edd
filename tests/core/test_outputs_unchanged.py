"""What a user sees stays byte-identical across refactors of the session's inside.

Seven recorded cases drive a :class:`GuardSession` through every feature it coordinates
(drained and online audits, the checkpoint pace, P/D transfers and their hazards, the
offload audit, the KV-event snapshot, request tracing, idle wakes) on a frozen clock, and
keep every state the session offers, the sidecar's ``/v1/report`` and ``/metrics`` bodies
for the last one, and the CLI's rendering of it. ``golden/outputs.json`` holds what the
session before the monitor split (main at efff1fc) produced; the test fails on the first
byte that differs.

Refresh the recording only for a change a user is meant to see:
``PYTHONPATH=$PWD .venv/bin/python tests/core/test_outputs_unchanged.py --record``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _pool import Harness, RefAdapter, Req
from _sinks import AskOnce, ListSink

from kvguard.cli.render import render_state
from kvguard.config import KvguardConfig
from kvguard.core import online as online_module
from kvguard.core.engine import EngineActivity
from kvguard.core.offload import JobKind, OffloadJob, OffloadReading, OffloadTier
from kvguard.core.report import CheckpointReport
from kvguard.core.session import GuardSession
from kvguard.core.state import EngineState, TracingState
from kvguard.core.transfers import (
    TransferEvent,
    TransferEventKind,
    TransferHazard,
    TransferOutcome,
    TransferRecord,
    TransferRole,
    WorkerRankState,
)
from kvguard.core.types import FinishReason
from kvguard.kv_events.digest import digest_hex
from kvguard.kv_events.snapshot import KvEventsSnapshot, KvEventsState

GOLDEN = Path(__file__).resolve().parent / "golden" / "outputs.json"
WALL0 = 1_700_000_000.0
MONO0 = 5_000.0


class Clock:
    """The frozen clock every case runs on: time moves only when a case says so, so the
    number of clock reads (an implementation detail) never shows in the output."""

    def __init__(self) -> None:
        self.wall, self.mono = WALL0, MONO0

    def advance(self, seconds: float) -> None:
        self.wall += seconds
        self.mono += seconds


@contextmanager
def frozen(clock: Clock) -> Iterator[None]:
    saved = (time.time, time.monotonic, time.perf_counter, online_module.perf_counter,
             os.getpid)
    time.time = lambda: clock.wall
    time.monotonic = lambda: clock.mono
    time.perf_counter = lambda: 0.0
    online_module.perf_counter = lambda: 0.0
    os.getpid = lambda: 4242
    try:
        yield
    finally:
        (time.time, time.monotonic, time.perf_counter, online_module.perf_counter,
         os.getpid) = saved


def _config(**settings: object) -> KvguardConfig:
    base: dict[str, object] = {"publish_interval_seconds": 0.0, "online_audit": False}
    return KvguardConfig.from_env({}, **(base | settings))


def _session(h: Harness, adapter: RefAdapter | None = None, **settings: object
             ) -> tuple[GuardSession, ListSink, AskOnce]:
    sink, asks = ListSink(), AskOnce()
    s = GuardSession(adapter or RefAdapter(h), _config(**settings), engine="ref0", sink=sink,
                     requests=asks)
    h.ledger = s.ledger
    return s, sink, asks


def _load(h: Harness, n: int) -> list[Req]:
    reqs = []
    for _ in range(n):
        r = h.admit()
        h.allocate(r, 3, hash_mask=[True, True, False], attributed=False)
        reqs.append(r)
    return reqs


# ------------------------------------------------------------------ cases
def case_drained_leak(clock: Clock) -> ListSink:
    h = Harness(64, lazy_claims=True)
    s, sink, asks = _session(h)
    reqs = _load(h, 6)
    asks.asked = True
    clock.advance(0.5)
    s.on_step_end(step_seconds=0.01)  # asked while busy: skipped, with the drain model
    h.skip_free_on_abort(reqs[2])
    s.on_finished(reqs[2].rid, FinishReason.ABORTED, clock.wall)
    s.on_freed(reqs[2].rid, clock.wall)
    h.drain(attributed=False)
    clock.advance(1.0)
    s.on_release_done()
    s.on_step_end()
    s.publish()
    return sink


def case_online_leak(clock: Clock) -> ListSink:
    h = Harness(48, lazy_claims=True)
    s, sink, _ = _session(h, online_audit=True)
    reqs = _load(h, 5)
    h.skip_free_on_abort(reqs[1])
    for _ in range(40):
        clock.advance(0.01)
        s.on_step_end(step_seconds=0.01)
    h.drain(attributed=False)
    clock.advance(1.0)
    s.on_release_done()
    s.on_step_end(step_seconds=0.01)
    for _ in range(10):
        clock.advance(0.01)
        s.on_step_end(step_seconds=0.01)
    s.publish()
    return sink


def case_paced(clock: Clock) -> ListSink:
    h = Harness(64, lazy_claims=True)
    s, sink, _ = _session(h, checkpoint_min_interval_seconds=10.0, checkpoint_burst=1)
    for _ in range(3):
        r = _load(h, 1)[0]
        h.finish(r, FinishReason.STOPPED, attributed=False)
        s.on_release_done()
        clock.advance(1.0)
        s.on_step_end()
    s.on_admitting()
    clock.advance(10.0)
    s.on_admitting()
    s.publish()
    return sink


class ScriptedNixl:
    connector = "NixlConnector"
    kv_role = "kv_producer"
    kv_engine_id = "P-uuid"
    hold_source = "NixlConnector live leases"
    errors = 0

    def __init__(self) -> None:
        self.leases: dict[str, float] | None = {}
        self.events: list[TransferEvent] = []

    def hold_deadlines(self) -> dict[str, float] | None:
        return None if self.leases is None else dict(self.leases)

    def drain_events(self) -> list[TransferEvent]:
        out, self.events = self.events, []
        return out

    def worker_ranks(self) -> list[WorkerRankState]:
        return []


class HoldingAdapter(RefAdapter):
    """The reference engine, plus finished requests it keeps (delayed frees), a P/D
    connector and an offload source when given."""

    def __init__(self, h: Harness, transfers: ScriptedNixl | None = None,
                 offload: Any = None) -> None:
        super().__init__(h)
        self.held: list[Req] = []
        self.deferred = 0
        self.transfers = transfers
        self.offload = offload

    def request_tables(self) -> dict[str, list[int]]:
        return super().request_tables() | {r.rid: list(r.blocks) for r in self.held}

    def activity(self) -> EngineActivity:
        act = super().activity()
        return EngineActivity(running=act.running, waiting=act.waiting,
                              deferred_frees=self.deferred, unfinished=None,
                              finished_held=tuple(r.rid for r in self.held))

    def kv_transfers(self) -> ScriptedNixl | None:
        return self.transfers

    def offload_source(self) -> Any:
        return self.offload


class Traces:
    """A tracer that writes down what it is told (the session's calls, in order)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def released(self, request_id: str) -> None:
        self.calls.append(f"released {request_id}")

    def prune(self, tracked: Callable[[str], bool]) -> None:
        self.calls.append("prune")

    def report(self, report: CheckpointReport) -> None:
        self.calls.append(f"report {report.checkpoint_id} {report.verdict.value}")

    def transfer_ended(self, rec: TransferRecord, blocks: int | None) -> None:
        self.calls.append(f"transfer_ended {rec.request_id} {rec.outcome.value} {blocks}")

    def hazard(self, hz: TransferHazard, rec: TransferRecord | None) -> None:
        self.calls.append(f"hazard {hz.kind.value} {rec is not None}")

    def state(self) -> TracingState:
        return TracingState(service_name="svc", traced_requests=len(self.calls))

    def close(self) -> None:
        self.calls.append("close")


class Waker:
    def __init__(self) -> None:
        self.wakes: list[float] = []

    def wake_after(self, seconds: float) -> None:
        self.wakes.append(round(seconds, 6))

    def close(self) -> None:
        self.wakes.append(-1.0)


def _held(h: Harness, s: GuardSession, adapter: HoldingAdapter, clock: Clock) -> Req:
    r = h.admit()
    h.allocate(r, 3, hash_mask=[True, True, False], attributed=True)
    s.on_admitted(r.rid, clock.wall)
    s.on_finished(r.rid, FinishReason.STOPPED, clock.wall)
    s.on_delayed_free_started(r.rid, clock.wall)
    r.phase = "finished"
    adapter.held.append(r)
    return r


def case_transfers_traced(clock: Clock) -> ListSink:
    h = Harness(32, lazy_claims=True)
    src = ScriptedNixl()
    adapter = HoldingAdapter(h, transfers=src)
    s, sink, _ = _session(h, adapter, delayed_free_bound_seconds=4.0)
    traces, waker = Traces(), Waker()
    s.tracer = traces
    s.idle_waker = waker
    a = _held(h, s, adapter, clock)
    s.on_transfer(TransferEvent(TransferEventKind.STARTED, a.rid, clock.wall,
                                role=TransferRole.PREFILL, remote_engine_id="D-uuid",
                                remote_request_id="d-1"))
    src.leases = {a.rid: clock.wall + 20.0}
    clock.advance(1.0)
    s.on_release_done()
    s.on_step_end(step_seconds=0.01)  # held by a live lease: not drained, wake at its end
    b = _held(h, s, adapter, clock)
    src.events.append(TransferEvent(TransferEventKind.STARTED, b.rid, clock.wall,
                                    role=TransferRole.PREFILL))
    clock.advance(1.0)
    s.on_step_end(step_seconds=0.01)
    src.leases = {a.rid: clock.wall + 20.0}  # b's lease let go: grace only
    clock.advance(0.3)
    s.on_idle()
    src.events.append(TransferEvent(TransferEventKind.LATE_READ, b.rid, clock.wall))
    clock.advance(6.0)
    s.on_idle()  # b past its grace: drained moment with a held request -> leak
    d = h.admit()  # a decode request whose KV never arrived
    s.on_admitted(d.rid, clock.wall)
    s.on_transfer(TransferEvent(TransferEventKind.STARTED, d.rid, clock.wall,
                                role=TransferRole.DECODE, remote_engine_id="P2",
                                remote_request_id="p-9"))
    s.on_finished(d.rid, FinishReason.ABORTED, clock.wall)
    s.on_freed(d.rid, clock.wall)
    d.phase = "finished"
    adapter.held.remove(a)
    h._release(a, attributed=True)
    s.on_transfer(TransferEvent(TransferEventKind.ENDED, a.rid, clock.wall,
                                outcome=TransferOutcome.READ, reads=1))
    s.on_freed(a.rid, clock.wall)
    clock.advance(30.0)
    s.on_idle()
    s.request_checkpoint()
    s.on_step_end()
    s.close()
    sink.states.append(sink.states[-1].model_copy(
        update={"hooks_missing": [*traces.calls, *map(str, waker.wakes)]}))
    return sink


def _job(job_id: int, age: float, kind: JobKind = JobKind.STORE) -> OffloadJob:
    return OffloadJob(job_id=job_id, kind=kind, request_id=f"r{job_id}-abcd",
                      client_request_id=f"r{job_id}", request_finished=True, chunks=5,
                      fenced_blocks=5, age_seconds=age, age_steps=10)


class OffloadSource:
    connector = "OffloadingConnector"

    def __init__(self) -> None:
        self.age = 0.0

    def read(self) -> OffloadReading:
        self.age += 3.0
        return OffloadReading([_job(1, self.age)],
                              OffloadTier(capacity=100, ready=10, read_pinned=0,
                                          write_pending=5, free=85), [])


def case_offload(clock: Clock) -> ListSink:
    h = Harness(64, lazy_claims=True)
    adapter = HoldingAdapter(h, offload=OffloadSource())
    s, sink, _ = _session(h, adapter, offload_job_bound_seconds=5.0)
    _load(h, 2)
    for _ in range(4):
        clock.advance(0.3)
        s.on_step_end(step_seconds=0.01)
    h.drain(attributed=False)
    s.on_release_done()
    s.on_step_end()
    clock.advance(0.2)
    s.on_idle()
    return sink


class KvSource:
    def __init__(self) -> None:
        self.seq = 3

    def snapshot(self, checkpoint_id: int, taken_at: float) -> KvEventsSnapshot:
        self.seq += 2
        keys = [f"0:{k:02x}" for k in range(self.seq)]
        return KvEventsSnapshot(checkpoint_id=checkpoint_id, taken_at=taken_at,
                                last_seq=self.seq, num_blocks=len(keys),
                                digest=digest_hex(keys), block_keys=keys)

    def state(self, snapshot: KvEventsSnapshot | None) -> KvEventsState:
        return KvEventsState(endpoint="ipc:///x", batches_published=self.seq + 1,
                             snapshot=snapshot)


def case_kv_events_idle(clock: Clock) -> ListSink:
    h = Harness(64, lazy_claims=True)
    s, sink, _ = _session(h, idle_recheck_seconds=5.0)
    s.kv_events = KvSource()
    waker = Waker()
    s.idle_waker = waker
    for _ in range(2):
        r = _load(h, 1)[0]
        h.finish(r, FinishReason.LENGTH, attributed=False)
        s.on_release_done()
        s.on_step_end()
        clock.advance(6.0)
        s.on_idle()
    s.close()
    return sink


CASES: dict[str, Callable[[Clock], ListSink]] = {
    "drained_leak": case_drained_leak,
    "online_leak": case_online_leak,
    "paced": case_paced,
    "transfers_traced": case_transfers_traced,
    "offload": case_offload,
    "kv_events_idle": case_kv_events_idle,
}


# ------------------------------------------------------------ what a user sees
def _sidecar_views(state: EngineState, clock: Clock) -> dict[str, str]:
    from fastapi.testclient import TestClient

    from kvguard.sidecar.app import create_app
    from kvguard.sidecar.store import EngineStore
    from kvguard.transport.publisher import state_path

    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d)
        state_path(run_dir, state.engine).write_text(state.model_dump_json())
        store = EngineStore(run_dir)
        store.refresh()
        with TestClient(create_app(store)) as client:
            report = client.get("/v1/report").text
            metrics = client.get("/metrics").text
    return {"report": report, "metrics": metrics, "cli": render_state(state)}


def run_cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, case in CASES.items():
        clock = Clock()
        with frozen(clock):
            sink = case(clock)
            views = _sidecar_views(sink.states[-1], clock)
        out[name] = {"states": [s.model_dump_json() for s in sink.states], **views}
    return out


def test_what_users_see_is_byte_identical_to_the_recording() -> None:
    recorded = json.loads(GOLDEN.read_text())
    now = run_cases()
    assert list(now) == list(recorded)
    for name, views in recorded.items():
        for key, want in views.items():
            got = now[name][key]
            if key == "states":
                assert len(got) == len(want), f"{name}: {len(got)} states, {len(want)} recorded"
                for i, (g, w) in enumerate(zip(got, want, strict=True)):
                    assert g == w, f"{name}: state {i} differs"
            else:
                assert got == want, f"{name}: {key} differs"


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(f"usage: {sys.argv[0]} --record")
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(run_cases(), indent=1) + "\n")
    print(f"recorded {GOLDEN}")
