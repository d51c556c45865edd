"""``kvguard report --transfers --sidecar URL --sidecar URL``: engines named once across
several sidecars (the join itself runs on a real P/D recording in
``tests/observability/test_pd_observability.py`` and on two nodes in ``tests/crossnode``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from factories import report, state, write
from fastapi.testclient import TestClient

from kvguard.cli.sidecars import SidecarReport, read_sidecars, transfers_by_engine
from kvguard.errors import TransportError
from kvguard.sidecar.app import create_app
from kvguard.sidecar.models import ReportsResponse
from kvguard.sidecar.store import EngineStore


def _served(run_dir: Path, *engines: str) -> ReportsResponse:
    for name in engines:
        write(run_dir, state([report(1, engine=name)], engine=name))
    store = EngineStore(run_dir)
    store.refresh()
    with TestClient(create_app(store)) as client:
        return ReportsResponse.model_validate_json(client.get("/v1/report").content)


def test_an_engine_name_two_sidecars_share_is_qualified_by_its_sidecar(tmp_path: Path) -> None:
    a = SidecarReport("http://10.0.0.1:9400", _served(tmp_path / "a", "dp0", "prefill"))
    b = SidecarReport("http://10.0.0.2:9400/", _served(tmp_path / "b", "dp0"))
    assert set(transfers_by_engine([a, b])) == {
        "prefill", "dp0@10.0.0.1:9400", "dp0@10.0.0.2:9400"}


def test_a_sidecar_that_cannot_be_read_is_named_and_nothing_is_joined() -> None:
    with pytest.raises(TransportError, match=r"127\.0\.0\.1:9/v1/report.*kvguard sidecar"):
        read_sidecars(["http://127.0.0.1:9"], timeout_seconds=2.0)
