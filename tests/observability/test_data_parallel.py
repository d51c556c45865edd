"""Two data-parallel ranks of one vLLM server behind one sidecar (see conftest.py).

Each rank is its own EngineCore process with its own scheduler and KV pool, so kvguard
must name each one separately (a rank that took another's name would overwrite its state
file: the bug this guards against), report a leak on the rank that leaks only, and show
both ranks everywhere a person looks: ``kvguard report``, the sidecar's JSON, the status
page. Every number is checked against vLLM's own per-rank metrics.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
from _observed import (
    LEAKING,
    SATURATED,
    ObservedEngine,
    SaturatedEngine,
    vllm_blocks_in_use,
    vllm_capacity_blocks,
)
from playwright.sync_api import expect

from kvguard.transport.reader import read_run_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pages"))
from browser import browser_page, serve_sidecar


def test_each_rank_has_its_own_name_process_and_state_file(
        leaking_engine: ObservedEngine, saturated_engine: SaturatedEngine) -> None:
    states = {s.engine: s for s in read_run_dir(leaking_engine.run_dir).states}
    assert set(states) == {LEAKING, SATURATED}
    assert sorted(p.name for p in leaking_engine.run_dir.glob("*.json")
                  if not p.name.endswith(".requests.json")) == sorted(
        f"{name}.json" for name in (LEAKING, SATURATED))
    assert states[LEAKING].pid != states[SATURATED].pid, "one process wrote both states"
    for engine in (leaking_engine, saturated_engine):
        s = states[engine.name]
        assert s.latest_report is not None and s.latest_report.pool is not None
        assert s.latest_report.pool.capacity == vllm_capacity_blocks(engine.vllm_url,
                                                                     engine.vllm_engine)


def test_kvguard_report_names_the_leaking_rank_only(
        leaking_engine: ObservedEngine, saturated_engine: SaturatedEngine) -> None:
    out = subprocess.run([sys.executable, "-m", "kvguard.cli.main", "report", "--json",
                          "--run-dir", str(leaking_engine.run_dir)],
                         capture_output=True, text=True, check=True)
    by_engine = {p["engine"]: p for p in json.loads(out.stdout)}
    assert set(by_engine) == {LEAKING, SATURATED}
    leak, sat = by_engine[LEAKING], by_engine[SATURATED]
    held = vllm_blocks_in_use(leaking_engine)
    assert held > 0, "rank 1's pool holds nothing by vLLM's count: its faults did not fire"
    assert leak["verdict"] == "leak"
    assert leak["leaked_blocks"] == held
    assert {f["path"] for f in leak["leaks"]} >= {"abort"}, leak["leaks"]
    assert sat["verdict"] == "saturated", sat
    assert sat["leaks"] == [] and sat["leaked_blocks"] == 0
    assert vllm_blocks_in_use(saturated_engine) == 0
    text = subprocess.run([sys.executable, "-m", "kvguard.cli.main", "report",
                           "--run-dir", str(leaking_engine.run_dir)],
                          capture_output=True, text=True, check=True).stdout
    assert f"engine {LEAKING}" in text and f"engine {SATURATED}" in text


def test_sidecar_serves_both_ranks(leaking_engine: ObservedEngine) -> None:
    base = leaking_engine.sidecar_metrics_url.removesuffix("/metrics")
    health = httpx.get(base + "/healthz", timeout=10).json()
    assert health["engines"] == 2
    reports = httpx.get(base + "/v1/report", timeout=10).json()
    verdicts = {r["engine"]: r["latest"]["verdict"] for r in reports["engines"]}
    assert verdicts == {LEAKING: "leak", SATURATED: "saturated"}
    armed = {r["engine"]: bool(r["faults_enabled"]) for r in reports["engines"]}
    assert armed == {LEAKING: True, SATURATED: False}, "faults must be armed on rank 1 only"


def test_status_page_shows_both_ranks(leaking_engine: ObservedEngine,
                                      tmp_path: Path) -> None:
    held = vllm_blocks_in_use(leaking_engine)
    with serve_sidecar(leaking_engine.run_dir) as url, \
            browser_page(tmp_path / "profile") as page:
        page.goto(url + "/")
        leak = page.locator(f'[data-engine="{LEAKING}"]')
        sat = page.locator(f'[data-engine="{SATURATED}"]')
        expect(leak.get_by_test_id("verdict")).to_contain_text("leak")
        expect(sat.get_by_test_id("verdict")).to_contain_text("saturated")
        expect(leak.get_by_test_id("leaks-caption")).to_contain_text(
            re.compile(rf"\b{held} distinct blocks? leaked"))
        expect(sat.get_by_test_id("leak-row")).to_have_count(0)


def test_each_rank_is_mirrored_from_its_own_kv_event_endpoint(
        leaking_engine: ObservedEngine, saturated_engine: SaturatedEngine) -> None:
    """vLLM offsets the KV-event endpoints by the data-parallel rank; the sidecar follows
    each rank on its own (joining after the workload: everything comes from the replay
    endpoints) and checks each mirror against that rank's pool. The saturated rank's mirror
    holds exactly the blocks vLLM says it keeps cached; the leaking rank's held blocks are
    still cached blocks, so its mirror agrees with its pool too (a leak is not a mirror
    fault)."""
    states = {s.engine: s for s in read_run_dir(leaking_engine.run_dir).states}
    kv = {name: states[name].kv_events for name in (SATURATED, LEAKING)}
    assert all(k is not None for k in kv.values()), kv
    pub = {name: k.endpoint for name, k in kv.items() if k is not None}
    port = int(pub[SATURATED].rsplit(":", 1)[1])
    assert pub == {SATURATED: f"tcp://127.0.0.1:{port}", LEAKING: f"tcp://127.0.0.1:{port + 1}"}
    base = leaking_engine.sidecar_metrics_url.removesuffix("/metrics")
    deadline = time.monotonic() + 60
    while True:
        checks = {r["engine"]: r["kv_events"] for r in
                  httpx.get(base + "/v1/report", timeout=10).json()["engines"]}
        if all(c is not None and c["verdict"] != "pending" for c in checks.values()):
            break
        assert time.monotonic() < deadline, f"a rank's mirror check stayed pending: {checks}"
        time.sleep(0.5)
    sat, leak = checks[SATURATED], checks[LEAKING]
    assert sat["verdict"] == "consistent", sat
    assert sat["pool_blocks"] == sat["mirror_blocks"] == saturated_engine.cached_blocks_truth
    assert leak["verdict"] == "consistent", leak
    assert leak["pool_blocks"] == leak["mirror_blocks"] > 0, leak
