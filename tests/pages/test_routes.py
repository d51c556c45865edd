"""The page routes over HTTP: types, security headers, caching, and only known files."""

from __future__ import annotations

import re
import tomllib
from fnmatch import fnmatch
from importlib.resources import files
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvguard.sidecar.app import create_app
from kvguard.sidecar.pages.routes import _PAGES, _STATIC, CONTENT_SECURITY_POLICY
from kvguard.sidecar.store import EngineStore

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def client(tmp_path: Path) -> TestClient:
    return TestClient(create_app(EngineStore(tmp_path)))


@pytest.mark.parametrize(("path", "media_type"), [
    ("/", "text/html"), ("/lab", "text/html"),
    ("/static/kvguard.css", "text/css"), ("/static/status.js", "text/javascript"),
    ("/static/lab.js", "text/javascript"), ("/static/dom.js", "text/javascript"),
    ("/static/favicon.svg", "image/svg+xml"),
])
def test_pages_and_assets_are_served_with_their_type_and_a_strict_csp(
        client: TestClient, path: str, media_type: str) -> None:
    r = client.get(path)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith(media_type)
    assert r.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "default-src 'self'" in CONTENT_SECURITY_POLICY
    assert "unsafe" not in CONTENT_SECURITY_POLICY
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["cache-control"] == "no-cache"


def test_an_unchanged_asset_is_revalidated_with_304(client: TestClient) -> None:
    etag = client.get("/static/status.js").headers["etag"]
    r = client.get("/static/status.js", headers={"If-None-Match": etag})
    assert r.status_code == 304 and r.content == b""
    assert client.get("/static/status.js", headers={"If-None-Match": '"x"'}).status_code == 200


@pytest.mark.parametrize("name", ["nope.js", "status.html", "routes.py", "__init__.py",
                                  "..%2Froutes.py", "%2e%2e%2fapp.py"])
def test_only_known_static_files_are_served(client: TestClient, name: str) -> None:
    assert client.get(f"/static/{name}").status_code == 404


def test_pages_stay_out_of_the_api_schema(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert not {"/", "/lab", "/static/{name}"} & paths.keys()


def test_no_asset_loads_anything_from_another_origin() -> None:
    for name in [*_PAGES.values(), *_STATIC]:
        text = files("kvguard.sidecar.pages").joinpath(name).read_text()
        urls = set(re.findall(r"(?:https?:)?//[\w.-]+\.[a-z]{2,}[^\s\"')]*", text))
        assert urls <= {"http://www.w3.org/2000/svg"}, (name, urls)
        assert "<style" not in text and " style=" not in text, name  # CSP: style-src 'self'
        assert not re.search(r"<script(?![^>]*\bsrc=)", text), name  # no inline script


def test_every_served_file_is_declared_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["kvguard.sidecar.pages"]
    for name in [*_PAGES.values(), *_STATIC]:
        assert any(fnmatch(name, p) for p in patterns), name
