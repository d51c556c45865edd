"""The status page shows a leak injected into a real engine within one refresh."""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from playwright.sync_api import expect

from kvguard.chaos.faults import SCHEDULER_CLS, Fault, FaultPlan
from kvguard.chaos.harness import EngineHarness as Harness
from kvguard.chaos.harness import prompt

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pages"))
from browser import browser_page, serve_sidecar

REFRESH_MS = 2000
SLACK_MS = 2000  # the sidecar's file poll, the engine's publish and Playwright's own polling


def test_status_page_shows_a_real_engine_leak_within_one_refresh(
    engines: Callable[..., Harness], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    monkeypatch.setenv("KVGUARD_RUN_DIR", str(run_dir))
    h = engines(scheduler_cls=SCHEDULER_CLS)
    h.guard.config = dataclasses.replace(h.guard.config, publish_interval_seconds=0.0)
    h.add(prompt(1400, 40), max_tokens=8)
    h.run_to_completion()
    with serve_sidecar(run_dir) as url, browser_page(tmp_path / "profile") as page:
        page.goto(url + "/")
        card = page.locator(f'[data-engine="{h.guard.engine}"]')
        expect(card.get_by_test_id("verdict")).to_contain_text(re.compile("clean|saturated"))

        h.chaos.arm(FaultPlan({Fault.SKIP_FREE_ON_ABORT: 1}))
        h.add(prompt(1401, 70), max_tokens=60, rid="page-victim")
        h.step_until(lambda: h.blocks_of("page-victim") >= 3)
        held = h.blocks_of("page-victim")
        h.abort("page-victim")
        h.run_to_completion()

        rows = card.get_by_test_id("leak-row")
        expect(rows).to_have_count(1, timeout=REFRESH_MS + SLACK_MS)
        expect(rows.nth(0).get_by_test_id("leak-request")).to_have_text("page-victim")
        expect(rows.nth(0).get_by_test_id("leak-path")).to_have_text("abort")
        expect(rows.nth(0).get_by_test_id("leak-blocks")).to_have_text(str(held))
        expect(card.get_by_test_id("verdict")).to_contain_text("leak")
