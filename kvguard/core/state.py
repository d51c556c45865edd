"""The state a guard session publishes: its full current state (not a delta).

Publishing the full state (bounded: counters plus the last N reports) means a
reader that starts late, or restarts, resynchronises from one read; nothing
is lost when nobody is reading.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from kvguard.core.drain_model import DrainPrediction
from kvguard.core.offload import OffloadState
from kvguard.core.reclaim import ReclaimState
from kvguard.core.report import CheckpointReport, PoolReport
from kvguard.core.transfers import TransfersState
from kvguard.core.wedge_monitor import WedgeState
from kvguard.kv_events.snapshot import KvEventsState

STATE_SCHEMA_VERSION = 11
"""2: reports count distinct leaked blocks (report schema 2); ``engine_kind`` and
``engine_version`` replace ``vllm_version``. 3: ``transfers`` (KV transfers between
engines, P/D); a reader of schema 2 would reject the new field, so it says "another
kvguard version" instead. 4: ``drains_unaudited_total`` and ``unaudited_drain_at`` (the
pace of drained audits). 5: ``cost`` (kvguard's own time on the engine thread, metered on a
sample of steps). 6: ``model_name`` and ``engine_index``, the labels that join kvguard's
series with the engine's own (vLLM's ``model_name`` and ``engine``). 7: never released.
8: ``kv_events`` (the engine's KV-event stream and its pool's hashed blocks at the last
drained checkpoint, for the KV-event mirror check). 9: ``transfers.worker_ranks`` (what
kvguard's worker half in each worker process reported: per-rank lease lapses, late reads,
finished transfers, drops, errors); ``transfers.hold_source`` names where the leases came
from (a worker process, or EngineCore), built as 7 and released after 8; and ``tracing``
(kvguard's spans in the requests' traces: where they go, what was queued, dropped,
exported or failed). 10: ``wedge`` (the wedge verdict: requests waiting behind blocks
that dead owners hold). 11: ``reclaim`` (the opt-in reclaim of dead owners' blocks)."""

READABLE_SCHEMA_VERSIONS = frozenset({9, 10, STATE_SCHEMA_VERSION})
"""State schemas this kvguard reads: a schema-9 state is a schema-10 state without ``wedge``
(an engine of the previous release is read, and never judged wedged), a schema-10 state a
schema-11 one without ``reclaim`` (reclaim off); a newer one is refused with both versions
named."""


class OnlineState(BaseModel):
    """The online audit's counters (present when it is on)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    budget_fraction: float
    sweeps_total: int = 0
    audit_seconds_total: float = Field(default=0.0, description="Time spent auditing, s.")
    blocks_audited_total: int = 0
    last_sweep_steps: int = 0
    last_sweep_seconds: float = 0.0
    last_sweep_at: float | None = None
    detection_latency_steps: int = 0
    detection_latency_seconds: float = 0.0
    pending_blocks: int = Field(default=0, description="Suspect once, awaiting a second audit.")
    confirmed_blocks: int = 0
    restarts_total: int = 0


class CostState(BaseModel):
    """kvguard's own cost on the engine thread, metered on a sample of engine steps
    (:mod:`kvguard.core.cost`). Totals cover whole sampled steps only."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    sample_every_steps: int = Field(description="One window per this many steps; 0: off.")
    window_steps: int = Field(description="Steps metered in a row per window.")
    sampled_steps_total: int = 0
    self_seconds_total: float = Field(
        default=0.0, description="kvguard's own time in the sampled steps, s (hook time "
                                 "minus the engine methods they wrap).")
    scheduler_seconds_total: float = Field(
        default=0.0, description="The engine's scheduler entry points (admission, schedule, "
                                 "update_from_output, aborts) in the same steps, kvguard's "
                                 "time included, s.")
    windows_skipped_total: int = Field(
        default=0, description="Windows not metered: another wrapper sits over one of "
                               "kvguard's hooks, or the engine side has no metered hooks.")


class TracingState(BaseModel):
    """kvguard's spans in the requests' traces (:mod:`kvguard.tracing`): present when an
    OTLP endpoint is configured. Counters are since the engine started; spans queued are
    exported, failed, or still waiting (``spans_exported_total + export_failures_total <=
    spans_queued_total``)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    endpoint: str | None = Field(default=None, description="Where spans go (OTLP).")
    protocol: str | None = Field(default=None, description="grpc or http/protobuf.")
    service_name: str = Field(description="The spans' service.name.")
    traced_requests: int = Field(
        default=0, description="Requests whose trace context kvguard keeps now (sampled "
                               "traceparent at admission, not yet released).")
    contexts_evicted_total: int = Field(
        default=0, description="Contexts dropped because the bounded map was full.")
    leak_spans_total: int = Field(default=0, description="kvguard.leak spans queued.")
    transfer_spans_total: int = Field(default=0, description="kvguard.kv_transfer spans "
                                                             "queued.")
    hazard_spans_total: int = Field(default=0, description="kvguard.kv_transfer_hazard spans "
                                                           "queued.")
    queue_capacity: int = Field(default=0, description="Spans the export queue holds at most.")
    spans_queued_total: int = 0
    spans_dropped_total: int = Field(
        default=0, description="Spans dropped at the engine thread: the export queue was "
                               "full (the engine never waits for export).")
    spans_exported_total: int = Field(default=0, description="Spans the backend took.")
    export_failures_total: int = Field(
        default=0, description="Spans in export calls that failed (backend down, refused).")
    errors_total: int = Field(default=0, description="Failures inside kvguard's tracing, "
                                                     "contained.")


class EngineState(BaseModel):
    """One engine's state as published: written by the engine, read by readers."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    schema_version: int = STATE_SCHEMA_VERSION
    kvguard_version: str
    engine: str
    epoch: str = Field(description="pid and start time of the engine process.")
    pid: int
    started_at: float
    updated_at: float
    engine_kind: str = Field(description="The engine family, e.g. vllm.")
    engine_version: str | None = None
    model_name: str | None = Field(
        default=None, description="The model name the engine's own metrics carry (vLLM: "
                                  "model_name); None when the engine does not say.")
    engine_index: int = Field(
        default=0, ge=0, description="The engine's index in its server, as its own metrics "
                                     "label it (vLLM: engine=\"0\", the data-parallel rank).")
    hooks_installed: list[str] = Field(default_factory=list)
    hooks_missing: list[str] = Field(default_factory=list)
    faults_enabled: list[str] = Field(default_factory=list)
    pool: PoolReport | None = Field(default=None, description="At the last audit.")
    live_requests: int = 0
    finished_requests_holding_blocks: int = 0
    ledger_records: int = 0
    ledger_ownerships: int = 0
    events_total: dict[str, int] = Field(default_factory=dict)
    hook_errors_total: int = 0
    hook_errors_by_hook: dict[str, int] = Field(default_factory=dict)
    checkpoints_total: dict[str, int] = Field(default_factory=dict)
    online_checkpoints_total: dict[str, int] = Field(
        default_factory=dict, description="The part of checkpoints_total from online audits.")
    online: OnlineState | None = None
    publish_drops_total: int = 0
    drains_unaudited_total: int = Field(
        default=0, description="Drained moments not audited then, under the checkpoint pace "
                               "(KVGUARD_CHECKPOINT_MIN_INTERVAL_SECONDS, _BURST).")
    unaudited_drain_at: float | None = Field(
        default=None, description="Unix time of a drain not audited yet (the pace let it go): "
                                  "the latest drained report is older than the pool's state. "
                                  "None: the last drain was audited.")
    drain: DrainPrediction | None = Field(default=None, description="When the next drain can be.")
    transfers: TransfersState | None = Field(
        default=None, description="KV transfers between engines (P/D); None without a "
                                  "KV connector.")
    cost: CostState | None = Field(default=None, description="kvguard's own cost on the "
                                   "engine thread; None when metering is off.")
    kv_events: KvEventsState | None = Field(
        default=None, description="The engine's KV-event stream and its pool's hashed blocks "
                                  "(the KV-event mirror check); None when it publishes none.")
    tracing: TracingState | None = Field(
        default=None, description="kvguard's spans in the requests' traces; None when no "
                                  "OTLP endpoint is configured.")
    offload: OffloadState | None = Field(
        default=None, description="The offload path (an offloading KV connector's jobs and "
                                  "tier); None without one.")
    wedge: WedgeState | None = Field(default=None, description="The wedge monitor (present "
                                     "when the engine integration reads what waits).")
    reclaim: ReclaimState | None = Field(default=None, description="The opt-in reclaim "
                                         "(present when KVGUARD_RECLAIM is on).")
    reports: list[CheckpointReport] = Field(default_factory=list, description="Oldest first.")

    @property
    def latest_report(self) -> CheckpointReport | None:
        return self.reports[-1] if self.reports else None
