"""Attribution on recorded counter sequences: each case names its boundary, and only it.

Each sequence runs through a real ``Attributor`` (warm-up 1: checkpoint 1 is
warm-up, checkpoint 2 the baseline, checkpoint 3 is judged) with fake
backends serving the recorded numbers. "No case misnamed": the set of
boundaries found is compared exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from _attr_fakes import (
    CudaCounters,
    FakeCuda,
    FakeHost,
    FakeMps,
    FakeNvml,
    GiB,
    MiB,
    cpu_probes,
    cuda_probes,
    pool,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.attribution import AttributionSettings, Attributor, KvPoolSize, ProbeSet
from kvguard.attribution.procedure import ProcedureSettings
from kvguard.core.report import (
    AttributionReport,
    AttributionStatus,
    Boundary,
    FindingStrength,
    MemoryDomain,
    PoolReport,
)

KV = KvPoolSize(num_blocks=30_000, bytes_per_block=2 * MiB)  # a 58.6 GiB pool
BASE = CudaCounters()
HOST = dict(rss=3 * GiB, swap_used=256 * MiB)


@dataclass(frozen=True)
class Step:
    cuda: CudaCounters = BASE
    host: dict[str, int] = field(default_factory=lambda: dict(HOST))
    pool: PoolReport = field(default_factory=pool)


def run(steps: list[Step], *, min_delta: int = 32 * MiB) -> list[AttributionReport]:
    cuda = FakeCuda()
    host = FakeHost()
    att = Attributor(AttributionSettings(warmup_checkpoints=1, min_delta_bytes=min_delta,
                                         procedure=ProcedureSettings()),
                     cuda_probes(cuda, nvml=FakeNvml(cuda), host=host), kv=KV)
    out = []
    for i, step in enumerate(steps, start=1):
        cuda.counters = step.cuda
        host.set_linux(**step.host)
        out.append(att.checkpoint(i, step.pool).attribution)
    return out


def judged(last: Step) -> AttributionReport:
    """Warm-up and baseline at the recorded base, then ``last``."""
    reports = run([Step(), Step(), last])
    assert [r.status for r in reports] == [AttributionStatus.WARMING_UP,
                                           AttributionStatus.BASELINE,
                                           AttributionStatus.COMPARED]
    assert reports[2].baseline_checkpoint_id == 2
    return reports[2]


def boundaries(r: AttributionReport) -> set[Boundary]:
    return {f.boundary for f in r.findings}


def finding(r: AttributionReport, b: Boundary) -> object:
    (f,) = [f for f in r.findings if f.boundary is b]
    return f


CASES: dict[str, tuple[Step, set[Boundary]]] = {
    "live tensor owner": (Step(cuda=BASE.but(
        allocated=BASE.allocated + 512 * MiB, reserved=BASE.reserved + 512 * MiB,
        peak=BASE.peak + 512 * MiB, device_used=BASE.device_used + 512 * MiB,
        process_used=(BASE.process_used or 0) + 512 * MiB)), {Boundary.TENSOR}),
    "allocator cache only": (Step(cuda=BASE.but(
        reserved=BASE.reserved + 1 * GiB, peak=BASE.peak + 1 * GiB,
        device_used=BASE.device_used + 1 * GiB,
        process_used=(BASE.process_used or 0) + 1 * GiB)), {Boundary.ALLOCATOR_CACHE}),
    "fragmentation": (Step(cuda=BASE.but(
        reserved=BASE.reserved + 300 * MiB, inactive_split=BASE.inactive_split + 300 * MiB,
        retries=3, device_used=BASE.device_used + 300 * MiB,
        process_used=(BASE.process_used or 0) + 300 * MiB)), {Boundary.FRAGMENTATION}),
    "non-torch residual": (Step(cuda=BASE.but(
        device_used=BASE.device_used + 400 * MiB,
        process_used=(BASE.process_used or 0) + 400 * MiB)), {Boundary.OUTSIDE_FRAMEWORK}),
    "KV leak with flat tensor counters": (Step(pool=pool(held=12, cached=0)),
                                          {Boundary.KV_POOL}),
    "swap growth with a flat footprint": (Step(host=dict(rss=3 * GiB - 100 * MiB,
                                                         swap_used=2 * GiB + 256 * MiB)),
                                          {Boundary.HOST_SWAP}),
    "transient peak": (Step(cuda=BASE.but(ooms=1, retries=1, peak=BASE.peak + 3 * GiB)),
                       {Boundary.TRANSIENT_PEAK}),
    "host process memory of a GPU engine": (Step(host=dict(rss=4 * GiB, swap_used=256 * MiB)),
                                            {Boundary.PROCESS_MEMORY}),
    "noise below the threshold": (Step(cuda=BASE.but(
        allocated=BASE.allocated + 8 * MiB, reserved=BASE.reserved + 8 * MiB,
        device_used=BASE.device_used + 8 * MiB),
        host=dict(rss=3 * GiB + 10 * MiB, swap_used=256 * MiB)), set()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_case_is_named_and_nothing_else(case: str) -> None:
    step, expected = CASES[case]
    r = judged(step)
    assert boundaries(r) == expected, [f.evidence for f in r.findings]
    if not expected:
        assert "no boundary moved" in r.summary
    for f in r.findings:
        assert f.evidence and f.next_step and f.delta_bytes >= 0
        assert f.boundary.value in r.summary


def test_live_tensor_growth_is_an_owner_not_cache_and_not_the_kv_pool() -> None:
    r = judged(CASES["live tensor owner"][0])
    f = finding(r, Boundary.TENSOR)
    assert f.strength is FindingStrength.ATTRIBUTION and f.delta_bytes == 512 * MiB
    assert f.baseline_bytes == BASE.allocated and "live tensors owned elsewhere" in f.evidence
    assert "owner" in f.next_step


def test_cache_is_not_a_leak_and_says_how_to_return_it() -> None:
    f = finding(judged(CASES["allocator cache only"][0]), Boundary.ALLOCATOR_CACHE)
    assert f.strength is FindingStrength.NOT_A_LEAK and f.delta_bytes == 1 * GiB
    assert "peak rose" in f.evidence
    assert "KVGUARD_EMPTY_CACHE_AT_CHECKPOINT" in f.next_step and "never on every step" in \
        f.next_step


def test_fragmentation_counts_split_bytes_and_retries_but_not_as_cache() -> None:
    f = finding(judged(CASES["fragmentation"][0]), Boundary.FRAGMENTATION)
    assert f.delta_bytes == 300 * MiB and "retries +3" in f.evidence
    assert "expandable_segments" in f.next_step and "evidence" in f.next_step


def test_retries_alone_are_fragmentation_evidence() -> None:
    r = judged(Step(cuda=BASE.but(retries=5)))
    assert boundaries(r) == {Boundary.FRAGMENTATION}


def test_the_retry_each_oom_makes_is_not_counted_as_fragmentation() -> None:
    """The native allocator retries once (cache flushed) before raising OOM."""
    r = judged(Step(cuda=BASE.but(retries=2, ooms=2)))
    assert boundaries(r) == {Boundary.TRANSIENT_PEAK}
    r = judged(Step(cuda=BASE.but(retries=3, ooms=2)))
    assert boundaries(r) == {Boundary.TRANSIENT_PEAK, Boundary.FRAGMENTATION}
    assert "retries +1" in str(finding(r, Boundary.FRAGMENTATION))


def test_outside_framework_is_a_lead_not_an_attribution() -> None:
    f = finding(judged(CASES["non-torch residual"][0]), Boundary.OUTSIDE_FRAMEWORK)
    assert f.strength is FindingStrength.LEAD and f.delta_bytes == 400 * MiB
    assert "this process's NVML usage" in f.evidence
    assert "NCCL" in f.next_step and "cannot see" in f.next_step


def test_kv_leak_is_priced_in_pool_bytes_and_says_tensor_counters_did_not_move() -> None:
    r = judged(CASES["KV leak with flat tensor counters"][0])
    f = finding(r, Boundary.KV_POOL)
    assert f.delta_bytes == 12 * 2 * MiB
    assert "allocated +0 B" in f.evidence and "only the ledger" in f.evidence
    assert "block-reference transition" in f.next_step
    assert r.kv_pool_bytes == KV.total_bytes and r.kv_bytes_per_block == 2 * MiB


def test_kv_leak_is_reported_during_warm_up_without_a_baseline() -> None:
    first = run([Step(pool=pool(held=3, orphaned=1, cached=0))])[0]
    assert first.status is AttributionStatus.WARMING_UP
    assert boundaries(first) == {Boundary.KV_POOL}
    assert finding(first, Boundary.KV_POOL).delta_bytes == 4 * 2 * MiB


def test_swap_growth_is_the_signal_even_when_the_footprint_drops() -> None:
    f = finding(judged(CASES["swap growth with a flat footprint"][0]), Boundary.HOST_SWAP)
    assert f.delta_bytes == 2 * GiB and "process RSS -100.0 MiB" in f.evidence
    assert "honest signal" in f.evidence and "footprint" in f.next_step


def test_transient_peak_says_lower_the_concurrency_limit() -> None:
    f = finding(judged(CASES["transient peak"][0]), Boundary.TRANSIENT_PEAK)
    assert f.delta_bytes == 3 * GiB and "max_num_seqs" in f.next_step


def test_never_adds_allocated_and_reserved() -> None:
    """Tensor growth that the allocator reserved for is named once, as tensor."""
    r = judged(Step(cuda=BASE.but(allocated=BASE.allocated + 2 * GiB,
                                  reserved=BASE.reserved + 2 * GiB + 512 * MiB,
                                  device_used=BASE.device_used + 2 * GiB + 512 * MiB,
                                  process_used=(BASE.process_used or 0) + 2 * GiB + 512 * MiB)))
    got = {f.boundary: f.delta_bytes for f in r.findings}
    assert got == {Boundary.TENSOR: 2 * GiB, Boundary.ALLOCATOR_CACHE: 512 * MiB}
    assert sum(got.values()) == 2 * GiB + 512 * MiB  # == growth of device used, not 4.5 GiB


@settings(max_examples=60, deadline=None)
@given(tensor=st.integers(1, 8 * GiB), frag=st.integers(1, 2 * GiB),
       cache=st.integers(1, 4 * GiB), outside=st.integers(1, 2 * GiB))
def test_device_findings_partition_device_growth(tensor: int, frag: int, cache: int,
                                                  outside: int) -> None:
    reserved = BASE.reserved + tensor + frag + cache
    used = BASE.device_used + tensor + frag + cache + outside
    proc = (BASE.process_used or 0) + tensor + frag + cache + outside
    r = run([Step(), Step(), Step(cuda=BASE.but(
        allocated=BASE.allocated + tensor, reserved=reserved,
        inactive_split=BASE.inactive_split + frag, device_used=used, process_used=proc))],
        min_delta=1)[2]
    got = {f.boundary: f.delta_bytes for f in r.findings}
    assert got == {Boundary.TENSOR: tensor, Boundary.FRAGMENTATION: frag,
                   Boundary.ALLOCATOR_CACHE: cache, Boundary.OUTSIDE_FRAMEWORK: outside}
    assert sum(got.values()) == proc - (BASE.process_used or 0)


def test_scope_change_between_baseline_and_now_is_not_compared() -> None:
    """NVML listed the pid at the baseline and not now: process vs device numbers differ."""
    cuda = FakeCuda()
    nvml = FakeNvml(cuda)
    att = Attributor(AttributionSettings(warmup_checkpoints=0),
                     cuda_probes(cuda, nvml=nvml), kv=KV)
    att.checkpoint(1, pool())
    nvml.pid_visible = False  # device-wide number now includes a 2 GiB peer
    r = att.checkpoint(2, pool()).attribution
    assert Boundary.OUTSIDE_FRAMEWORK not in boundaries(r)


def _cpu_sequence(rss: list[int], pools: list[PoolReport]) -> AttributionReport:
    host = FakeHost()
    att = Attributor(AttributionSettings(warmup_checkpoints=1), cpu_probes(host),
                     kv=KvPoolSize(num_blocks=64, bytes_per_block=16 * 1024))
    r = None
    for i, (n, p) in enumerate(zip(rss, pools, strict=True), start=1):
        host.set_linux(rss=n, swap_used=0)
        r = att.checkpoint(i, p).attribution
    assert r is not None
    return r


def test_cpu_engine_process_growth_with_a_clean_pool_is_a_live_owner_not_the_pool() -> None:
    r = _cpu_sequence([600 * MiB, 600 * MiB, 800 * MiB], [pool()] * 3)
    assert boundaries(r) == {Boundary.PROCESS_MEMORY}
    f = finding(r, Boundary.PROCESS_MEMORY)
    assert f.delta_bytes == 200 * MiB
    assert "not the KV pool" in f.evidence and "every block is accounted for" in f.evidence
    assert "1.0 MiB (64 blocks x 16 KiB)" in f.evidence


def test_cpu_engine_pool_leak_with_flat_memory_is_the_pool_only() -> None:
    r = _cpu_sequence([600 * MiB] * 3, [pool(), pool(), pool(held=5, cached=0)])
    assert boundaries(r) == {Boundary.KV_POOL}
    assert finding(r, Boundary.KV_POOL).delta_bytes == 5 * 16 * 1024


def test_unified_memory_footprint_drop_with_swap_growth_is_host_swap() -> None:
    """The MPS seed: footprint falls after .to('cpu') while swap grows by gigabytes."""
    mps = FakeMps()
    host = FakeHost(platform="darwin", files={}, rss=18 * GiB)
    att = Attributor(AttributionSettings(warmup_checkpoints=0),
                     ProbeSet(domain=MemoryDomain.MPS, host=host, mps=mps))
    host.sysctls["vm.swapusage"] = "total = 12288.00M  used = 1024.00M  free = 11264.00M"
    att.checkpoint(1, None)
    mps.allocated, mps.driver, host.rss = 0, 0, 100 * MiB
    host.sysctls["vm.swapusage"] = "total = 12288.00M  used = 10854.40M  free = 1433.60M"
    r = att.checkpoint(2, None).attribution
    assert boundaries(r) == {Boundary.HOST_SWAP}
    assert finding(r, Boundary.HOST_SWAP).delta_bytes == round(9830.4 * MiB)


def test_a_cpu_engine_with_worker_processes_counts_their_memory() -> None:
    """vLLM runs CPU engines with the mp executor: the model and KV pool live in a worker
    process, a child of EngineCore; retained tensors there grow the worker, not EngineCore."""
    host = FakeHost()
    probes = cpu_probes(host)
    probes.workers_in_process = False
    att = Attributor(AttributionSettings(warmup_checkpoints=0), probes,
                     kv=KvPoolSize(num_blocks=64, bytes_per_block=16 * 1024))
    host.set_linux(rss=400 * MiB, swap_used=0)
    host.set_children({5001: 900 * MiB, 5002: 20 * MiB})
    base = att.checkpoint(1, pool())
    assert base.host is not None
    assert (base.host.child_processes, base.host.child_processes_rss_bytes) == (2, 920 * MiB)
    assert base.attribution.scope is not None
    assert base.attribution.scope.workers_in_process is False
    host.set_children({5001: 1200 * MiB, 5002: 20 * MiB})  # EngineCore itself flat
    r = att.checkpoint(2, pool()).attribution
    assert boundaries(r) == {Boundary.PROCESS_MEMORY}
    f = finding(r, Boundary.PROCESS_MEMORY)
    assert f.delta_bytes == 300 * MiB and f.current_bytes == 1620 * MiB
    assert "this process and its 2 worker process(es)" in f.evidence


def test_workers_not_found_is_said_and_falls_back_to_this_process() -> None:
    host = FakeHost()
    probes = cpu_probes(host)
    probes.workers_in_process = False
    res = Attributor(AttributionSettings(), probes).checkpoint(1, pool())
    assert res.host is not None and res.host.child_processes_rss_bytes is None
    assert any(u.startswith("child processes") for u in res.host.unavailable)
