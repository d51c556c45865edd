"""Warm-up, baseline, containment and memory snapshots of the per-engine ``Attributor``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _attr_fakes import (
    CudaCounters,
    FakeCuda,
    FakeHost,
    FakeNvml,
    GiB,
    MiB,
    cpu_probes,
    cuda_probes,
    pool,
)

from kvguard.attribution import AttributionSettings, Attributor, KvPoolSize, ProbeSet
from kvguard.attribution.setup import domain_of, settings_from_config
from kvguard.attribution.snapshot import Snapshotter
from kvguard.config import KvguardConfig
from kvguard.core.report import (
    AttributionStatus,
    Boundary,
    CheckpointReport,
    MemoryDomain,
    Verdict,
)


@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_baseline_is_the_first_drained_checkpoint_after_warm_up(warmup: int) -> None:
    att = Attributor(AttributionSettings(warmup_checkpoints=warmup), cpu_probes(FakeHost()))
    statuses = [att.checkpoint(i, pool()).attribution for i in range(1, warmup + 4)]
    assert [r.status for r in statuses] == (
        [AttributionStatus.WARMING_UP] * warmup + [AttributionStatus.BASELINE]
        + [AttributionStatus.COMPARED] * 2)
    assert [r.warmup_checkpoints_left for r in statuses[:warmup]] == \
        list(range(warmup - 1, -1, -1))
    assert all(r.baseline_checkpoint_id == warmup + 1 for r in statuses[warmup:])
    if warmup:
        assert "warm-up checkpoint" in statuses[0].summary
    assert "this checkpoint is the baseline" in statuses[warmup].summary


class Boom:
    """A host backend that fails in a way no probe guards: the attributor contains it."""

    platform = "linux"

    def read_text(self, path: str) -> str | None:
        raise MemoryError("cannot allocate")

    def sysctl(self, name: str) -> str | None:
        return None

    def max_rss_bytes(self) -> int | None:
        return None

    def process_rss_bytes(self) -> int | None:
        return None

    def child_pids(self) -> list[int]:
        return []


def test_an_unexpected_failure_becomes_an_unavailable_report_not_an_exception() -> None:
    att = Attributor(AttributionSettings(), ProbeSet(domain=MemoryDomain.CPU, host=Boom()))
    res = att.checkpoint(1, pool())
    assert res.allocator is res.device is res.host is None
    a = res.attribution
    assert a.status is AttributionStatus.UNAVAILABLE
    assert a.errors == ["MemoryError: cannot allocate"]
    assert "unavailable (MemoryError: cannot allocate)" in a.summary
    assert att.drained_seen == 0  # a failed checkpoint does not count as warm-up


class FakeHistory:
    def __init__(self) -> None:
        self.started: list[int] = []
        self.dumped: list[str] = []

    def start(self, max_entries: int) -> None:
        self.started.append(max_entries)

    def dump(self, path: str) -> None:
        Path(path).write_bytes(b"snapshot")
        self.dumped.append(path)


def test_tensor_growth_dumps_a_snapshot_recorded_since_the_baseline(tmp_path: Path) -> None:
    cuda = FakeCuda()
    history = FakeHistory()
    snaps = Snapshotter(tmp_path / "snaps", history, name="dp0-123-456", max_files=2)
    att = Attributor(AttributionSettings(warmup_checkpoints=0), cuda_probes(cuda),
                     snapshots=snaps)
    att.checkpoint(1, pool())
    assert history.started == [100_000] and history.dumped == []
    cuda.counters = CudaCounters().but(allocated=CudaCounters().allocated + 1 * GiB,
                                       reserved=CudaCounters().reserved + 1 * GiB)
    r = att.checkpoint(2, pool()).attribution
    assert {f.boundary for f in r.findings} == {Boundary.TENSOR}
    assert r.snapshot_path == str(tmp_path / "snaps" / "dp0-123-456-checkpoint2.pickle")
    assert Path(r.snapshot_path).read_bytes() == b"snapshot"
    assert "since checkpoint #1" in (r.snapshot_note or "")
    assert f"Memory snapshot: {r.snapshot_path}" in r.summary
    assert (tmp_path / "snaps").stat().st_mode & 0o777 == 0o700
    att.checkpoint(3, pool())
    r = att.checkpoint(4, pool()).attribution
    assert r.snapshot_path is None and "2 snapshots already written" in (r.snapshot_note or "")
    assert history.started == [100_000]  # recording started once


def test_no_growth_no_snapshot(tmp_path: Path) -> None:
    history = FakeHistory()
    att = Attributor(AttributionSettings(warmup_checkpoints=0), cuda_probes(FakeCuda()),
                     snapshots=Snapshotter(tmp_path, history, name="e"))
    for i in range(1, 4):
        r = att.checkpoint(i, pool()).attribution
    assert r.snapshot_path is None and history.dumped == []


def test_on_a_cpu_engine_the_snapshot_is_said_to_be_unavailable(tmp_path: Path) -> None:
    host = FakeHost()
    snaps = Snapshotter(tmp_path, None, name="dp0",
                        why_unavailable="memory history snapshots need CUDA; this engine runs "
                                        "on cpu")
    att = Attributor(AttributionSettings(warmup_checkpoints=0), cpu_probes(host),
                     snapshots=snaps, kv=KvPoolSize(64, 16384))
    host.set_linux(rss=500 * MiB, swap_used=0)
    first = att.checkpoint(1, pool()).attribution
    assert first.snapshot_note is not None and first.snapshot_note.startswith("unavailable")
    host.set_linux(rss=900 * MiB, swap_used=0)
    r = att.checkpoint(2, pool()).attribution
    assert {f.boundary for f in r.findings} == {Boundary.PROCESS_MEMORY}
    assert r.snapshot_path is None
    assert r.snapshot_note == ("unavailable: memory history snapshots need CUDA; this engine "
                               "runs on cpu")
    assert "Memory snapshot: unavailable" in r.summary
    assert list(tmp_path.iterdir()) == []


def test_settings_come_from_kvguard_config() -> None:
    cfg = KvguardConfig.from_env({
        "KVGUARD_ATTRIBUTION_WARMUP_CHECKPOINTS": "2", "KVGUARD_ATTRIBUTION_MIN_BYTES": "1048576",
        "KVGUARD_EMPTY_CACHE_AT_CHECKPOINT": "1", "KVGUARD_SETTLE_SECONDS": "0.25"})
    s = settings_from_config(cfg)
    assert (s.warmup_checkpoints, s.min_delta_bytes) == (2, 1 << 20)
    assert s.procedure.empty_cache and s.procedure.settle_seconds == 0.25
    d = settings_from_config(KvguardConfig.from_env({}))
    assert (d.warmup_checkpoints, d.min_delta_bytes) == (1, 32 << 20)
    assert not d.procedure.empty_cache and d.procedure.settle_seconds == 0.5
    assert KvguardConfig.from_env({"KVGUARD_SNAPSHOT_DIR": "/var/tmp/kv"}).snapshot_dir == \
        Path("/var/tmp/kv")
    assert KvguardConfig.from_env({"KVGUARD_ATTRIBUTION": "0"}).attribution is False


@pytest.mark.parametrize("env", [{"KVGUARD_SETTLE_SECONDS": "-0.1"},
                                 {"KVGUARD_ATTRIBUTION_WARMUP_CHECKPOINTS": "-1"},
                                 {"KVGUARD_ATTRIBUTION_MIN_BYTES": "lots"}])
def test_bad_attribution_settings_are_rejected(env: dict[str, str]) -> None:
    from kvguard.errors import ConfigError

    with pytest.raises(ConfigError):
        KvguardConfig.from_env(env)


def test_domain_of_vllm_device_types() -> None:
    assert domain_of("cuda") is MemoryDomain.CUDA and domain_of("cpu") is MemoryDomain.CPU
    assert domain_of("mps") is MemoryDomain.MPS and domain_of("xpu") is MemoryDomain.OTHER


def test_a_report_with_attribution_round_trips_through_strict_json() -> None:
    cuda = FakeCuda()
    att = Attributor(AttributionSettings(warmup_checkpoints=0),
                     cuda_probes(cuda, nvml=FakeNvml(cuda)), kv=KvPoolSize(30_000, 2 * MiB))
    att.checkpoint(1, pool())
    cuda.counters = CudaCounters().but(reserved=CudaCounters().reserved + 2 * GiB)
    res = att.checkpoint(2, pool(held=2, cached=0))
    report = CheckpointReport(
        checkpoint_id=2, engine="dp0", epoch="e", taken_at=1.0, drained=True,
        verdict=Verdict.LEAK, pool=pool(held=2, cached=0), allocator=res.allocator,
        device=res.device, host=res.host, attribution=res.attribution, explanation="x")
    raw = report.model_dump_json()
    again = CheckpointReport.model_validate_json(raw)
    assert again == report
    data = json.loads(raw)
    assert {f["boundary"] for f in data["attribution"]["findings"]} == {"kv_pool",
                                                                         "allocator_cache"}
    assert data["attribution"]["scope"]["domain"] == "cuda"
    assert data["device"]["non_torch_scope"] == "process"


def test_executor_backend_says_where_the_model_runs() -> None:
    from kvguard.attribution.setup import workers_in_process

    assert workers_in_process("uni") is True
    assert workers_in_process("mp") is False and workers_in_process("ray") is False
    assert workers_in_process(None) is None and workers_in_process(object) is None
