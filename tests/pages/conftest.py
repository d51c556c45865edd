"""Fixtures for the page tests: a sidecar on a temp run directory and a real browser page."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser import launch_chromium, open_page, serve_sidecar
from playwright.sync_api import BrowserContext, Page

# The engine-state factories live with the sidecar tests (no package __init__ in tests/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sidecar"))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    return d


@pytest.fixture
def sidecar_url(run_dir: Path) -> Iterator[str]:
    with serve_sidecar(run_dir) as url:
        yield url


@pytest.fixture(scope="module")
def chromium(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrowserContext]:
    """One browser per test module (a launch costs about a second), fresh profile."""
    with launch_chromium(tmp_path_factory.mktemp("chromium-profile")) as context:
        yield context


@pytest.fixture
def page(chromium: BrowserContext) -> Iterator[Page]:
    with open_page(chromium) as p:
        yield p
