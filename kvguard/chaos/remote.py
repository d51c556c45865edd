"""``kvguard chaos --url``: client-side scenarios against a running (staging) deployment.

Only what a client can do: shared-prefix streams that fill the prefix cache and
clients that hang up mid-generation (vLLM aborts their requests). kvguard's
verdict is read from the deployment's sidecar: the run asks it for a
checkpoint and waits for a drained one taken after the workload. Engine-side
faults cannot be injected from outside; run the embedded matrix for those.
"""

from __future__ import annotations

import time

import httpx

from kvguard.chaos.result import ScenarioResult, Status, summarize
from kvguard.core.report import CheckpointReport
from kvguard.core.types import Verdict
from kvguard.sidecar.models import ReportsResponse
from kvguard.testing.workload import run_workload

DRAIN_WAIT_SECONDS = 120.0


def _latest_drained(sidecar: str, after: float) -> CheckpointReport | None:
    resp = httpx.get(f"{sidecar}/v1/report", timeout=10)
    reports = ReportsResponse.model_validate_json(resp.content).engines
    found = [e.latest for e in reports if e.latest is not None]
    fresh = [r for r in found if r.drained and r.taken_at > after]
    if len(fresh) < len(reports) or not fresh:
        return None
    return max(fresh, key=lambda r: r.leaked_blocks)


def run_remote(url: str, sidecar: str, *, model: str | None = None,
               token: str | None = None) -> list[ScenarioResult]:
    url, sidecar = url.rstrip("/"), sidecar.rstrip("/")
    if model is None:
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    t0 = time.time()
    result = run_workload(url, model, shared_prefix_streams=16, disconnecting_streams=8)
    ended = time.time()
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    httpx.post(f"{sidecar}/v1/checkpoints", headers=headers, timeout=10).raise_for_status()
    base = ScenarioResult(
        name="staging_streams_and_hangups",
        injected=f"{result.completed} shared-prefix streams, {result.disconnected} client "
                 "hang-ups mid-generation",
        expected="clean/saturated, no leak", concluded="-", status=Status.ERROR,
        evidence=f"{result.failed} requests failed")
    deadline = time.monotonic() + DRAIN_WAIT_SECONDS
    report = None
    while time.monotonic() < deadline and report is None:
        time.sleep(1.0)
        report = _latest_drained(sidecar, ended - 1.0)
    if report is None:
        return [base.model_copy(update={
            "why": f"no drained checkpoint within {DRAIN_WAIT_SECONDS:.0f} s: the deployment "
                   "has other traffic or never drains (see the sidecar's drain prediction)",
            "seconds": time.time() - t0})]
    concluded, leaks = summarize(report)
    ok = report.verdict in (Verdict.CLEAN, Verdict.SATURATED) and not report.leaks
    return [base.model_copy(update={
        "status": Status.PASSED if ok else Status.FAILED, "concluded": concluded,
        "verdict": report.verdict, "leaks": leaks, "seconds": time.time() - t0,
        "why": "" if ok else "a leak after a healthy client workload: " + concluded})]
