"""``Attributor``: one engine's attribution across its drained checkpoints.

Protocol (design.md section 3): the first ``warmup_checkpoints`` drained
checkpoints are warm-up (kernels, graph pools and caches settle); the next
one is the baseline; every later drained checkpoint is compared with it.
KV-pool findings need no baseline and are reported from the first
checkpoint. ``checkpoint`` never raises: a failure becomes an
``unavailable`` report with the error, and the engine goes on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvguard.attribution.attribute import (
    DEFAULT_MIN_DELTA_BYTES,
    Context,
    attribute,
    kv_pool_finding,
)
from kvguard.attribution.kv_pool import KvPoolSize
from kvguard.attribution.procedure import MemorySample, ProbeSet, ProcedureSettings, take_sample
from kvguard.attribution.snapshot import Snapshotter
from kvguard.attribution.wording import summary
from kvguard.core.report import (
    AllocatorReport,
    AttributionFinding,
    AttributionReport,
    AttributionStatus,
    Boundary,
    CheckpointReport,
    DeviceReport,
    HostReport,
    MemoryDomain,
    PoolReport,
)


@dataclass(frozen=True, slots=True)
class AttributionSettings:
    warmup_checkpoints: int = 1
    """Drained checkpoints before the baseline (``KVGUARD_ATTRIBUTION_WARMUP_CHECKPOINTS``)."""
    min_delta_bytes: int = DEFAULT_MIN_DELTA_BYTES
    """Smallest growth reported as movement (``KVGUARD_ATTRIBUTION_MIN_BYTES``)."""
    procedure: ProcedureSettings = field(default_factory=ProcedureSettings)


@dataclass(frozen=True, slots=True)
class AttributionResult:
    """The report sections one checkpoint fills."""

    allocator: AllocatorReport | None
    device: DeviceReport | None
    host: HostReport | None
    attribution: AttributionReport


class Attributor:
    """Per engine process. Not thread-safe: called from the engine's scheduler thread."""

    def __init__(self, settings: AttributionSettings, probes: ProbeSet, *,
                 kv: KvPoolSize | None = None, snapshots: Snapshotter | None = None) -> None:
        self.settings = settings
        self.probes = probes
        self.kv = kv
        self.snapshots = snapshots
        self.drained_seen = 0
        self.baseline: tuple[int, MemorySample] | None = None

    def attach(self, report: CheckpointReport) -> CheckpointReport:
        """``report`` with this checkpoint's memory attribution (the session's
        ``MemoryAttributor``)."""
        return with_attribution(report, self.checkpoint(report.checkpoint_id, report.pool))

    def checkpoint(self, checkpoint_id: int, pool: PoolReport | None) -> AttributionResult:
        """Sample now (the engine is drained) and attribute. Never raises."""
        try:
            return self._checkpoint(checkpoint_id, pool)
        except Exception as exc:
            report = AttributionReport(status=AttributionStatus.UNAVAILABLE,
                                       errors=[f"{type(exc).__name__}: {exc}"[:300]],
                                       min_delta_bytes=self.settings.min_delta_bytes)
            return AttributionResult(None, None, None,
                                     report.model_copy(update={"summary": summary(report)}))

    def _checkpoint(self, checkpoint_id: int, pool: PoolReport | None) -> AttributionResult:
        sample = take_sample(self.probes, self.settings.procedure)
        self.drained_seen += 1
        warmup = self.settings.warmup_checkpoints
        findings: list[AttributionFinding] = []
        snapshot_path: str | None = None
        snapshot_note: str | None = None
        baseline_id: int | None = None
        if self.drained_seen <= warmup:
            status = AttributionStatus.WARMING_UP
            kv = kv_pool_finding(pool, self.kv)
            findings = [kv] if kv is not None else []
        elif self.baseline is None:
            status = AttributionStatus.BASELINE
            self.baseline = (checkpoint_id, sample)
            baseline_id = checkpoint_id
            kv = kv_pool_finding(pool, self.kv)
            findings = [kv] if kv is not None else []
            if self.snapshots is not None:
                snapshot_note = self.snapshots.arm(checkpoint_id)
        else:
            status = AttributionStatus.COMPARED
            baseline_id, base = self.baseline
            findings = attribute(base, sample, pool, Context(
                baseline_id=baseline_id, min_delta_bytes=self.settings.min_delta_bytes,
                kv=self.kv))
            if self.snapshots is not None and _growth(findings, sample):
                snapshot_path, snapshot_note = self.snapshots.capture(checkpoint_id)
        report = AttributionReport(
            status=status, baseline_checkpoint_id=baseline_id,
            warmup_checkpoints_left=max(0, warmup - self.drained_seen),
            min_delta_bytes=self.settings.min_delta_bytes,
            kv_pool_bytes=self.kv.total_bytes if self.kv else None,
            kv_num_blocks=self.kv.num_blocks if self.kv else None,
            kv_bytes_per_block=self.kv.bytes_per_block if self.kv else None,
            findings=findings, scope=sample.scope, snapshot_path=snapshot_path,
            snapshot_note=snapshot_note)
        report = report.model_copy(update={"summary": summary(report)})
        return AttributionResult(sample.allocator, sample.device, sample.host, report)


def with_attribution(report: CheckpointReport, res: AttributionResult) -> CheckpointReport:
    """``report`` with its ``allocator``, ``device``, ``host`` and ``attribution`` sections
    filled, and the attribution summary appended to its explanation."""
    return report.model_copy(update={
        "allocator": res.allocator, "device": res.device, "host": res.host,
        "attribution": res.attribution,
        "explanation": f"{report.explanation}\n\n{res.attribution.summary}"})


def _growth(findings: list[AttributionFinding], sample: MemorySample) -> bool:
    """Tensor growth; on engines without tensor counters, process memory growth stands in."""
    kinds = {f.boundary for f in findings}
    if Boundary.TENSOR in kinds:
        return True
    return Boundary.PROCESS_MEMORY in kinds and sample.scope.domain is not MemoryDomain.CUDA
