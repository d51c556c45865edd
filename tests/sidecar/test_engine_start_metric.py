"""``kvguard_engine_start_timestamp_seconds``: when the engine process started, what
KvguardNoAudit and the dashboard's "age of the last verdict" count from when an engine has
no audit yet."""

from __future__ import annotations

import time
from pathlib import Path

from factories import report, state, write
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvguard.sidecar.app import create_app
from kvguard.sidecar.store import EngineStore

NAME = "kvguard_engine_start_timestamp_seconds"


def _samples(run_dir: Path) -> dict[str, list[tuple[dict[str, str], float]]]:
    store = EngineStore(run_dir)
    store.refresh()
    with TestClient(create_app(store, poll_interval_seconds=3600)) as c:
        text = c.get("/metrics").text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_start_time_is_the_engines_own_per_engine_and_stays_while_it_is_stale(
        tmp_path: Path) -> None:
    fresh = state([report(1)], engine="dp0").model_copy(update={"started_at": 1_700_000_000.5})
    stale = state([], engine="dp1", engine_index=1, updated_at=time.time() - 3600
                  ).model_copy(update={"started_at": 1_700_000_100.0})
    write(tmp_path, fresh)
    write(tmp_path, stale)
    m = _samples(tmp_path)
    started = {lbl["engine_name"]: v for lbl, v in m[NAME]}
    assert started == {"dp0": 1_700_000_000.5, "dp1": 1_700_000_100.0}
    up = {lbl["engine_name"]: v for lbl, v in m["kvguard_engine_up"]}
    assert up == {"dp0": 1.0, "dp1": 0.0}
    labels = {tuple(sorted(lbl)) for lbl, _ in m[NAME]}
    assert labels == {("engine", "engine_name", "model_name")}
