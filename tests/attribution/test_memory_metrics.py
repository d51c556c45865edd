"""``kvguard_allocator_bytes``, ``kvguard_device_memory_bytes``, ``kvguard_host_swap_used_bytes``.

State files as engines publish them (a CUDA engine with attribution, a CPU
engine, an engine without attribution), read by the real store and
collector, exposed in the Prometheus text format.
"""

from __future__ import annotations

import time
from pathlib import Path

from _attr_fakes import CudaCounters, FakeCuda, FakeHost, FakeNvml, GiB, MiB, cpu_probes, pool
from _attr_fakes import cuda_probes as _cuda_probes
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvguard.attribution import AttributionSettings, Attributor, KvPoolSize
from kvguard.core.report import CheckpointReport, Verdict
from kvguard.sidecar.metrics import KvguardCollector
from kvguard.sidecar.store import EngineStore
from kvguard.transport.publisher import state_path
from kvguard.transport.state import EngineState


def _report(cid: int, engine: str, attributor: Attributor | None, taken_at: float
            ) -> CheckpointReport:
    p = pool()
    res = attributor.checkpoint(cid, p) if attributor else None
    return CheckpointReport(
        checkpoint_id=cid, engine=engine, epoch="e1", taken_at=taken_at, drained=True,
        verdict=Verdict.CLEAN, pool=p,
        allocator=res.allocator if res else None, device=res.device if res else None,
        host=res.host if res else None, attribution=res.attribution if res else None,
        explanation="clean")


def _write(run_dir: Path, engine: str, reports: list[CheckpointReport]) -> None:
    s = EngineState(kvguard_version="0.1.0", engine_kind="vllm", engine=engine, epoch="e1",
                    pid=1, started_at=1.0, updated_at=time.time(), pool=reports[-1].pool,
                    reports=reports)
    run_dir.mkdir(parents=True, exist_ok=True)
    state_path(run_dir, engine).write_text(s.model_dump_json())


def _samples(run_dir: Path) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    store = EngineStore(run_dir)
    store.refresh()
    reg = CollectorRegistry()
    reg.register(KvguardCollector(store))
    out: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for fam in text_string_to_metric_families(generate_latest(reg).decode()):
        for s in fam.samples:
            # vLLM's join labels (model_name, engine) are the same on every engine here
            labels = {k: v for k, v in s.labels.items() if k not in ("model_name", "engine")}
            out.setdefault(s.name, {})[tuple(sorted(labels.items()))] = s.value
    return out


def test_allocator_device_and_swap_metrics_from_the_latest_drained_reports(
        tmp_path: Path) -> None:
    now = time.time()
    cuda = FakeCuda(CudaCounters(allocated=74 * GiB, reserved=75 * GiB,
                                 inactive_split=200 * MiB, device_used=76 * GiB,
                                 process_used=75 * GiB + 512 * MiB))
    gpu_host = FakeHost()
    gpu_host.set_linux(rss=3 * GiB, swap_used=100 * MiB)
    gpu = Attributor(AttributionSettings(warmup_checkpoints=0),
                     _cuda_probes(cuda, nvml=FakeNvml(cuda), host=gpu_host),
                     kv=KvPoolSize(30_000, 2 * MiB))
    _write(tmp_path, "dp0", [_report(1, "dp0", gpu, now - 10)])
    cpu_host = FakeHost()
    cpu_host.set_linux(rss=600 * MiB, swap_used=300 * MiB)  # the most recent checkpoint
    cpu = Attributor(AttributionSettings(warmup_checkpoints=0), cpu_probes(cpu_host))
    _write(tmp_path, "cpu0", [_report(1, "cpu0", cpu, now - 1)])
    _write(tmp_path, "plain", [_report(1, "plain", None, now)])

    m = _samples(tmp_path)
    alloc = m["kvguard_allocator_bytes"]
    assert alloc == {
        (("engine_name", "dp0"), ("kind", "allocated")): 74 * GiB,
        (("engine_name", "dp0"), ("kind", "reserved")): 75 * GiB,
        (("engine_name", "dp0"), ("kind", "reserved_unallocated")): 1 * GiB,
        (("engine_name", "dp0"), ("kind", "inactive_split")): 200 * MiB,
    }
    assert m["kvguard_device_memory_bytes"] == {
        (("engine_name", "dp0"), ("kind", "used")): 76 * GiB,
        (("engine_name", "dp0"), ("kind", "non_torch")): 512 * MiB,  # process scope
    }
    # host-wide, no engine label: the most recent drained checkpoint that read swap
    assert m["kvguard_host_swap_used_bytes"] == {(): 300 * MiB}


def test_no_attribution_no_memory_series(tmp_path: Path) -> None:
    _write(tmp_path, "plain", [_report(1, "plain", None, time.time())])
    m = _samples(tmp_path)
    for name in ("kvguard_allocator_bytes", "kvguard_device_memory_bytes",
                 "kvguard_host_swap_used_bytes"):
        assert name not in m
    assert m["kvguard_pool_capacity_blocks"]  # the rest is unchanged
