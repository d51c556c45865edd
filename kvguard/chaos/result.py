"""Scoring a scenario: what was expected, what kvguard concluded, and whether that is right."""

from __future__ import annotations

import enum

from pydantic import BaseModel, ConfigDict, Field

from kvguard.core.report import CheckpointReport
from kvguard.core.types import LeakCause, LeakPath, Verdict


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
