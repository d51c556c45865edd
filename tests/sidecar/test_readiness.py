"""``/v1/ready`` and ``kvguard_engine_wedged`` on engine states written as an engine would.

The wedge sections come from kvguard's own monitor (``WedgeMonitor``), fed a waiting
queue and the dead owners of a real ledger in which an abort skipped its free; the busy
engine's ledger has only live owners. What a user relies on: the pod leaves rotation
(503, with the reason) while an engine is wedged or silent, and never for a busy or
saturated pool.
"""

from __future__ import annotations

import json
from pathlib import Path

from factories import report, state, write
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvguard.core.dead_owners import dead_owners
from kvguard.core.ledger import OwnershipLedger
from kvguard.core.types import AcquireKind, FinishReason, RequestId
from kvguard.core.wedge import WaitingView, WedgeOptions
from kvguard.core.wedge_monitor import WedgeMonitor, WedgeState
from kvguard.sidecar.app import create_app
from kvguard.sidecar.store import EngineStore

CAPACITY = 63


class _Queue:
    def __init__(self, free: int) -> None:
        self.waiting = ["head", "next"]
        self.free = free

    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return 0 if self.free else 4

    def head_request_id(self) -> str | None:
        return self.waiting[0] if self.waiting else None

    def read(self, now: float) -> WaitingView:
        return WaitingView(len(self.waiting), self.num_running(), 45.0, 4, self.free,
                           CAPACITY)


def _wedge(*, leak: bool, admit_after: bool = False) -> WedgeState:
    """A monitor's state after 40 s of stall; ``leak``: an abort skipped its free of 61
    blocks (else every held block belongs to running requests)."""
    ledger = OwnershipLedger()
    rid = RequestId("chat-7-abc")
    ledger.on_request_admitted(rid, 900.0)
    ledger.on_blocks_acquired(rid, list(range(1, 62)), AcquireKind.ALLOCATE)
    if leak:
        ledger.on_request_finished(rid, FinishReason.ABORTED, 950.0)
        ledger.on_request_freed(rid, 950.0)
    q = _Queue(free=2 if leak else 0)
    mon = WedgeMonitor(q, lambda now: dead_owners(ledger, now=now, bound_seconds=30.0),
                       WedgeOptions(after_seconds=30.0, after_steps=20))
    for t in range(41):
        mon.on_step_end(1000.0 + t, float(t))
    if admit_after:
        q.waiting.pop(0)
        mon.on_step_end(1041.0, 41.0)
    return mon.state()


def _client(run_dir: Path) -> TestClient:
    store = EngineStore(run_dir)
    store.refresh()
    return TestClient(create_app(store, poll_interval_seconds=0.05))


def _wedged_series(c: TestClient) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(c.get("/metrics").text):
        if fam.name == "kvguard_engine_wedged":
            assert fam.type == "gauge"
            for s in fam.samples:
                assert set(s.labels) == {"engine_name", "model_name", "engine"}
                out[s.labels["engine_name"]] = s.value
    return out


def test_a_wedged_engine_takes_the_pod_out_of_rotation_with_the_reason(tmp_path: Path) -> None:
    wedged = _wedge(leak=True)
    assert wedged.wedged and wedged.verdicts_total == 1
    write(tmp_path, state([report(1)], engine="dp0").model_copy(update={"wedge": wedged}))
    write(tmp_path, state([report(1)], engine="dp1", epoch="e2"))
    with _client(tmp_path) as c:
        r = c.get("/v1/ready")
        assert r.status_code == 503
        body = r.json()
        assert body["ready"] is False and "engine dp0" in body["reason"]
        assert "chat-7-abc" in body["reason"] and "61 block(s)" in body["reason"]
        assert [e["ready"] for e in body["engines"]] == [False, True]
        assert _wedged_series(c) == {"dp0": 1.0}


def test_a_busy_saturated_engine_stays_ready(tmp_path: Path) -> None:
    busy = _wedge(leak=False)
    assert not busy.wedged and busy.last is not None and busy.last.dead_blocks == 0
    write(tmp_path, state([report(1, cached=60)], engine="dp0").model_copy(
        update={"wedge": busy}))
    with _client(tmp_path) as c:
        r = c.get("/v1/ready")
        assert r.status_code == 200 and r.json()["ready"] is True
        assert _wedged_series(c) == {"dp0": 0.0}


def test_an_engine_that_admits_again_is_ready_again(tmp_path: Path) -> None:
    again = _wedge(leak=True, admit_after=True)
    assert not again.wedged and again.verdicts_total == 1
    write(tmp_path, state([report(1)]).model_copy(update={"wedge": again}))
    with _client(tmp_path) as c:
        assert c.get("/v1/ready").status_code == 200


def test_a_silent_engine_or_none_yet_is_not_ready(tmp_path: Path) -> None:
    with _client(tmp_path / "empty") as c:
        r = c.get("/v1/ready")
        assert r.status_code == 503 and "no engine has published" in r.json()["reason"]
    write(tmp_path, state([report(1)], updated_at=1.0))
    with _client(tmp_path) as c:
        r = c.get("/v1/ready")
        assert r.status_code == 503 and "stopped hearing" in r.json()["reason"]


def test_readiness_is_documented_with_its_503(tmp_path: Path) -> None:
    with _client(tmp_path) as c:
        op = c.get("/openapi.json").json()["paths"]["/v1/ready"]["get"]
        assert {"200", "503"} <= set(op["responses"])


def test_a_state_of_the_previous_schema_is_read_and_never_wedged(tmp_path: Path) -> None:
    """Schema 9 (before ``wedge``): an engine of the previous release stays readable."""
    old = state([report(1)]).model_dump(mode="json")
    del old["wedge"], old["reclaim"]
    old["schema_version"] = 9
    (tmp_path / "dp0.json").write_text(json.dumps(old))
    with _client(tmp_path) as c:
        r = c.get("/v1/ready")
        assert r.status_code == 200 and r.json()["engines"][0]["engine"] == "dp0"
