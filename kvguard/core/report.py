"""The checkpoint report: the public JSON contract of design.md section 7.

Strict pydantic models: unknown fields are rejected, nothing is coerced. A
report never carries prompt text or token ids: only request ids, counts,
block ids and times.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from kvguard.core.types import Evidence, FinishReason, LeakCause, LeakPath, Verdict

REPORT_SCHEMA_VERSION = 1


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class PoolReport(_Model):
    """Usable blocks by state.

    Invariant: ``free + cached + active + held_by_finished + orphaned == capacity``.
    """

    capacity: int = Field(ge=0)
    free: int = Field(ge=0)
    cached: int = Field(ge=0)
    active: int = Field(ge=0)
    held_by_finished: int = Field(ge=0)
    orphaned: int = Field(ge=0)
    num_free_reported: int = Field(
        description="The engine's own free-block count (includes cached blocks)."
    )


class LeakReport(_Model):
    """One leak finding: who holds what, how it got there, since when."""

    request_id: str | None = Field(description="Engine-internal request id, if known.")
    client_request_id: str | None = Field(
        default=None, description="The id the client gave (vLLM's suffix removed)."
    )
    cause: LeakCause
    finish_reason: FinishReason | None = None
    path: LeakPath
    blocks: int = Field(ge=0)
    block_ids: list[int] = Field(default_factory=list, description="At most 32 of them.")
    held_for_seconds: float | None = None
    evidence: Evidence
    detail: str = ""


class AllocatorReport(_Model):
    """Framework allocator counters (bytes), filled by the attribution probes."""

    backend: str | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    inactive_split_bytes: int | None = None
    num_alloc_retries: int | None = None
    num_ooms: int | None = None
    unavailable: list[str] = Field(default_factory=list)


class DeviceReport(_Model):
    """Device-level memory (bytes), filled by the attribution probes."""

    used_bytes: int | None = None
    total_bytes: int | None = None
    non_torch_bytes: int | None = None
    unavailable: list[str] = Field(default_factory=list)


class HostReport(_Model):
    """Host memory (bytes), filled by the attribution probes."""

    rss_bytes: int | None = None
    swap_used_bytes: int | None = None
    mem_available_bytes: int | None = None
    unavailable: list[str] = Field(default_factory=list)


class CheckpointReport(_Model):
    """The outcome of one checkpoint of one engine."""

    schema_version: int = REPORT_SCHEMA_VERSION
    checkpoint_id: int = Field(ge=0, description="Monotonic per engine epoch.")
    engine: str
    epoch: str = Field(description="Changes when the engine process restarts.")
    taken_at: float = Field(description="Unix time, seconds.")
    drained: bool
    verdict: Verdict
    skip_reason: str | None = None
    pool: PoolReport | None = None
    saturation_ratio: float = Field(ge=0.0, le=1.0, default=0.0)
    finished_requests_holding_blocks: int = Field(ge=0, default=0)
    leaks: list[LeakReport] = Field(default_factory=list)
    leaked_blocks_by_cause: dict[LeakCause, int] = Field(default_factory=dict)
    allocator: AllocatorReport | None = None
    device: DeviceReport | None = None
    host: HostReport | None = None
    explanation: str
    audit_seconds: float = Field(ge=0.0, default=0.0, description="Time the audit took.")
