"""``kvguard_offload_*`` on /metrics: from an engine state with an offload audit."""

from __future__ import annotations

from pathlib import Path

from factories import report, state, write
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvguard.core.offload import (
    JobKind,
    OffloadAudit,
    OffloadJob,
    OffloadReading,
    OffloadTier,
    WaitingRequest,
)
from kvguard.sidecar.app import create_app
from kvguard.sidecar.store import EngineStore


def _metrics(run_dir: Path) -> dict[str, list[tuple[dict[str, str], float, str]]]:
    store = EngineStore(run_dir)
    store.refresh()
    with TestClient(create_app(store, poll_interval_seconds=0.05)) as c:
        text = c.get("/metrics").text
    out: dict[str, list[tuple[dict[str, str], float, str]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value, fam.type))
    return out


def test_offload_series_follow_the_audit_without_request_labels(tmp_path: Path) -> None:
    audit = OffloadAudit("OffloadingConnector", 1.0, "test")
    stuck = OffloadJob(job_id=7, kind=JobKind.STORE, request_id="lost-1a2b",
                       client_request_id="lost", request_finished=True, chunks=5,
                       fenced_blocks=5, age_seconds=9.0, age_steps=40)
    tier = OffloadTier(capacity=100, ready=12, read_pinned=2, write_pending=5, free=83)
    offload = audit.judge(OffloadReading([stuck], tier, [WaitingRequest(
        request_id="w-9f", client_request_id="w", waited_seconds=4.0)]))
    write(tmp_path, state([report(1)]).model_copy(update={"offload": offload}))
    m = _metrics(tmp_path)
    chunks = {lbl["state"]: v for lbl, v, _ in m["kvguard_offload_tier_chunks"]}
    assert chunks == {"ready": 10, "read_pinned": 2, "write_pending": 5, "free": 83}
    assert sum(chunks.values()) == tier.capacity
    assert {lbl["kind"]: v for lbl, v, _ in m["kvguard_offload_jobs_in_flight"]} == {
        "store": 1, "load": 0}
    assert m["kvguard_offload_stuck_jobs"][0][1:] == (1.0, "gauge")
    assert m["kvguard_offload_jobs_stuck_total"][0][1:] == (1.0, "counter")
    assert m["kvguard_offload_oldest_job_age_seconds"][0][1] == 9.0
    assert m["kvguard_offload_waiting_requests"][0][1] == 1.0
    assert {lbl["verdict"]: v for lbl, v, _ in m["kvguard_offload_verdict"]} == {
        "ok": 0.0, "stuck": 1.0, "tier_mismatch": 0.0}
    for name, samples in m.items():
        if name.startswith("kvguard_offload_"):
            for labels, _, _ in samples:
                assert set(labels) <= {"engine_name", "model_name", "engine", "state", "kind",
                                       "verdict"}, (name, labels)


def test_no_offload_series_without_an_offloading_connector(tmp_path: Path) -> None:
    write(tmp_path, state([report(1)]))
    assert not [n for n in _metrics(tmp_path) if n.startswith("kvguard_offload_")]
