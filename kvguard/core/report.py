"""The checkpoint report: the public JSON contract of design.md section 7.

Strict pydantic models: unknown fields are rejected, nothing is coerced. A
report never carries prompt text or token ids: only request ids, counts,
block ids and times.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

from kvguard.core.types import BlockState, Evidence, FinishReason, LeakCause, LeakPath, Verdict

REPORT_SCHEMA_VERSION = 2
"""2: ``leaked_blocks`` and ``LeakReport.shared_blocks`` added; ``leaked_blocks_by_cause``
counts distinct blocks (1 summed the findings, over-counting prefix-shared blocks)."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class PoolReport(_Model):
    """Usable blocks by state: what an audit computes and what the report carries (one
    type in process and in JSON; the field names are ``BlockState`` values).

    Invariant: ``free + cached + active + held_by_finished + orphaned == capacity``.
    Over an online sweep each block is counted once, at the moment its slice was read.
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

    @classmethod
    def from_counts(cls, *, capacity: int, counts: Mapping[BlockState, int],
                    num_free_reported: int) -> PoolReport:
        """The pool report of an audit's per-state counts (a missing state counts 0)."""
        return cls(capacity=capacity, num_free_reported=num_free_reported,
                   **{s.value: int(counts.get(s, 0)) for s in BlockState})

    def __getitem__(self, state: BlockState) -> int:
        """Blocks in ``state``."""
        n: int = getattr(self, state.value)
        return n

    def by_state(self) -> dict[BlockState, int]:
        """Blocks per state, in ``BlockState`` order (for metrics and tables)."""
        return {s: self[s] for s in BlockState}

    @property
    def total(self) -> int:
        """The sum over states; equals ``capacity`` (the invariant above)."""
        return sum(self.by_state().values())

    @property
    def saturation_ratio(self) -> float:
        """Cached (evictable) blocks over capacity, 0..1; 0 for an empty pool."""
        return self.cached / self.capacity if self.capacity else 0.0


class LeakReport(_Model):
    """One leak finding: who holds what, how it got there, since when."""

    request_id: str | None = Field(description="Engine-internal request id, if known.")
    client_request_id: str | None = Field(
        default=None, description="The id the client gave (vLLM's suffix removed)."
    )
    cause: LeakCause
    finish_reason: FinishReason | None = None
    path: LeakPath
    blocks: int = Field(ge=0, description="Blocks this finding covers. A block shared "
                        "through the prefix cache by several leaking requests is in each of "
                        "their findings; the report's ``leaked_blocks`` counts it once.")
    shared_blocks: int = Field(ge=0, default=0, description="How many of ``blocks`` another "
                               "finding of this report names too.")
    block_ids: list[int] = Field(default_factory=list, description="At most 32 of them.")
    held_for_seconds: float | None = None
    evidence: Evidence
    detail: str = ""


class MemoryDomain(enum.StrEnum):
    """Where the engine's tensors (and its KV pool) live."""

    CUDA = "cuda"
    MPS = "mps"
    CPU = "cpu"
    OTHER = "other"
    """An accelerator kvguard has no allocator probe for (host numbers only)."""


class DeviceSource(enum.StrEnum):
    """Which interface the device-level numbers came from."""

    NVML = "nvml"
    CUDA_MEM_GET_INFO = "cuda_mem_get_info"


class NonTorchScope(enum.StrEnum):
    """What ``non_torch_bytes`` subtracts torch's reservation from.

    ``process``: NVML's used memory of this very process (CUDA context, NCCL,
    graphs, direct CUDA allocations of this process). ``device``: the whole
    device's used memory, which also counts every other process on it (NVML
    does not list this pid, e.g. a container seeing host pids, or only
    ``mem_get_info`` was readable).
    """

    PROCESS = "process"
    DEVICE = "device"


class AllocatorReport(_Model):
    """Framework allocator counters (bytes), filled by the attribution probes.

    Invariant (native caching allocator): ``allocated_bytes <= reserved_bytes``;
    allocated sits *inside* reserved, so the two are never added. Their
    difference (``reserved_unallocated_bytes``) is allocator-held cache, and
    ``inactive_split_bytes`` is the part of that cache stuck in split segments
    (fragmentation). On MPS ``allocated_bytes`` is
    ``torch.mps.current_allocated_memory`` and ``reserved_bytes`` is
    ``driver_allocated_memory``.
    """

    backend: str | None = None
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    inactive_split_bytes: int | None = None
    num_alloc_retries: int | None = None
    num_ooms: int | None = None
    unavailable: list[str] = Field(default_factory=list)
    domain: MemoryDomain | None = None
    active_bytes: int | None = Field(
        default=None, description="active_bytes.all.current: allocated plus frees still "
        "waiting on stream events.")
    peak_allocated_bytes: int | None = Field(
        default=None, description="allocated_bytes.all.peak: high-water mark since start.")

    @property
    def reserved_unallocated_bytes(self) -> int | None:
        """``reserved - allocated``: cache the allocator holds (bytes), not a leak."""
        if self.reserved_bytes is None or self.allocated_bytes is None:
            return None
        return self.reserved_bytes - self.allocated_bytes


class DeviceReport(_Model):
    """Device-level memory (bytes), filled by the attribution probes.

    ``non_torch_bytes = used - reserved`` in the scope ``non_torch_scope`` says:
    memory outside the framework (CUDA context, NCCL, CUDA graphs, other
    processes). A residual there is a lead, not an attribution.
    """

    used_bytes: int | None = None
    total_bytes: int | None = None
    non_torch_bytes: int | None = None
    unavailable: list[str] = Field(default_factory=list)
    source: DeviceSource | None = None
    device_index: int | None = None
    process_used_bytes: int | None = Field(
        default=None, description="NVML's used memory of this process, when NVML lists it.")
    non_torch_scope: NonTorchScope | None = None


class HostReport(_Model):
    """Host memory (bytes), filled by the attribution probes.

    On unified memory (Apple silicon) the process footprint can look small
    while the data is still there; ``swap_used_bytes`` growth is the honest
    signal that the host does not fit.
    """

    rss_bytes: int | None = None
    swap_used_bytes: int | None = None
    mem_available_bytes: int | None = None
    unavailable: list[str] = Field(default_factory=list)
    swap_total_bytes: int | None = None
    rss_peak_bytes: int | None = Field(
        default=None, description="getrusage ru_maxrss: the process's peak RSS, not current.")
    child_processes: int | None = Field(
        default=None, description="Child processes read (the engine's workers), when the "
        "model runs outside this process.")
    child_processes_rss_bytes: int | None = Field(
        default=None, description="Their RSS summed; the KV pool of such an engine is there.")


class Boundary(enum.StrEnum):
    """Which memory boundary moved (design.md sections 2 and 3).

    The values are part of the public contract (report JSON).
    """

    TENSOR = "tensor"
    """Live tensor bytes grew: an owner keeps tensors (outputs in a list, closures, graphs)."""
    ALLOCATOR_CACHE = "allocator_cache"
    """reserved - allocated grew (minus fragmentation): reusable cache, not a leak."""
    FRAGMENTATION = "fragmentation"
    """inactive split bytes or allocation retries grew."""
    OUTSIDE_FRAMEWORK = "outside_framework"
    """device used - torch reserved grew: context, NCCL, graphs, other processes (a lead)."""
    KV_POOL = "kv_pool"
    """KV blocks are held at a drained checkpoint: the pool ledger's leak, in bytes."""
    HOST_SWAP = "host_swap"
    """Host swap grew: the host does not fit, whatever the process footprint says."""
    PROCESS_MEMORY = "process_memory"
    """Process RSS grew while the KV pool tensor stayed the same size (CPU engines)."""
    TRANSIENT_PEAK = "transient_peak"
    """The allocator ran out of memory between checkpoints while drained usage is flat."""


class FindingStrength(enum.StrEnum):
    """How far a finding goes."""

    ATTRIBUTION = "attribution"
    """The boundary names the kind of owner; the next step says where to look."""
    LEAD = "lead"
    """Memory outside what kvguard can attribute: investigate further, do not conclude."""
    NOT_A_LEAK = "not_a_leak"
    """Reclaimable by design (allocator cache)."""


class AttributionStatus(enum.StrEnum):
    """Where the attribution is in its protocol (warm-up, baseline, comparison)."""

    WARMING_UP = "warming_up"
    BASELINE = "baseline"
    COMPARED = "compared"
    UNAVAILABLE = "unavailable"


class AttributionFinding(_Model):
    """One boundary that moved since the baseline, by how much, and what to do next.

    ``delta_bytes`` is the growth of that boundary's own counter since the
    baseline (for ``kv_pool``: leaked blocks x bytes per block now). Findings
    of one checkpoint never count the same bytes twice: tensor, allocator
    cache, fragmentation and outside-framework partition the device's used
    memory.
    """

    boundary: Boundary
    strength: FindingStrength
    delta_bytes: int
    baseline_bytes: int | None = None
    current_bytes: int | None = None
    evidence: str
    next_step: str


class ProbeScope(_Model):
    """How the numbers of one checkpoint were read, so that they can be compared."""

    pid: int
    domain: MemoryDomain
    torch_version: str | None = None
    cuda_runtime_version: str | None = None
    driver_version: str | None = None
    world_size: int | None = Field(
        default=None, description="Engine workers; > 1 means some run in other processes.")
    workers_in_process: bool | None = Field(
        default=None, description="Whether the model (and its tensors) runs in this process "
        "(vLLM's uni executor) or in worker processes (mp, ray); None: unknown.")
    nvml_sees_process: bool | None = Field(
        default=None, description="Whether NVML lists this pid (None: NVML not readable).")
    synchronized: bool = False
    cache_returned: bool = False
    settled_seconds: float = Field(ge=0.0, default=0.0)
    read_window_seconds: float = Field(ge=0.0, default=0.0,
                                       description="First to last counter read.")


class AttributionReport(_Model):
    """Memory attribution of one drained checkpoint against the baseline."""

    status: AttributionStatus
    baseline_checkpoint_id: int | None = None
    warmup_checkpoints_left: int = Field(ge=0, default=0)
    min_delta_bytes: int = Field(ge=0, default=0,
                                 description="Smaller changes are not reported as movement.")
    kv_pool_bytes: int | None = None
    kv_num_blocks: int | None = None
    kv_bytes_per_block: int | None = None
    findings: list[AttributionFinding] = Field(default_factory=list)
    scope: ProbeScope | None = None
    snapshot_path: str | None = Field(
        default=None, description="PyTorch memory snapshot (stacks, no tensor contents).")
    snapshot_note: str | None = None
    errors: list[str] = Field(default_factory=list,
                              description="Attribution failures, contained.")
    summary: str = ""


class OnlineSweepReport(_Model):
    """How the online audit behind a report covered the pool (``evidence: online``).

    Block states in ``pool`` are counted over the sweep, each block once, at the
    moment its slice was read: they sum to capacity but are not one instant.
    """

    sweep_steps: int = Field(ge=0, description="Engine steps one full sweep took (K).")
    sweep_seconds: float = Field(ge=0.0, description="Wall time of that sweep.")
    audit_seconds: float = Field(ge=0.0, description="Audit time spent in that sweep.")
    budget_fraction: float = Field(ge=0.0, le=1.0,
                                   description="Audit time allowed per second of step time.")
    detection_latency_steps: int = Field(
        ge=0, description="Worst case from a leak to its report: three sweeps, in steps.")
    detection_latency_seconds: float = Field(
        ge=0.0, description="The same in seconds, at the last sweep's pace; delayed and "
        "deferred frees count from their bound.")
    delayed_free_bound_seconds: float = Field(ge=0.0)


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
    leaked_blocks: int = Field(ge=0, default=0, description="Distinct leaked blocks over "
                               "every finding: what the pool lost (x bytes per block = the "
                               "memory). Not the sum of the findings' ``blocks``.")
    leaked_blocks_by_cause: dict[LeakCause, int] = Field(
        default_factory=dict, description="Distinct leaked blocks per cause; a block has one "
        "cause, so these sum to ``leaked_blocks``.")
    allocator: AllocatorReport | None = None
    device: DeviceReport | None = None
    host: HostReport | None = None
    attribution: AttributionReport | None = None
    explanation: str
    audit_seconds: float = Field(ge=0.0, default=0.0, description="Time the audit took.")
    evidence: Evidence = Field(
        default=Evidence.DRAINED,
        description="drained: a checkpoint with no work in flight (judges ownership and "
        "memory); online: a step-boundary sweep under load (judges ownership only).")
    online: OnlineSweepReport | None = None
