"""Response models of the sidecar's HTTP API (strict; the OpenAPI schema is built from them)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from kvguard.core.offload import OffloadState
from kvguard.core.reclaim import ReclaimState
from kvguard.core.report import CheckpointReport
from kvguard.core.transfer_links import TransferLink
from kvguard.core.transfers import TransfersState
from kvguard.core.trend import TrendVerdict
from kvguard.core.wedge_monitor import WedgeState
from kvguard.kv_events.verdict import KvEventsCheck
from kvguard.transport.state import CostState, OnlineState


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Health(_Model):
    status: str = Field(description="Always 'ok' while the sidecar serves.")
    engines: int = Field(description="Engines whose state the sidecar has read.")
    engines_up: int
    read_errors: dict[str, str] = Field(description="State file -> why it was rejected.")


class TrendReport(_Model):
    verdict: TrendVerdict
    checkpoints: int
    holding_series: list[int]
    explanation: str


class DrainView(_Model):
    """The engine's drain prediction, JSON-safe: ``eta_seconds`` is null when it never drains."""

    at: float
    arrival_rate_per_s: float
    completion_rate_per_s: float
    backlog: int
    drains: bool
    eta_seconds: float | None = Field(description="null when the workload does not drain.")
    explanation: str


class EngineReport(_Model):
    engine: str
    epoch: str
    up: bool
    hook_errors_total: int
    faults_enabled: list[str]
    latest: CheckpointReport | None
    trend: TrendReport
    drain: DrainView | None = None
    online: OnlineState | None = Field(
        default=None, description="The online audit's counters (null when it is off).")
    transfers: TransfersState | None = Field(
        default=None, description="KV transfers between engines (P/D; null without a KV "
                                  "connector).")
    cost: CostState | None = Field(
        default=None, description="kvguard's own time on the engine thread, metered on a "
                                  "sample of steps since the engine started (null when "
                                  "metering is off).")
    kv_events: KvEventsCheck | None = Field(
        default=None, description="The KV-event mirror check: the mirror a router builds from "
                                  "the engine's KV events, compared with the pool at the last "
                                  "drained checkpoint (null when the engine publishes no KV "
                                  "events or the sidecar does not watch them).")
    offload: OffloadState | None = Field(
        default=None, description="The offload job audit, online (stuck jobs with kind, "
                                  "request, age, chunks and fenced blocks; the requests "
                                  "waiting on them; the tier by state); null without an "
                                  "offloading KV connector.")
    wedge: WedgeState | None = Field(
        default=None, description="The wedge verdict (requests waiting behind blocks dead "
                                  "owners hold; /v1/ready answers 503 while it says wedged); "
                                  "null when the engine integration does not read what waits.")
    reclaim: ReclaimState | None = Field(
        default=None, description="The opt-in reclaim (KVGUARD_RECLAIM): blocks reclaimed per "
                                  "cause, refusals per reason, and the latest reclaims and "
                                  "refusals with request id, cause and block ids; null while "
                                  "reclaim is off.")
    hooks_missing: list[str] = Field(
        default_factory=list, description="Hook points this vLLM lacks, each with the feature "
                                          "that is off for it (`<hook> (off: <feature>)`): "
                                          "empty on a tested vLLM.")


class ReportsResponse(_Model):
    engines: list[EngineReport]
    transfer_links: list[TransferLink] = Field(
        default_factory=list, description="P/D: one request's transfer judged from both of "
                                          "its engines (both must publish here).")


class CheckpointsResponse(_Model):
    checkpoints: list[CheckpointReport] = Field(description="Oldest first.")


class CheckpointRequestResponse(_Model):
    requested: list[str] = Field(description="Engines asked to checkpoint at their next drain.")
    note: str


class ErrorResponse(_Model):
    detail: str
