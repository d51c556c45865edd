"""Scoring a scenario: what was expected, what kvguard concluded, and whether that is right."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field

from kvguard.core.report import CheckpointReport
from kvguard.core.types import LeakCause, LeakPath, Verdict
from kvguard.testing.scheduling import Scheduling


class Status(enum.StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    UNSUPPORTED = "unsupported"
    ERROR = "error"


class LeakSummary(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cause: LeakCause
    path: LeakPath
    client_request_id: str | None
    blocks: int


class ScenarioResult(BaseModel):
    """One row of the detection matrix (also the JSON result file's entries)."""

    model_config = ConfigDict(extra="forbid")

    name: str
    scheduling: Scheduling = Scheduling.SYNC
    """How the engine the scenario ran on really scheduled, read from vLLM's EngineCore
    (:func:`kvguard.testing.engine.scheduling_of`); the mode asked for when no engine could
    be built."""
    injected: str
    reproduces: str = ""
    expected: str
    concluded: str
    status: Status
    evidence: str = ""
    why: str = Field(default="", description="Why it failed, errored or is unsupported.")
    seconds: float = 0.0
    verdict: Verdict | None = None
    leaks: list[LeakSummary] = Field(default_factory=list)


def summarize(report: CheckpointReport) -> tuple[str, list[LeakSummary]]:
    leaks = [LeakSummary(cause=lk.cause, path=lk.path, client_request_id=lk.client_request_id,
                         blocks=lk.blocks) for lk in report.leaks]
    text = report.verdict.value
    if leaks:
        text += ": " + "; ".join(
            f"{lk.cause.value}/{lk.path.value}"
            + (f" {lk.client_request_id}" if lk.client_request_id else "")
            + f" ({lk.blocks} blk)" for lk in leaks)
    return text, leaks


def verdict_key(r: ScenarioResult) -> tuple[Status, Verdict | None,
                                          frozenset[tuple[LeakCause, LeakPath]]]:
    """What must not depend on the scheduling mode: the outcome, the verdict and the
    (cause, path) of each finding. Request names and block counts may differ (vLLM's
    scheduling picks, e.g., which request a preemption hits)."""
    return r.status, r.verdict, frozenset((lk.cause, lk.path) for lk in r.leaks)


def mode_disagreements(results: list[ScenarioResult]) -> list[str]:
    """Scenarios whose sync and async runs (both present) differ in :func:`verdict_key`."""
    by_name: dict[str, dict[Scheduling, ScenarioResult]] = {}
    for r in results:
        by_name.setdefault(r.name, {})[r.scheduling] = r
    out: list[str] = []
    for name, runs in by_name.items():
        if len(runs) == 2 and verdict_key(runs[Scheduling.SYNC]) != verdict_key(
                runs[Scheduling.ASYNC]):
            out.append(f"{name}: sync {runs[Scheduling.SYNC].concluded or '-'} "
                       f"({runs[Scheduling.SYNC].status.value}), async "
                       f"{runs[Scheduling.ASYNC].concluded or '-'} "
                       f"({runs[Scheduling.ASYNC].status.value})")
    return out
