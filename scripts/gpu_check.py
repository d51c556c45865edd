#!/usr/bin/env python3
"""kvguard memory attribution on a real CUDA device: each boundary, provoked and named.

Builds a KV-like pool tensor, takes a baseline checkpoint, then provokes one
boundary at a time with the real probes (torch.cuda, NVML when ``pynvml`` is
installed, else ``mem_get_info``) and asserts the attribution names it, and
nothing it should not:

1. live tensor owner    512 MiB of tensors kept in a list        -> tensor (+ a snapshot file)
2. allocator cache      those freed, plus 1 GiB allocated+freed   -> allocator_cache
3. cache returned       a checkpoint with empty_cache + settle    -> nothing
4. KV pool leak         100 blocks held, tensor counters flat     -> kv_pool
5. fragmentation        3 MiB tensors, every other one freed      -> fragmentation (+ tensor)
6. outside framework    512 MiB through cuMemAlloc (driver API)   -> outside_framework (lead)
7. transient peak       one allocation larger than the device     -> transient_peak

Run: ``.venv/bin/python scripts/gpu_check.py`` (exit 0: every check passed;
1: a check failed; 2: no CUDA device here, nothing was checked).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from kvguard.attribution import (
    AttributionSettings,
    Attributor,
    KvPoolSize,
    ProcedureSettings,
    open_probes,
)
from kvguard.attribution.backends import TorchMemoryHistory
from kvguard.attribution.snapshot import Snapshotter
from kvguard.attribution.wording import fmt_bytes, fmt_delta
from kvguard.core.report import (
    AttributionReport,
    AttributionStatus,
    Boundary,
    FindingStrength,
    MemoryDomain,
    PoolReport,
)

MiB = 1 << 20
GiB = 1 << 30
BLOCK_BYTES = 256 * 1024
NUM_BLOCKS = 4096  # a 1 GiB KV-like pool
HOST_SIDE = frozenset({Boundary.PROCESS_MEMORY})
"""Host RSS may move with CUDA initialization and history recording; it is printed, not
judged: this script checks the device boundaries."""


def _pool(held: int = 0) -> PoolReport:
    usable = NUM_BLOCKS - 1
    return PoolReport(capacity=usable, free=usable - held, cached=0, active=0,
                      held_by_finished=held, orphaned=0, num_free_reported=usable - held)


class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def expect(self, title: str, a: AttributionReport, want: set[Boundary], *,
               allow: frozenset[Boundary] = frozenset(),
               sizes: dict[Boundary, tuple[int, int]] | None = None) -> None:
        got = {f.boundary: f for f in a.findings}
        allow = allow | HOST_SIDE
        problems = []
        if not want <= set(got):
            problems.append(f"missing {sorted(b.value for b in want - set(got))}")
        extra = set(got) - want - allow
        if extra:
            problems.append(f"misnamed {sorted(b.value for b in extra)}")
        for b, (lo, hi) in (sizes or {}).items():
            if b in got and not lo <= got[b].delta_bytes <= hi:
                problems.append(f"{b.value} {fmt_bytes(got[b].delta_bytes)} not in "
                                f"[{fmt_bytes(lo)}, {fmt_bytes(hi)}]")
        status = "FAIL" if problems else "ok  "
        named = ", ".join(f"{b.value} {fmt_delta(f.delta_bytes)} ({f.strength.value})"
                          for b, f in got.items()) or "nothing moved"
        print(f"{status} {title:<22} -> {named}" + (f"   [{'; '.join(problems)}]"
                                                     if problems else ""))
        if problems:
            self.failed.append(title)
            print("     " + a.summary.replace("\n", "\n     "))

    def require(self, title: str, ok: bool, detail: str) -> None:
        print(f"{'ok  ' if ok else 'FAIL'} {title:<22} -> {detail}")
        if not ok:
            self.failed.append(title)


def _cu_mem_alloc(n_bytes: int) -> tuple[Any, int] | None:
    """Allocate outside PyTorch with the CUDA driver API (torch's context is current)."""
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            cuda = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:
        return None
    ptr = ctypes.c_uint64()
    if cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(n_bytes)) != 0:
        return None
    return cuda, ptr.value


def main() -> int:
    try:
        import torch
    except ImportError:
        print("gpu_check: torch is not installed in this environment; nothing to check.")
        return 2
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, built for CUDA "
              f"{torch.version.cuda or 'none'}); nothing was checked. Run it on a machine "
              "with an NVIDIA GPU and a CUDA build of torch.")
        return 2
    torch.cuda.init()  # type: ignore[no-untyped-call]
    dev = torch.device("cuda")
    checks = Checks()
    snap_dir = Path(tempfile.mkdtemp(prefix="kvguard-gpu-check-"))
    kv = KvPoolSize(NUM_BLOCKS, BLOCK_BYTES)
    pool_tensor = torch.zeros(kv.total_bytes, dtype=torch.uint8, device=dev)  # noqa: F841
    probes = open_probes(MemoryDomain.CUDA, world_size=1)
    att = Attributor(AttributionSettings(warmup_checkpoints=0, min_delta_bytes=64 * MiB,
                                         procedure=ProcedureSettings()),
                     probes, kv=kv,
                     snapshots=Snapshotter(snap_dir, TorchMemoryHistory(), name="gpu_check"))
    n = 0

    def checkpoint(held: int = 0) -> tuple[AttributionReport, Any]:
        nonlocal n
        n += 1
        res = att.checkpoint(n, _pool(held))
        return res.attribution, res

    base, res = checkpoint()
    scope = base.scope
    print(f"device {torch.cuda.get_device_name(dev)}; torch {torch.__version__}, CUDA "
          f"{torch.version.cuda}; allocator {res.allocator.backend if res.allocator else '?'}; "
          f"driver {scope.driver_version if scope else '?'}; NVML sees this pid: "
          f"{scope.nvml_sees_process if scope else '?'}; device source "
          f"{res.device.source if res.device else '?'}")
    for section in (res.allocator, res.device, res.host):
        if section is not None and section.unavailable:
            print(f"     unavailable: {'; '.join(section.unavailable)}")
    checks.require("baseline", base.status is AttributionStatus.BASELINE and not base.findings,
                   f"checkpoint #{n}, pool {fmt_bytes(kv.total_bytes)}, allocated "
                   f"{fmt_bytes(res.allocator.allocated_bytes if res.allocator else None)}")

    # 1. a live-tensor owner: tensors kept in a list
    leak = [torch.ones(64 * MiB // 4, device=dev) for _ in range(8)]
    a, _ = checkpoint()
    checks.expect("live tensor owner", a, {Boundary.TENSOR},
                  sizes={Boundary.TENSOR: (500 * MiB, 530 * MiB)})
    checks.require("memory snapshot", bool(a.snapshot_path and Path(a.snapshot_path).is_file()),
                   f"{a.snapshot_path} ({a.snapshot_note})")

    # 2. allocator cache: the owner lets go, and a temporary 1 GiB comes and goes
    del leak
    tmp = torch.empty(1 * GiB, dtype=torch.uint8, device=dev)
    del tmp
    a, _ = checkpoint()
    checks.expect("allocator cache", a, {Boundary.ALLOCATOR_CACHE},
                  sizes={Boundary.ALLOCATOR_CACHE: (1 * GiB, 1 * GiB + 600 * MiB)})
    if any(f.boundary is Boundary.ALLOCATOR_CACHE and f.strength is not
           FindingStrength.NOT_A_LEAK for f in a.findings):
        checks.require("cache is not a leak", False, "allocator cache not marked not_a_leak")

    # 3. a declared checkpoint that returns the cache (and settles) brings it back to baseline
    att.settings = replace(att.settings, procedure=ProcedureSettings(empty_cache=True))
    a, _ = checkpoint()
    att.settings = replace(att.settings, procedure=ProcedureSettings())
    checks.expect("cache returned", a, set())
    checks.require("settled after return", bool(a.scope and a.scope.cache_returned
                                                and a.scope.settled_seconds > 0),
                   f"cache_returned={a.scope.cache_returned if a.scope else None}, "
                   f"settled {a.scope.settled_seconds if a.scope else None} s")

    # 4. a KV block leak: the ledger's blocks, tensor counters flat
    a, _ = checkpoint(held=100)
    checks.expect("KV pool leak", a, {Boundary.KV_POOL},
                  sizes={Boundary.KV_POOL: (100 * BLOCK_BYTES, 100 * BLOCK_BYTES)})

    # 5. fragmentation: 3 MiB tensors share 20 MiB segments; freeing every other one leaves
    #    free splits inside segments that still hold live blocks
    pieces = [torch.empty(3 * MiB, dtype=torch.uint8, device=dev) for _ in range(120)]
    kept = pieces[::2]
    del pieces
    a, _ = checkpoint()
    checks.expect("fragmentation", a, {Boundary.FRAGMENTATION, Boundary.TENSOR},
                  allow=frozenset({Boundary.ALLOCATOR_CACHE}),
                  sizes={Boundary.FRAGMENTATION: (128 * MiB, 400 * MiB)})
    del kept
    gc.collect()
    torch.cuda.empty_cache()

    # 6. memory outside the framework: the driver API, invisible to torch's allocator
    got = _cu_mem_alloc(512 * MiB)
    if got is None:
        checks.require("outside framework", False, "could not cuMemAlloc through libcuda")
    else:
        a, _ = checkpoint()
        checks.expect("outside framework", a, {Boundary.OUTSIDE_FRAMEWORK},
                      sizes={Boundary.OUTSIDE_FRAMEWORK: (500 * MiB, 560 * MiB)})
        if any(f.boundary is Boundary.OUTSIDE_FRAMEWORK and f.strength is not
               FindingStrength.LEAD for f in a.findings):
            checks.require("outside is a lead", False, "not marked as a lead")
        lib, ptr = got
        lib.cuMemFree_v2(ctypes.c_uint64(ptr))

    # 7. a transient peak: one request larger than the device fails, nothing stays held
    _, total = torch.cuda.mem_get_info()
    with contextlib.suppress(torch.cuda.OutOfMemoryError):
        torch.empty(total + 1 * GiB, dtype=torch.uint8, device=dev)
    a, _ = checkpoint()
    checks.expect("transient peak", a, {Boundary.TRANSIENT_PEAK})

    print()
    print(a.summary)
    if checks.failed:
        print(f"\ngpu_check: FAILED: {', '.join(checks.failed)}")
        return 1
    print(f"\ngpu_check: all attribution checks passed on {torch.cuda.get_device_name(dev)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
