"""Which boundary moved between the baseline and this checkpoint (pure logic).

Device memory is split into parts that never overlap, so no byte is named
twice and allocated and reserved are never added:

    device used = allocated                                  (tensor)
                + inactive split                             (fragmentation)
                + (reserved - allocated - inactive split)    (allocator cache)
                + (used - reserved)                          (outside framework)

Each part's growth since the baseline is one finding when it reaches
``min_delta_bytes``. Beside them: KV blocks held at a drained checkpoint
(``kv_pool``: needs no baseline, the ledger's verdict is absolute), process
RSS (``process_memory``: what a CPU engine has instead of tensor counters),
host swap (``host_swap``: the host does not fit, whatever the footprint
says) and OOMs with flat drained usage (``transient_peak``). The next step
of each is the mapping of design.md section 3.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvguard.attribution.kv_pool import KvPoolSize
from kvguard.attribution.procedure import MemorySample
from kvguard.attribution.wording import NEXT_STEP, fmt_bytes, fmt_delta
from kvguard.core.report import (
    AllocatorReport,
    AttributionFinding,
    Boundary,
    FindingStrength,
    HostReport,
    MemoryDomain,
    NonTorchScope,
    PoolReport,
)

DEFAULT_MIN_DELTA_BYTES = 32 << 20
"""Growth below this (bytes) is noise, not movement: allocator rounding, interpreter heap."""


@dataclass(frozen=True, slots=True)
class Context:
    """What the findings of one checkpoint are judged with."""

    baseline_id: int
    min_delta_bytes: int = DEFAULT_MIN_DELTA_BYTES
    kv: KvPoolSize | None = None


def _delta(before: int | None, after: int | None) -> int | None:
    return None if before is None or after is None else after - before


def _cache_bytes(a: AllocatorReport) -> int | None:
    """reserved - allocated - inactive split: whole free cache, reclaimable by empty_cache."""
    cache = a.reserved_unallocated_bytes
    if cache is None:
        return None
    return cache - (a.inactive_split_bytes or 0)


def kv_pool_finding(pool: PoolReport | None, kv: KvPoolSize | None,
                    allocated_delta: int | None = None) -> AttributionFinding | None:
    """Blocks held at a drained checkpoint, in bytes. Needs no baseline."""
    if pool is None:
        return None
    leaked = pool.held_by_finished + pool.orphaned
    if leaked == 0:
        return None
    per_block = kv.bytes_per_block if kv is not None else None
    size = (f"{fmt_bytes(leaked * per_block)} of a {fmt_bytes(kv.total_bytes)} pool"
            if kv is not None and per_block is not None else "bytes per block unknown")
    tensors = ("tensor counters did not move (allocated " + fmt_delta(allocated_delta) + ")"
               if allocated_delta is not None else "tensor counters cannot show it")
    return AttributionFinding(
        boundary=Boundary.KV_POOL, strength=FindingStrength.ATTRIBUTION,
        delta_bytes=leaked * per_block if per_block is not None else 0,
        current_bytes=leaked * per_block if per_block is not None else None,
        evidence=(f"{leaked} KV blocks held at a drained checkpoint ({pool.held_by_finished} "
                  f"by finished requests, {pool.orphaned} orphaned; {size}). The pool tensor "
                  f"stays allocated whatever its blocks hold, so {tensors}: only the ledger "
                  "sees this leak."),
        next_step=NEXT_STEP[Boundary.KV_POOL])


def attribute(base: MemorySample, cur: MemorySample, pool: PoolReport | None,
              ctx: Context) -> list[AttributionFinding]:
    """Findings of ``cur`` against ``base`` (same engine process), most specific first."""
    out: list[AttributionFinding] = []
    a0, a1 = base.allocator, cur.allocator
    d_alloc = _delta(a0.allocated_bytes, a1.allocated_bytes)
    kv = kv_pool_finding(pool, ctx.kv, d_alloc)
    if kv is not None:
        out.append(kv)
    since = f"since baseline checkpoint #{ctx.baseline_id}"
    big = ctx.min_delta_bytes

    def grew(d: int | None) -> bool:
        return d is not None and d >= big and d > 0

    if grew(d_alloc):
        out.append(AttributionFinding(
            boundary=Boundary.TENSOR, strength=FindingStrength.ATTRIBUTION,
            delta_bytes=d_alloc or 0, baseline_bytes=a0.allocated_bytes,
            current_bytes=a1.allocated_bytes,
            evidence=(f"torch allocated grew {fmt_delta(d_alloc)} {since} "
                      f"({fmt_bytes(a0.allocated_bytes)} -> {fmt_bytes(a1.allocated_bytes)}) "
                      "with no request in flight. The KV pool is "
                      + (f"one fixed {fmt_bytes(ctx.kv.total_bytes)} allocation"
                         if ctx.kv else "a fixed allocation")
                      + " made at start, so these are live tensors owned elsewhere."),
            next_step=NEXT_STEP[Boundary.TENSOR]))

    d_frag = _delta(a0.inactive_split_bytes, a1.inactive_split_bytes)
    d_ooms = _delta(a0.num_ooms, a1.num_ooms)
    # Every OOM is preceded by one last retry (cache flushed, cudaMalloc tried again);
    # only retries that ended in success say the cache was in the way.
    d_retries = _delta(a0.num_alloc_retries, a1.num_alloc_retries)
    if d_retries is not None and d_ooms is not None:
        d_retries -= d_ooms
    if grew(d_frag) or (d_retries is not None and d_retries > 0):
        retries = (f"; allocation retries +{d_retries} (the allocator freed cache and "
                   "retried a cudaMalloc)" if d_retries else "")
        out.append(AttributionFinding(
            boundary=Boundary.FRAGMENTATION, strength=FindingStrength.ATTRIBUTION,
            delta_bytes=d_frag or 0, baseline_bytes=a0.inactive_split_bytes,
            current_bytes=a1.inactive_split_bytes,
            evidence=(f"inactive split bytes {fmt_delta(d_frag)} {since} "
                      f"({fmt_bytes(a0.inactive_split_bytes)} -> "
                      f"{fmt_bytes(a1.inactive_split_bytes)}): free pieces of segments that "
                      f"still hold live blocks, which empty_cache cannot return{retries}."),
            next_step=NEXT_STEP[Boundary.FRAGMENTATION]))

    c0, c1 = _cache_bytes(a0), _cache_bytes(a1)
    d_cache = _delta(c0, c1)
    if grew(d_cache):
        peak = ""
        if (a1.peak_allocated_bytes or 0) > (a0.peak_allocated_bytes or 0):
            peak = (f" The allocation peak rose {fmt_bytes(a0.peak_allocated_bytes)} -> "
                    f"{fmt_bytes(a1.peak_allocated_bytes)}: the cache holds what that peak "
                    "needed.")
        out.append(AttributionFinding(
            boundary=Boundary.ALLOCATOR_CACHE, strength=FindingStrength.NOT_A_LEAK,
            delta_bytes=d_cache or 0, baseline_bytes=c0, current_bytes=c1,
            evidence=(f"reserved - allocated (outside split segments) grew "
                      f"{fmt_delta(d_cache)} {since} ({fmt_bytes(c0)} -> {fmt_bytes(c1)}) "
                      "while allocated did " + ("not grow" if not grew(d_alloc) else
                                                "too") + ": cached, reusable pages." + peak),
            next_step=NEXT_STEP[Boundary.ALLOCATOR_CACHE]))

    if d_ooms is not None and d_ooms > 0 and not grew(d_alloc):
        d_peak = _delta(a0.peak_allocated_bytes, a1.peak_allocated_bytes)
        out.append(AttributionFinding(
            boundary=Boundary.TRANSIENT_PEAK, strength=FindingStrength.ATTRIBUTION,
            delta_bytes=max(0, d_peak or 0), baseline_bytes=a0.peak_allocated_bytes,
            current_bytes=a1.peak_allocated_bytes,
            evidence=(f"{d_ooms} out-of-memory error(s) {since} while drained usage stayed "
                      f"flat (allocated {fmt_delta(d_alloc)}; peak "
                      f"{fmt_bytes(a1.peak_allocated_bytes)}): a transient peak, not a "
                      "holder."),
            next_step=NEXT_STEP[Boundary.TRANSIENT_PEAK]))

    out.extend(_outside_framework(base, cur, since, big))
    out.extend(_host(base, cur, pool, ctx, since))
    return out


def _process_memory(h0: HostReport, h1: HostReport) -> tuple[int | None, int | None, str]:
    """RSS of the engine: this process, plus its worker processes when both samples read
    them (the model and KV pool of an ``mp`` engine live there)."""
    c0, c1 = h0.child_processes_rss_bytes, h1.child_processes_rss_bytes
    if c0 is None or c1 is None or h0.rss_bytes is None or h1.rss_bytes is None:
        return h0.rss_bytes, h1.rss_bytes, "process RSS"
    return (h0.rss_bytes + c0, h1.rss_bytes + c1,
            f"RSS of this process and its {h1.child_processes} worker process(es)")


def _outside_framework(base: MemorySample, cur: MemorySample, since: str,
                       big: int) -> list[AttributionFinding]:
    d0, d1 = base.device, cur.device
    if d0 is None or d1 is None or d0.non_torch_scope != d1.non_torch_scope:
        return []
    d = _delta(d0.non_torch_bytes, d1.non_torch_bytes)
    if d is None or d < big or d <= 0:
        return []
    scope = ("this process's NVML usage" if d1.non_torch_scope is NonTorchScope.PROCESS
             else "the whole device's used memory (other processes included)")
    return [AttributionFinding(
        boundary=Boundary.OUTSIDE_FRAMEWORK, strength=FindingStrength.LEAD,
        delta_bytes=d, baseline_bytes=d0.non_torch_bytes, current_bytes=d1.non_torch_bytes,
        evidence=(f"{scope} minus torch reserved grew {fmt_delta(d)} {since} "
                  f"({fmt_bytes(d0.non_torch_bytes)} -> {fmt_bytes(d1.non_torch_bytes)}): "
                  "memory PyTorch's allocator does not manage."),
        next_step=NEXT_STEP[Boundary.OUTSIDE_FRAMEWORK])]


def _host(base: MemorySample, cur: MemorySample, pool: PoolReport | None, ctx: Context,
          since: str) -> list[AttributionFinding]:
    out: list[AttributionFinding] = []
    h0, h1 = base.host, cur.host
    big = ctx.min_delta_bytes
    d_rss = _delta(h0.rss_bytes, h1.rss_bytes)
    p0, p1, what = _process_memory(h0, h1)
    d_proc = _delta(p0, p1)
    if d_proc is not None and d_proc >= big and d_proc > 0:
        kv = (f"the KV pool is a fixed {fmt_bytes(ctx.kv.total_bytes)} "
              f"({ctx.kv.num_blocks} blocks x {fmt_bytes(ctx.kv.bytes_per_block)})"
              if ctx.kv else "the KV pool is a fixed allocation")
        clean = (" and every block is accounted for" if pool is not None
                 and pool.held_by_finished + pool.orphaned == 0 else "")
        where = ("this CPU engine's tensors live in that memory, " + kv + clean
                 + ", so the growth is not the KV pool: a live owner in the process "
                 "(or freed heap the C allocator kept)"
                 if cur.scope.domain is MemoryDomain.CPU else
                 "host-side memory of the engine (pinned buffers, Python objects), "
                 "not device memory")
        out.append(AttributionFinding(
            boundary=Boundary.PROCESS_MEMORY, strength=FindingStrength.ATTRIBUTION,
            delta_bytes=d_proc, baseline_bytes=p0, current_bytes=p1,
            evidence=(f"{what} grew {fmt_delta(d_proc)} {since} "
                      f"({fmt_bytes(p0)} -> {fmt_bytes(p1)}); {where}."),
            next_step=NEXT_STEP[Boundary.PROCESS_MEMORY]))
    d_swap = _delta(h0.swap_used_bytes, h1.swap_used_bytes)
    if d_swap is not None and d_swap >= big and d_swap > 0:
        footprint = (f"process RSS {fmt_delta(d_rss)} meanwhile" if d_rss is not None
                     else "process footprint unknown")
        avail = (f", MemAvailable {fmt_bytes(h1.mem_available_bytes)}"
                 if h1.mem_available_bytes is not None else "")
        out.append(AttributionFinding(
            boundary=Boundary.HOST_SWAP, strength=FindingStrength.ATTRIBUTION,
            delta_bytes=d_swap, baseline_bytes=h0.swap_used_bytes,
            current_bytes=h1.swap_used_bytes,
            evidence=(f"host swap used grew {fmt_delta(d_swap)} {since} "
                      f"({fmt_bytes(h0.swap_used_bytes)} -> {fmt_bytes(h1.swap_used_bytes)}"
                      f"{avail}); {footprint}. The footprint can stay flat or drop while "
                      "pages go to swap (unified memory): swap growth is the honest signal."),
            next_step=NEXT_STEP[Boundary.HOST_SWAP]))
    return out
