"""No way in: loopback by default, an owner-only Unix socket, and a token on every write."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path
from typing import Any

import pytest
from _reliability import Sidecar, wait_for
from factories import report, state, write
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.routing import Route

from kvguard.cli.main import main
from kvguard.config import KvguardConfig
from kvguard.sidecar.app import create_app
from kvguard.sidecar.store import EngineStore

TOKEN = "s3cret-control-token"
READ_METHODS = {"GET", "HEAD"}
WRITE_METHODS = ("POST", "PUT", "PATCH", "DELETE")


def _listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp*) that listen on ``port``."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state_ = line.split()[1], line.split()[3]
                addr, _, hex_port = local.partition(":")
                if state_ == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    out.add(addr)
    return out


def test_the_sidecar_binds_loopback_by_default(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    for key in list(os.environ):
        if key.startswith("KVGUARD_SIDECAR"):
            monkeypatch.delenv(key)
    cfg = KvguardConfig.from_env({})
    assert (cfg.sidecar_host, cfg.sidecar_port, cfg.sidecar_uds) == ("127.0.0.1", 9400, None)
    seen: dict[str, Any] = {}
    monkeypatch.setattr("kvguard.sidecar.server.serve", lambda **kw: seen.update(kw))
    assert main(["sidecar"]) == 0
    assert (seen["host"], seen["port"], seen["uds"]) == ("127.0.0.1", 9400, None)

    # The real command, on a free port: it listens on 127.0.0.1 and nowhere else.
    sidecar = Sidecar(tmp_path / "run", tmp_path / "sidecar.log").start()
    try:
        sidecar.wait_healthy()
        assert sidecar.port is not None
        assert _listening_addresses(sidecar.port) == {"0100007F"}  # 127.0.0.1, little-endian
    finally:
        sidecar.stop()


def test_the_unix_socket_is_owner_only_and_replaces_only_a_stale_socket(
    tmp_path: Path,
) -> None:
    sock_path = tmp_path / "kvguard.sock"
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(sock_path))  # a socket left behind by a crashed sidecar
    stale.close()
    os.chmod(sock_path, 0o777)
    write(tmp_path / "run", state([report(1)]))
    sidecar = Sidecar(tmp_path / "run", tmp_path / "sidecar.log", uds=sock_path).start()
    try:
        sidecar.wait_healthy()
        st = os.stat(sock_path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.getuid()
        assert sidecar.get("/healthz").json()["engines"] == 1
    finally:
        sidecar.stop()

    # Anything that is not a socket at that path is left alone, with a clear error.
    precious = tmp_path / "not-a-socket"
    precious.write_text("keep me")
    blocked = Sidecar(tmp_path / "run", tmp_path / "blocked.log", uds=precious).start()
    assert blocked.process is not None
    assert blocked.process.wait(timeout=60) == 2
    assert precious.read_text() == "keep me"
    assert "KVGUARD_SIDECAR_UDS" in (tmp_path / "blocked.log").read_text()


def _routes(app: Any) -> list[tuple[str, set[str]]]:
    """Every path the app serves, with all the methods of all its routes."""
    by_path: dict[str, set[str]] = {}
    for r in app.routes:
        if isinstance(r, APIRoute | Route):
            by_path.setdefault(r.path, set()).update(r.methods or ())
    return sorted(by_path.items())


def _concrete(path: str) -> str:
    return path.replace("{name}", "kvguard.css").replace("{", "").replace("}", "")


def test_every_route_that_is_not_a_read_needs_the_token(tmp_path: Path) -> None:
    write(tmp_path, state([report(1)]))
    store = EngineStore(tmp_path)
    store.refresh()
    app = create_app(store, control_token=TOKEN)
    routes = _routes(app)
    writes = [(p, m) for p, methods in routes for m in sorted(methods - READ_METHODS)]
    assert writes == [("/v1/checkpoints", "POST")]  # the only way to change anything
    before = sorted(p.name for p in tmp_path.iterdir())
    with TestClient(app) as c:
        for path, method in writes:
            assert c.request(method, path).status_code == 401
            assert c.request(method, path, headers={"Authorization": "Bearer x"}
                             ).status_code == 403
            assert c.request(method, path, headers={"Authorization": TOKEN}).status_code == 403
        # No other method is accepted anywhere, and reads change nothing on disk.
        for path, methods in routes:
            url = _concrete(path)
            for method in WRITE_METHODS:
                if method not in methods:
                    r = c.request(method, url)
                    assert r.status_code == 405 and r.json()["detail"], (method, url)
                    assert set(r.headers["allow"].split(", ")) >= methods - {"HEAD"}
            for method in methods & READ_METHODS:
                assert c.request(method, url).status_code in (200, 404), url
        assert sorted(p.name for p in tmp_path.iterdir()) == before
        r = c.post("/v1/checkpoints", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 202
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*before, "dp0.checkpoint-request"])


def test_a_sidecar_with_a_token_refuses_writes_over_the_network(tmp_path: Path) -> None:
    write(tmp_path / "run", state([report(1)]))
    sidecar = Sidecar(tmp_path / "run", tmp_path / "sidecar.log",
                      env={"KVGUARD_CONTROL_TOKEN": TOKEN}).start()
    try:
        sidecar.wait_healthy()
        wait_for(lambda: sidecar.get("/healthz").json()["engines"] == 1, what="engine read")
        with sidecar.client() as c:
            assert c.post("/v1/checkpoints").status_code == 401
            assert c.post("/v1/checkpoints", headers={"Authorization": "Bearer no"}
                          ).status_code == 403
            assert not (tmp_path / "run" / "dp0.checkpoint-request").exists()
            assert c.post("/v1/checkpoints", headers={"Authorization": f"Bearer {TOKEN}"}
                          ).status_code == 202
        assert (tmp_path / "run" / "dp0.checkpoint-request").exists()
    finally:
        sidecar.stop()
