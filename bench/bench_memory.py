"""Target 4: in-engine bytes per live (request, block) ownership, and flatness over a run.

tracemalloc over the ledger holding 2,000 requests x 16 blocks fed through the hooks'
calls; then 50,000 requests with 64 live at a time, checking that the ledger's size stays
flat.
"""

from __future__ import annotations

import gc
import tracemalloc

from harness import save

from kvguard.core.ledger import OwnershipLedger
from kvguard.core.types import AcquireKind, FinishReason, RequestId

REQUESTS, BLOCKS = 2000, 16


def live_bytes_per_ownership() -> float:
    # Request ids and block-id ints belong to the engine (vLLM's Request and
    # KVCacheBlock objects hold them); kvguard keeps references, so create them first.
    ids = [RequestId(f"cmpl-{i:016x}-0-{i:08x}") for i in range(REQUESTS)]
    tables = [list(range(1 + i * BLOCKS, 1 + (i + 1) * BLOCKS)) for i in range(REQUESTS)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    ledger = OwnershipLedger()
    for i, rid in enumerate(ids):
        blocks = tables[i]
        ledger.on_request_admitted(rid, 0.0)
        ledger.on_blocks_acquired(None, blocks, AcquireKind.ALLOCATE)
        ledger.claim(rid, blocks)
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert ledger.num_ownerships == REQUESTS * BLOCKS
    return grown / (REQUESTS * BLOCKS)


def flat_over_a_long_run() -> dict[str, int]:
    ledger = OwnershipLedger()
    sizes = {}
    live: list[RequestId] = []
    for i in range(50_000):
        rid = RequestId(f"r{i}-{i:08x}")
        blocks = [1 + (i % 1000) * 4 + k for k in range(4)]
        ledger.on_request_admitted(rid, float(i))
        ledger.on_blocks_acquired(rid, blocks, AcquireKind.ALLOCATE)
        live.append(rid)
        if len(live) > 64:
            old = live.pop(0)
            rec = ledger.record(old)
            assert rec is not None
            ledger.on_request_finished(old, FinishReason.STOPPED, float(i))
            ledger.on_blocks_released(old, list(rec.blocks))
            ledger.on_request_freed(old, float(i))
        if i in (1_000, 49_999):
            sizes[f"records_at_{i + 1}"] = ledger.num_records
            sizes[f"ownerships_at_{i + 1}"] = ledger.num_ownerships
    return sizes


if __name__ == "__main__":
    per = live_bytes_per_ownership()
    flat = flat_over_a_long_run()
    print(f"{per:.0f} bytes per live (request, block) ownership; long run: {flat}")
    save("memory", {"bytes_per_ownership": per, "long_run": flat, "target_bytes": 100})
