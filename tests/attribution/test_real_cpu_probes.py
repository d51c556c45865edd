"""The real host probes on this machine (Linux, no GPU): RSS, /proc/meminfo swap, attribution.

Nothing is faked here: the numbers come from this process's procfs, and a
deliberately retained 256 MiB buffer must show up as process-memory growth
and disappear when released.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import pytest

from kvguard.attribution import AttributionSettings, Attributor, KvPoolSize, ProcedureSettings
from kvguard.attribution.backends import SystemHost
from kvguard.attribution.host import parse_kib_fields, read_host
from kvguard.attribution.procedure import open_probes, take_sample
from kvguard.core.report import AttributionStatus, Boundary, MemoryDomain

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="procfs probes are Linux-only")
MiB = 1 << 20


def _status_rss() -> int:
    """The kernel's other rendering of the counter kvguard reads from statm."""
    with open("/proc/self/status") as f:
        return parse_kib_fields(f.read())["VmRSS"]


def _touched(n_bytes: int) -> np.ndarray:
    buf = np.ones(n_bytes, dtype=np.uint8)  # written: every page resident
    return buf


def test_rss_matches_an_independent_reading() -> None:
    h = read_host(SystemHost())
    assert h.rss_bytes is not None
    assert abs(h.rss_bytes - _status_rss()) < 16 * MiB
    assert h.rss_peak_bytes is not None and h.rss_peak_bytes > 0
    assert h.unavailable == []


def test_swap_and_available_memory_come_from_proc_meminfo() -> None:
    with open("/proc/meminfo") as f:
        fields = parse_kib_fields(f.read())
    h = read_host(SystemHost())
    assert h.swap_total_bytes == fields["SwapTotal"]
    assert h.swap_used_bytes is not None and 0 <= h.swap_used_bytes <= fields["SwapTotal"]
    assert h.mem_available_bytes is not None
    assert 0 < h.mem_available_bytes <= fields["MemTotal"]


def test_a_retained_buffer_grows_rss_and_releasing_it_shrinks_it() -> None:
    host = SystemHost()
    before = read_host(host).rss_bytes or 0
    kept = _touched(256 * MiB)
    during = read_host(host).rss_bytes or 0
    del kept
    gc.collect()
    after = read_host(host).rss_bytes or 0
    assert during - before >= 240 * MiB
    assert during - after >= 240 * MiB


def test_real_cpu_sample_runs_the_procedure() -> None:
    s = take_sample(open_probes(MemoryDomain.CPU, world_size=1),
                    ProcedureSettings(empty_cache=True, settle_seconds=0.0))
    assert s.scope.domain is MemoryDomain.CPU and s.scope.pid == os.getpid()
    assert s.scope.read_window_seconds < 0.5
    assert s.host.rss_bytes and s.host.rss_bytes > 0
    assert s.allocator.allocated_bytes is None
    assert s.device is not None and s.device.used_bytes is None


def test_real_attribution_names_a_live_owner_in_process_memory() -> None:
    att = Attributor(AttributionSettings(warmup_checkpoints=0, min_delta_bytes=64 * MiB),
                     open_probes(MemoryDomain.CPU), kv=KvPoolSize(64, 16384))
    base = att.checkpoint(1, None).attribution
    assert base.status is AttributionStatus.BASELINE
    owner = [_touched(64 * MiB) for _ in range(4)]  # a list that keeps "outputs"
    grown = att.checkpoint(2, None).attribution
    found = {f.boundary: f for f in grown.findings}
    assert set(found) == {Boundary.PROCESS_MEMORY}, grown.summary
    assert 240 * MiB <= found[Boundary.PROCESS_MEMORY].delta_bytes < 400 * MiB
    owner.clear()
    gc.collect()
    released = att.checkpoint(3, None).attribution
    assert released.findings == [], released.summary


def test_real_child_process_memory_is_read_for_worker_engines() -> None:
    """An ``mp`` engine's model runs in a child process: its RSS is read from procfs."""
    code = ("import sys, numpy; b = numpy.ones(128 << 20, dtype='uint8'); print('ready', "
            "flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        host = SystemHost()
        assert child.pid in host.child_pids()
        h = read_host(host, include_children=True)
        assert h.child_processes is not None and h.child_processes >= 1
        assert h.child_processes_rss_bytes is not None
        assert h.child_processes_rss_bytes >= 128 * MiB
    finally:
        child.communicate(timeout=30)  # closes stdin: the child exits
