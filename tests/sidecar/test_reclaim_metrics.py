"""The opt-in reclaim in the sidecar: ``kvguard_reclaimed_blocks_total{cause}``,
``kvguard_reclaims_refused_total{reason}``, ``/v1/report`` and ``kvguard report --json``, on
engine states written as an engine would (the reclaim section of a real ``ReclaimWatch``).

What a user relies on: blocks counted per cause and refusals per reason, from 0, with no
per-request label; the reclaimed request ids and block ids only in the report; nothing at
all for an engine with reclaim off; a schema-10 state (before reclaim) is still read.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from factories import report, state, write
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvguard.cli.main import main
from kvguard.core.hook_errors import HookErrors
from kvguard.core.monitors.reclaim import ReclaimWatch
from kvguard.core.reclaim import ReclaimOutcome, ReclaimState, RefusalReason
from kvguard.core.wedge import DeadOwner, DeadOwnerKind
from kvguard.sidecar.app import create_app
from kvguard.sidecar.store import EngineStore


def _reclaim_state() -> ReclaimState:
    """A monitor that reclaimed one skipped free of 10 blocks and refused an orphan."""
    watch = ReclaimWatch(SimpleNamespace(errors=HookErrors(), engine="dp0"),  # type: ignore[arg-type]
                         SimpleNamespace(), SimpleNamespace(), 3)  # type: ignore[arg-type]
    victim = DeadOwner(DeadOwnerKind.FINISHED_REQUEST, "chat-7", frozenset(range(1, 11)),
                       engine_request_id="chat-7-abc")
    watch._note(victim, ReclaimOutcome(freed_block_ids=tuple(range(1, 11)),
                                       path="KVCacheManager.free"))
    orphan = DeadOwner(DeadOwnerKind.ORPHAN, None, frozenset({12}))
    watch._note(orphan, watch._attempt(orphan))
    return watch.state()


def _series(c: TestClient) -> dict[tuple[str, str], float]:
    out = {}
    for fam in text_string_to_metric_families(c.get("/metrics").text):
        if fam.name in ("kvguard_reclaimed_blocks", "kvguard_reclaims_refused"):
            assert fam.type == "counter"
            for s in fam.samples:
                if s.name.endswith("_total"):
                    extra = set(s.labels) - {"engine_name", "model_name", "engine"}
                    assert extra in ({"cause"}, {"reason"}), s.labels  # no request label
                    out[(s.name, s.labels.get("cause") or s.labels["reason"])] = s.value
    return out


def test_reclaims_are_counted_by_cause_and_reason_and_listed_in_the_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path, state([report(1)], engine="dp0").model_copy(
        update={"reclaim": _reclaim_state()}))
    write(tmp_path, state([report(1)], engine="dp1", epoch="e2"))  # reclaim off
    store = EngineStore(tmp_path)
    store.refresh()
    with TestClient(create_app(store)) as c:
        series = _series(c)
        body = c.get("/v1/report").json()
    assert series[("kvguard_reclaimed_blocks_total", "finished_request")] == 10.0
    assert series[("kvguard_reclaimed_blocks_total", "delayed_free")] == 0.0
    assert series[("kvguard_reclaims_refused_total", "owner_unknown")] == 1.0
    assert {r for (n, r) in series if n == "kvguard_reclaims_refused_total"} == \
        {x.value for x in RefusalReason}
    engines = {e["engine"]: e for e in body["engines"]}
    assert engines["dp1"]["reclaim"] is None
    recent = engines["dp0"]["reclaim"]["recent"]
    assert [(e["request_id"], e["reclaimed"], e["blocks"], e["block_ids"]) for e in recent] == \
        [("chat-7", True, 10, list(range(1, 11))), (None, False, 1, [12])]
    assert main(["report", "--json", "--run-dir", str(tmp_path)]) == 0
    cli = [e["reclaim"] for e in json.loads(capsys.readouterr().out)]
    assert sorted(cli, key=lambda r: r is not None) == [None, engines["dp0"]["reclaim"]]


def test_no_reclaim_series_without_an_engine_that_reclaims(tmp_path: Path) -> None:
    write(tmp_path, state([report(1)]))
    store = EngineStore(tmp_path)
    store.refresh()
    with TestClient(create_app(store)) as c:
        assert _series(c) == {}


def test_a_state_of_schema_10_is_read(tmp_path: Path) -> None:
    old = state([report(1)]).model_dump(mode="json")
    del old["reclaim"]
    old["schema_version"] = 10
    (tmp_path / "dp0.json").write_text(json.dumps(old))
    store = EngineStore(tmp_path)
    store.refresh()
    assert list(store.engines) == ["dp0"] and store.engines["dp0"].state.reclaim is None
