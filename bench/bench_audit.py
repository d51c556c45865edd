"""Target 2: a full audit of the real vLLM BlockPool vs the bare loop over every ref_cnt.

vLLM's own ``BlockPool`` (no model) in a drained mix (cached and free blocks) and a busy
one (40 % owned by live requests); a full audit is timed against the bare loop over every
``ref_cnt``. Rows 9 time one online-audit sweep, from which the sweep length at the 0.5 %
budget follows.

The pool is built through ``KVCacheManager`` from a ``KVCacheConfig``, as vLLM's tests do.
Drained: 55 % cached, 45 % free, a few leaked blocks; busy: 40 % active, 35 % cached, 25 %
free. Audit = ``read_pool`` + ``reconcile``.
"""

from __future__ import annotations

import gc
import time

from harness import save, stats

from kvguard.core.ledger import OwnershipLedger
from kvguard.core.reconciler import ReconcileOptions, reconcile
from kvguard.core.types import AcquireKind, FinishReason, RequestId
from kvguard.vllm_plugin.pool_reader import read_pool

BLOCKS_PER_REQUEST = 8


def build_pool(num_blocks: int, active: float, cached: float):  # type: ignore[no-untyped-def]
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float16)
    cfg = KVCacheConfig(num_blocks=num_blocks + 1, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    mgr = KVCacheManager(cfg, max_model_len=1 << 20, scheduler_block_size=16,
                         hash_block_size=16, enable_caching=True)
    pool = mgr.block_pool
    ledger = OwnershipLedger(null_block_ids=(0,))
    n_cached = int(num_blocks * cached)
    n_active = int(num_blocks * active)
    # Cached: allocate, give a prefix hash, free (ref 0, evictable).
    blocks = pool.get_new_blocks(n_cached)
    for i, b in enumerate(blocks):
        key = make_block_hash_with_group_id(BlockHash(i.to_bytes(8, "little")), 0)
        pool._insert_block_hash(key, b, None)
    pool.free_blocks(blocks)
    # Active: live requests own them in the ledger.
    blocks = pool.get_new_blocks(n_active)
    for r in range(0, n_active, BLOCKS_PER_REQUEST):
        rid = RequestId(f"r{r}-0000abcd")
        ledger.on_request_admitted(rid, 0.0)
        ledger.on_blocks_acquired(rid, [b.block_id for b in blocks[r:r + BLOCKS_PER_REQUEST]],
                                  AcquireKind.ALLOCATE)
    # A leak: a finished request that still holds 3 blocks.
    leak = pool.get_new_blocks(3)
    rid = RequestId("leaky-0000abcd")
    ledger.on_request_admitted(rid, 0.0)
    ledger.on_blocks_acquired(rid, [b.block_id for b in leak], AcquireKind.ALLOCATE)
    ledger.on_request_finished(rid, FinishReason.ABORTED, 1.0)
    ledger.on_request_freed(rid, 1.0)
    return pool, ledger


def measure(num_blocks: int, mix: str, repeats: int) -> dict[str, object]:
    active, cached = (0.0, 0.55) if mix == "drained" else (0.40, 0.35)
    pool, ledger = build_pool(num_blocks, active, cached)
    opts = ReconcileOptions(now=10.0)
    bare, audit = [], []
    gc.collect()
    for _ in range(repeats):
        t0 = time.perf_counter()
        refs = [b.ref_cnt for b in pool.blocks]
        t1 = time.perf_counter()
        rec = reconcile(read_pool(pool), ledger, opts)
        t2 = time.perf_counter()
        bare.append((t1 - t0) * 1e3)
        audit.append((t2 - t1) * 1e3)
        del refs
    assert rec.states.total == num_blocks
    assert sum(f.blocks for f in rec.findings) == 3, rec.findings
    b, a = stats(bare), stats(audit)
    return {"blocks": num_blocks, "mix": mix, "bare_ms": b, "audit_ms": a,
            "ratio": a["median"] / b["median"]}


def measure_online(num_blocks: int, sweeps: int = 4) -> dict[str, object]:
    """One online sweep of the busy mix (claim phase + every slice), done in one go, timed.

    From the work per sweep ``W`` follow the steps per sweep at a budget ``b`` and a
    scheduler time ``T`` per step: ``K = W / (b T)``; detection takes at most ``3 K``.
    """
    from kvguard.core.online import OnlineAuditor, OnlineOptions
    from kvguard.vllm_plugin.pool_reader import VllmPoolAccess

    pool, ledger = build_pool(num_blocks, 0.40, 0.35)
    tables: dict[str, list[int]] = {}
    for rec in ledger.records():
        if rec.phase.is_live:
            tables[rec.request_id] = sorted(rec.blocks)

    class Access(VllmPoolAccess):
        """The real pool; request tables from the bench (no scheduler here)."""

        def request_ids(self) -> list[str]:
            return list(tables)

        def request_blocks(self, request_id: str) -> list[int]:
            return tables[request_id]

    class Kvm:
        block_pool = pool

    auditor = OnlineAuditor(Access(Kvm()), ledger,
                            OnlineOptions(budget_fraction=1.0, max_pause_seconds=60.0))
    work = []
    found = 0
    gc.collect()
    for _ in range(sweeps):
        t0 = time.perf_counter()
        result = None
        while result is None:
            result = auditor.step(60.0, 10.0)
        work.append((time.perf_counter() - t0) * 1e3)
        found = sum(f.blocks for f in result.findings)
    assert found == 3, found  # the leak, confirmed from the second sweep on
    w = stats(work)
    budget = OnlineOptions().budget_fraction
    k = {f"{t_ms:g}": w["median"] / (budget * t_ms) for t_ms in (0.5, 2.0, 10.0)}
    return {"blocks": num_blocks, "requests": len(tables), "sweep_work_ms": w,
            "budget_fraction": budget, "steps_per_sweep_at_scheduler_ms": k}


if __name__ == "__main__":
    rows = []
    for n, reps in ((100_000, 15), (1_000_000, 5)):
        for mix in ("drained", "busy"):
            rows.append(measure(n, mix, reps))
            print(rows[-1])
    online = [measure_online(100_000), measure_online(1_000_000, sweeps=3)]
    for row in online:
        print(row)
    save("audit", {"rows": rows, "online": online,
                   "targets": {"100000": 20.0, "1000000": 200.0, "ratio_drained": 3.0,
                               "ratio_busy": 5.0}})
