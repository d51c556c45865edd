"""The status page says how many distinct blocks leaked, not the sum of the findings (issue 13.1).

The report comes from the real reconciler on a pool where four aborted requests
share a prefix (``tests/core/_shared_prefix.py``): 7 blocks lost, findings that
sum to 13.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from browser import maybe_screenshot
from factories import state, write
from playwright.sync_api import Page, expect

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
from _shared_prefix import leaky_report, truth


def test_leaks_caption_counts_distinct_blocks_and_cells_say_what_is_shared(
        page: Page, sidecar_url: str, run_dir: Path) -> None:
    r = leaky_report(taken_at=time.time())
    write(run_dir, state([r]))
    page.goto(sidecar_url + "/")
    card = page.locator("[data-engine=dp0]")
    expect(card.get_by_test_id("leaks-caption")).to_have_text(
        f"5 findings, {truth()} distinct blocks leaked, at checkpoint #1")
    cells = card.get_by_test_id("leak-blocks")
    texts = [cells.nth(i).inner_text() for i in range(cells.count())]
    assert sorted(texts) == sorted(["3 (2 shared)"] * 4 + ["1"]), texts
    expect(card.get_by_test_id("explanation")).to_contain_text(
        f"{truth()} block(s) leaked in 5 finding(s).")
    maybe_screenshot(page, "status-distinct-blocks")
