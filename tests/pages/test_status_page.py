"""The status page (``GET /``) in a real headless Chromium, on engine state files in a run dir."""

from __future__ import annotations

import json
import time
from pathlib import Path

from browser import maybe_screenshot
from factories import judged, report, state, write
from playwright.sync_api import Page, Route, expect

from kvguard.core.report import AllocatorReport, HostReport, LeakReport
from kvguard.core.types import Evidence, LeakCause, LeakPath, Verdict
from kvguard.transport.state import OnlineState

REFRESH_SECONDS = 2.0
"""The status page's refresh interval."""
POLL_SLACK_SECONDS = 0.5
"""The sidecar re-reads state files every 0.1 s here; the rest is fetching and rendering."""
SLACK_SECONDS = 1.5
"""Extra wait for Playwright's own polling of the page."""


def _open(page: Page, url: str) -> None:
    page.goto(url + "/")
    page.wait_for_function("() => Number(document.body.dataset.refreshes || 0) >= 1")


def test_a_new_leak_appears_within_one_refresh_without_reloading(page: Page, sidecar_url: str,
                                                                 run_dir: Path) -> None:
    write(run_dir, state([report(1, cached=20), report(2, cached=30)]))
    _open(page, sidecar_url)
    card = page.locator("[data-engine=dp0]")
    expect(card.get_by_test_id("verdict")).to_contain_text("clean")
    expect(card.get_by_test_id("no-leaks")).to_have_text("No leaks at checkpoint #2.")
    page.evaluate("window.__sameDocument = true")

    written = time.time()
    leaking = judged(3, holding=2)
    write(run_dir, state([report(1, cached=20), report(2, cached=30), leaking.report]))
    rows = card.get_by_test_id("leak-row")
    expect(rows).to_have_count(len(leaking.leaks),
                               timeout=(REFRESH_SECONDS + SLACK_SECONDS) * 1000)
    shown_after = float(page.evaluate("document.body.dataset.renderedAt")) / 1000 - written
    assert 0 < shown_after <= REFRESH_SECONDS + POLL_SLACK_SECONDS

    # What the reference pool says happened: the first aborted request (it finished first,
    # and its engine id sorts first) kept its blocks since then.
    truth = leaking.leaks[0]
    first = rows.nth(0)
    expect(first.get_by_test_id("leak-request")).to_have_text(truth.client_id)
    expect(first).to_contain_text(f"engine id {truth.rid}")
    expect(first.get_by_test_id("leak-cause")).to_have_text("finished request")
    expect(first.get_by_test_id("leak-path")).to_have_text("abort")
    expect(first.get_by_test_id("leak-blocks")).to_have_text(str(len(truth.blocks)))
    expect(first.get_by_test_id("leak-held-for")).to_have_text(
        f"{leaking.held_for_seconds(truth):g} s")
    expect(card.get_by_test_id("verdict")).to_contain_text("leak")
    held = card.locator("[data-testid=pool-legend] [data-state=held_by_finished] b")
    expect(held).to_have_text(str(len({b for lk in leaking.leaks for b in lk.blocks})))
    expect(card.locator("svg.pool g.bar")).to_have_count(3)
    assert page.evaluate("window.__sameDocument") is True, "the page reloaded itself"
    maybe_screenshot(page, "status-leak")


def test_a_request_id_with_markup_is_shown_as_text(page: Page, sidecar_url: str,
                                                   run_dir: Path) -> None:
    hostile = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'
    leak = LeakReport(request_id=hostile + "-1234", client_request_id=hostile,
                      cause=LeakCause.ORPHAN, path=LeakPath.UNKNOWN, blocks=3,
                      held_for_seconds=None, evidence=Evidence.DRAINED,
                      detail="<b>not bold</b>")
    r = report(1, holding=1).model_copy(update={"leaks": [leak],
                                               "explanation": "<i>not italic</i>"})
    write(run_dir, state([r]))
    _open(page, sidecar_url)
    cell = page.get_by_test_id("leak-request")
    expect(cell).to_have_text(hostile)
    expect(page.get_by_test_id("explanation")).to_have_text("<i>not italic</i>")
    expect(page.locator("[data-testid=leak-row]")).to_contain_text("<b>not bold</b>")
    assert page.locator("main script, main img, main b.detail, main i").count() == 0
    assert page.evaluate("window.__pwned") is None
    expect(page.get_by_test_id("leak-held-for")).to_have_text("—")


def test_a_page_opened_before_any_engine_shows_it_when_it_appears(page: Page, sidecar_url: str,
                                                                  run_dir: Path) -> None:
    _open(page, sidecar_url)
    expect(page.get_by_test_id("no-engines")).to_be_visible()
    expect(page.get_by_test_id("refresh-interval")).to_have_text("2 s")
    write(run_dir, state([report(1)], engine="dp1"))
    expect(page.locator("[data-engine=dp1]")).to_be_visible(
        timeout=(REFRESH_SECONDS + SLACK_SECONDS) * 1000)
    expect(page.get_by_test_id("no-engines")).to_have_count(0)


def test_saturation_trend_and_attribution_from_the_report(page: Page, sidecar_url: str,
                                                          run_dir: Path) -> None:
    reports = [report(i, cached=c) for i, c in enumerate([20, 45, 60, 61, 61], 1)]
    last = reports[-1].model_copy(update={
        "allocator": AllocatorReport(backend="native", allocated_bytes=3 * 2**30,
                                     reserved_bytes=4 * 2**30, unavailable=["num_ooms"]),
        "host": HostReport(rss_bytes=512 * 2**20, swap_used_bytes=0)})
    write(run_dir, state([*reports[:-1], last]))
    _open(page, sidecar_url)
    card = page.locator("[data-engine=dp0]")
    expect(card.get_by_test_id("verdict")).to_contain_text("saturated")
    expect(card.get_by_test_id("trend")).to_contain_text("saturated")
    expect(card.get_by_test_id("no-leaks")).to_be_visible()
    allocator = card.get_by_test_id("attribution-allocator")
    expect(allocator).to_contain_text("allocated")
    expect(allocator).to_contain_text("3 GiB")
    expect(allocator).to_contain_text("num_ooms")
    expect(card.get_by_test_id("attribution-host")).to_contain_text("512 MiB")
    expect(card.get_by_test_id("attribution-device")).to_have_count(0)
    expect(card.get_by_test_id("drain")).to_contain_text("publishes no drain prediction")
    maybe_screenshot(page, "status-saturated")


def test_drain_prediction_and_unknown_attribution_fields_are_rendered(
        page: Page, sidecar_url: str, run_dir: Path) -> None:
    """Fields newer than this sidecar's models (``drain``, ``attribution``) still show.

    The answer is rewritten in the browser: ``eta_seconds`` as the bare
    ``Infinity`` token that Python's JSON writes for +Inf, which JSON.parse rejects.
    """
    write(run_dir, state([report(1, holding=1)]))

    def with_drain(route: Route) -> None:
        body = route.fetch().json()
        if not body["engines"]:  # the sidecar has not read the state file yet
            route.fulfill(status=200, content_type="application/json", body=json.dumps(body))
            return
        eng = body["engines"][0]
        eng["drain"] = {"at": time.time(), "arrival_rate_per_s": 3.1,
                        "completion_rate_per_s": 2.9, "backlog": 12, "window_seconds": 30.0,
                        "drains": False, "eta_seconds": "__INF__",
                        "explanation": "Does not drain: λ=3.10/s ≥ μ=2.90/s, backlog 12."}
        eng["latest"]["attribution"] = {
            "status": "compared", "summary": "KV pool: 4 blocks held <since> baseline",
            "findings": [{"boundary": "kv_pool", "strength": "attribution",
                          "delta_bytes": 4 * 2**20, "evidence": "4 leaked blocks x 1 MiB",
                          "next_step": "repair the abort path <free>"}],
            "a_field_from_the_future": {"nested": [1, 2]}}
        text = json.dumps(body).replace('"__INF__"', "Infinity")
        route.fulfill(status=200, content_type="application/json", body=text)

    page.route("**/v1/report", with_drain)
    _open(page, sidecar_url)
    drain = page.get_by_test_id("drain")
    expect(drain.get_by_test_id("drain-headline")).to_have_text("does not drain")
    expect(drain).to_contain_text("3.1 /s")
    expect(drain).to_contain_text("2.9 /s")
    expect(drain).to_contain_text("12 requests")
    expect(drain).to_contain_text("never")
    expect(drain.get_by_test_id("drain-explanation")).to_contain_text("backlog 12")
    attribution = page.get_by_test_id("attribution-attribution")
    expect(attribution.get_by_test_id("attribution-summary")).to_have_text(
        "KV pool: 4 blocks held <since> baseline")
    finding = attribution.get_by_test_id("finding-row")
    expect(finding).to_contain_text("kv pool")
    expect(finding).to_contain_text("+4 MiB")
    expect(finding).to_contain_text("repair the abort path <free>")
    attribution.locator("details summary").click()
    expect(attribution.locator("details")).to_contain_text("a field from the future")
    maybe_screenshot(page, "status-drain-attribution")


def test_a_draining_prediction_shows_its_eta(page: Page, sidecar_url: str, run_dir: Path) -> None:
    write(run_dir, state([report(1)]))

    def with_drain(route: Route) -> None:
        body = route.fetch().json()
        for eng in body["engines"]:
            eng["drain"] = {"arrival_rate_per_s": 2.0, "completion_rate_per_s": 3.0,
                            "backlog": 4, "drains": True, "eta_seconds": 4.0,
                            "explanation": "Drains in about 4.0 s."}
        route.fulfill(status=200, content_type="application/json", body=json.dumps(body))

    page.route("**/v1/report", with_drain)
    _open(page, sidecar_url)
    expect(page.get_by_test_id("drain-headline")).to_have_text("drains in about 4 s")


def test_an_online_finding_under_load_says_so(page: Page, sidecar_url: str,
                                              run_dir: Path) -> None:
    """A server that never drains: the verdict comes from the online audit, and the page
    says it is an online finding (ownership only) and how fast the audit finds a leak."""
    leak = LeakReport(request_id="victim-0000000a", client_request_id="victim",
                      cause=LeakCause.FINISHED_REQUEST, path=LeakPath.ABORT, blocks=3,
                      evidence=Evidence.ONLINE)
    r = report(7, holding=0).model_copy(update={
        "drained": False, "evidence": Evidence.ONLINE, "verdict": Verdict.LEAK,
        "leaks": [leak], "leaked_blocks_by_cause": {LeakCause.FINISHED_REQUEST: 3},
        "explanation": "Online audit under load (no drain needed): ..."})
    online = OnlineState(budget_fraction=0.01, sweeps_total=420, audit_seconds_total=0.04,
                         blocks_audited_total=26880, last_sweep_steps=9,
                         last_sweep_seconds=0.011, last_sweep_at=time.time(),
                         detection_latency_steps=27, detection_latency_seconds=0.033,
                         pending_blocks=2, confirmed_blocks=3)
    write(run_dir, state([r]).model_copy(update={"online": online}))
    _open(page, sidecar_url)
    verdict = page.get_by_test_id("verdict")
    expect(verdict).to_contain_text("online audit under load (ownership only)")
    expect(page.get_by_test_id("leak-row")).to_contain_text("victim")
    section = page.get_by_test_id("online")
    expect(section.get_by_test_id("online-headline")).to_have_text(
        "finds a leak within 33 ms under load")
    expect(section).to_contain_text(
        "420 sweeps; the last took 9 steps (0.01 s), budget 1 % of scheduler time")
    maybe_screenshot(page, "status-online")


def test_kvguards_own_cost_is_shown_once_metered_and_not_when_off(
        page: Page, sidecar_url: str, run_dir: Path) -> None:
    """The engine card says what kvguard costs the engine it watches: its metered share of
    scheduler time, and the ratio that share means; nothing when metering is off."""
    from kvguard.transport.state import CostState

    cost = CostState(sample_every_steps=512, window_steps=8, sampled_steps_total=640,
                     self_seconds_total=0.02, scheduler_seconds_total=0.25)
    write(run_dir, state([report(3)]).model_copy(update={"cost": cost}))
    _open(page, sidecar_url)
    section = page.get_by_test_id("cost")
    expect(section.get_by_test_id("cost-headline")).to_have_text(
        "8 % of scheduler time (1.087x)")
    expect(section).to_contain_text("metered over 640 steps since the engine started "
                                    "(8 in every 512)")
    write(run_dir, state([report(4)]).model_copy(update={"cost": None}))
    _open(page, sidecar_url)
    expect(page.get_by_test_id("verdict")).to_contain_text("checkpoint #4")
    expect(page.get_by_test_id("cost")).to_have_count(0)
