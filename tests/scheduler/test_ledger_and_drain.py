"""kvguard's ledger and drained checkpoint against vLLM's own pool, on a healthy workload.

Ground truth is vLLM's: ``req_to_blocks``, every block's ``ref_cnt``, the free queue and
``get_num_free_blocks()``. The workload takes vLLM's real paths: prefix-cache hits,
finish by length and by stop token, aborts mid-prefill and mid-decode, preemptions.
"""

from __future__ import annotations

from collections.abc import Callable

from _sched import MixedLoad, Sched, ledger_disagreement, pool_is_idle

from kvguard.chaos.truth import disagreement
from kvguard.core.types import Verdict

STEPS = 600


def test_ledger_ownership_is_vllms_block_tables_at_every_step(
        sched: Callable[..., Sched]) -> None:
    s = sched(num_blocks=32, max_num_seqs=4, env={"KVGUARD_ONLINE_AUDIT": "0"})
    load = MixedLoad(s, seed=1, concurrency=6)
    for _ in range(STEPS):
        load.step()
        why = ledger_disagreement(s)
        assert not why, f"step {s.steps}: " + "; ".join(why[:5])
    load.finish()
    assert not ledger_disagreement(s)
    print(f"[ledger] {s.steps} steps, {load.added} requests, {load.aborted} aborted, "
          f"{s.preemptions} preemptions, {s.prefix_cache_hits} prefix-hit tokens")
    assert s.preemptions > 0 and load.aborted > 0, "the workload missed a path"
    assert s.prefix_cache_hits > 0, "vLLM counted no prefix-cache hit"
    assert {s.status(r) for r in s.requests} == {
        "FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED", "FINISHED_ABORTED"}


def test_drained_checkpoint_is_clean_and_agrees_with_vllms_pool(
        sched: Callable[..., Sched]) -> None:
    s = sched(num_blocks=32, max_num_seqs=4)
    load = MixedLoad(s, seed=2, concurrency=6)
    for _ in range(STEPS):
        load.step()
    load.finish()
    truth = s.pool_truth()
    assert pool_is_idle(truth, s.pool) == []
    report = s.drained_checkpoint()
    # No leak: clean, or saturated when vLLM's own cached blocks pass the 0.8 ratio.
    cached = sum(1 for b in s.pool.blocks if not b.is_null and b.block_hash is not None)
    want = Verdict.SATURATED if cached >= 0.8 * truth.capacity else Verdict.CLEAN
    assert report.verdict is want, report.explanation
    assert report.pool is not None and report.pool.cached == cached
    assert report.leaks == [] and report.leaked_blocks == 0
    assert disagreement(report, truth) == ""  # free + cached == vLLM's free count, usage
    assert report.pool is not None and report.pool.total == truth.capacity
    assert s.preemptions > 0 and load.aborted > 0
