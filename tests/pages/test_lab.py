"""The queue lab (``GET /lab``) in a real headless Chromium.

The fluid model: q(t) = max(0, q0 + (lambda - mu)·t), t in steps of 0.5 s.
"""

from __future__ import annotations

import time

import pytest
from browser import maybe_screenshot
from playwright.sync_api import Page, expect


def _open(page: Page, url: str) -> None:
    page.goto(url + "/lab")
    expect(page.locator("body")).to_have_attribute("data-ready", "true")


def _set(page: Page, *, lam: float | None = None, mu: float | None = None,
         q0: float | None = None) -> None:
    for sel, v in (("#lambda", lam), ("#mu", mu), ("#q0", q0)):
        if v is not None:
            page.fill(sel, str(v))


def _steps(page: Page, n: int) -> None:
    for _ in range(n):
        page.click("#step")


def _expect_readout(page: Page, t: str, q: str) -> None:
    expect(page.locator("#t")).to_have_text(t)
    expect(page.locator("#q")).to_have_text(q)


def test_lab_draining_workload_reaches_zero_at_t_4(page: Page, sidecar_url: str) -> None:
    _open(page, sidecar_url)
    page.click("#reset")
    _set(page, lam=2, mu=3, q0=4)
    _expect_readout(page, "0", "4")
    expect(page.locator("#prediction")).to_contain_text("drains at t=4 s")
    _steps(page, 4)
    _expect_readout(page, "2", "2")
    _steps(page, 4)
    _expect_readout(page, "4", "0")
    expect(page.locator("#chart svg polyline.done")).to_have_count(1)
    maybe_screenshot(page, "lab-drains")


def test_lab_equal_rates_keep_the_backlog_at_4(page: Page, sidecar_url: str) -> None:
    _open(page, sidecar_url)
    _set(page, lam=2, mu=3, q0=4)
    _steps(page, 3)
    page.click("#reset")
    _expect_readout(page, "0", "4")
    _set(page, lam=3, mu=3)
    expect(page.locator("#prediction")).to_contain_text("stays at 4")
    _steps(page, 8)
    _expect_readout(page, "4", "4")
    maybe_screenshot(page, "lab-steady")


def test_editing_a_rate_mid_run_keeps_t_and_recomputes_from_q0(page: Page,
                                                                sidecar_url: str) -> None:
    _open(page, sidecar_url)
    _set(page, lam=2, mu=3, q0=4)
    _steps(page, 4)
    _expect_readout(page, "2", "2")
    # From q0 = 4 at t = 0 with the new constant rate: 4 + (2 - 2.5)·2 = 3, not 2 - 0.5·2.
    _set(page, mu=2.5)
    _expect_readout(page, "2", "3")
    _set(page, lam=4)
    _expect_readout(page, "2", "7")
    expect(page.locator("#prediction")).to_contain_text("grows without bound")
    _steps(page, 2)
    _expect_readout(page, "3", "8.5")


def test_play_advances_t_and_pause_stops_it(page: Page, sidecar_url: str) -> None:
    _open(page, sidecar_url)
    _set(page, lam=2, mu=3, q0=4)
    page.click("#play")
    expect(page.locator("#play")).to_have_text("Pause")
    page.wait_for_function("() => Number(document.getElementById('t').dataset.value) >= 1")
    page.click("#play")
    expect(page.locator("#play")).to_have_text("Play")
    stopped = page.inner_text("#t")
    time.sleep(1.2)  # more than two timer periods
    assert page.inner_text("#t") == stopped
    assert float(stopped) >= 1


def test_reset_stops_play_and_returns_to_q0(page: Page, sidecar_url: str) -> None:
    _open(page, sidecar_url)
    _set(page, lam=1, mu=3, q0=6)
    page.click("#play")
    page.wait_for_function("() => Number(document.getElementById('t').dataset.value) >= 0.5")
    page.click("#reset")
    expect(page.locator("#play")).to_have_text("Play")
    _expect_readout(page, "0", "6")


@pytest.mark.parametrize(("lam", "mu", "q0", "text"), [
    (2, 3, 4, "drains at t=4 s"),
    (3, 3, 4, "stays at 4"),
    (4, 3, 4, "grows without bound"),
    (1, 3, 0, "drained already"),
])
def test_prediction_line_names_the_outcome(page: Page, sidecar_url: str, lam: float, mu: float,
                                           q0: float, text: str) -> None:
    _open(page, sidecar_url)
    _set(page, lam=lam, mu=mu, q0=q0)
    expect(page.locator("#prediction")).to_contain_text(text)


def test_invalid_input_is_named_instead_of_plotted(page: Page, sidecar_url: str) -> None:
    _open(page, sidecar_url)
    _set(page, mu=-1)
    expect(page.locator("#input-error")).to_have_text("μ must be a number ≥ 0")
    expect(page.locator("#q")).to_have_text("—")
    _set(page, mu=3)
    expect(page.locator("#input-error")).to_be_hidden()
    expect(page.locator("#q")).to_have_text("4")


def test_lab_says_the_fluid_model_is_about_the_workload_not_memory(page: Page,
                                                                   sidecar_url: str) -> None:
    _open(page, sidecar_url)
    note = page.locator("[data-testid=scope-note]")
    for words in ("no tensors", "no caching allocator", "no device counters", "no leaks",
                  "workload boundary", "ongoing work, not a leak"):
        expect(note).to_contain_text(words)
