"""Hybrid KV cache groups on real engines: sliding-window frees are charged to their request.

A model with sliding-window layers frees the blocks that slid out of a request's window
while the request runs (vLLM's ``coordinator.remove_skipped_blocks``, inside
``allocate_slots`` and at finish), and puts the null block in its table. No lifecycle
call runs then, so unless kvguard names the request, the ledger has to guess which
owner gave the reference back; when two live requests share the block through the
prefix cache the guess can take it off the wrong one: a false ``refcount_drift`` while
both run and a false ``double_free`` at the drained checkpoint.

Workloads (each over more than 1,000 engine steps in all): a shared prefix whose blocks
one request's window passes while another still holds them, chunked prefill of prompts
longer than the window, preemption (a small pool), aborts, and prefix-cache hits, on a
two-group model (sliding + full attention) and on an all-sliding one. Ground truth is
vLLM's own pool after each drain (ref counts, tables, free count), and vLLM's own
prefix-cache hit counter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvguard.chaos.faults import SCHEDULER_CLS
from kvguard.chaos.harness import EngineHarness, prompt
from kvguard.chaos.result import Status
from kvguard.chaos.runner import build_for, fault_victims, scenarios_for, score, scored_report
from kvguard.core.types import Verdict
from kvguard.testing.engine import EngineSpec
from kvguard.testing.tiny_model import SLIDING_WINDOW_TOKENS, make_hybrid_model, make_sliding_model

BLOCK = 32
assert SLIDING_WINDOW_TOKENS == 2 * BLOCK, "the workloads below are sized for a 2-block window"
MIN_STEPS = 1000
"""Each model runs at least this many engine steps over all its workloads."""


@pytest.fixture(scope="module")
def hybrid_engines(tmp_path_factory: pytest.TempPathFactory,
                   run_dir: Path) -> Iterator[Callable[[str], EngineHarness]]:
    """``make("hybrid")`` / ``make("sliding")``: a real engine on that model, with a pool
    small enough to preempt, chunked prefill and the online audit given 20 % of scheduler
    time (the workload is short)."""
    root = tmp_path_factory.mktemp("hybrid-models")
    models = {"hybrid": make_hybrid_model(root), "sliding": make_sliding_model(root)}
    built: list[EngineHarness] = []

    def make(kind: str) -> EngineHarness:
        h = EngineHarness(EngineSpec(model_dir=models[kind], num_gpu_blocks_override=40,
                                     max_model_len=1024, max_num_seqs=16,
                                     max_num_batched_tokens=64,
                                     # vLLM's own scheduler plus a record of what it did
                                     # (finish statuses, preemptions); no fault armed
                                     extra={"scheduler_cls": SCHEDULER_CLS}))
        h.guard.config = dataclasses.replace(h.guard.config, online_budget_fraction=0.2)
        built.append(h)
        return h

    yield make
    for h in built:
        h.guard.close()


def _groups(h: EngineHarness) -> list[str]:
    return [type(m).__name__ for m in h.scheduler.kv_cache_manager.coordinator
            .single_type_managers]


def _steps(h: EngineHarness, n: int) -> int:
    h.step(n)
    return n


def _window_passes_shared_blocks(h: EngineHarness) -> int:
    """A holds a shared prefix; B and C hit it in the cache, then their long suffixes
    (chunked, 64 tokens a step) move their windows past the prefix's blocks while A still
    holds them."""
    shared = prompt(7000, 5 * BLOCK)
    steps = 0
    for round_ in range(3):
        h.add(shared + prompt(7100 + round_, 8), max_tokens=160)
        steps += _steps(h, 4)
        b = h.add(shared + prompt(7200 + round_, 6 * BLOCK), max_tokens=24)
        h.add(shared + prompt(7300 + round_, 4 * BLOCK), max_tokens=24)
        steps += _steps(h, 6)
        assert _nulled_in_window_group(h, b), "B's window never slid: no block was freed"
        steps += h.run_to_completion()
    return steps


def _nulled_in_window_group(h: EngineHarness, client_id: str) -> bool:
    """Whether vLLM replaced blocks of this request's sliding-window table with the null
    block (its window slid past them, and they were freed)."""
    rid = h.internal_id(client_id)
    return any(type(m).__name__ == "SlidingWindowManager"
               and any(b.is_null for b in m.req_to_blocks.get(rid, []))
               for m in h.scheduler.kv_cache_manager.coordinator.single_type_managers)


def _long_prompts_preemption_and_aborts(h: EngineHarness) -> int:
    """Prompts longer than the window, more of them than the pool holds once they decode
    (preemption), two aborted mid-decode, and a second pass over the same prompts (prefix
    hits). A sliding-window-only request holds about its window (3 blocks), so that model
    runs 16 at once (16 x 3 blocks > 39)."""
    steps = 0
    n = 16 if _groups(h) == ["SlidingWindowManager"] else 6
    for _pass in range(2):
        ids = [h.add(prompt(7400 + i, 9 * BLOCK + 5 * i), max_tokens=300) for i in range(n)]
        steps += _steps(h, 30)
        h.abort(ids[1], ids[4])
        steps += h.run_to_completion()
    return steps


def _drained_report_matches_vllm(h: EngineHarness, after: int) -> None:
    h.drain_scheduler()
    h.step_until(lambda: (r := h.latest_drained()) is not None and r.checkpoint_id > after,
                 max_steps=50)
    r = h.latest()
    truth = h.pool_truth()
    assert truth.wrong_blocks == set(), f"vLLM's own pool holds blocks: {truth}"
    assert r.verdict in (Verdict.CLEAN, Verdict.SATURATED), r.explanation
    assert r.leaks == [] and r.leaked_blocks == 0
    assert r.pool is not None
    assert r.pool.free + r.pool.cached == h.pool.get_num_free_blocks() == r.pool.capacity


@pytest.mark.parametrize("kind,groups", [
    ("hybrid", ["SlidingWindowManager", "FullAttentionManager"]),
    ("sliding", ["SlidingWindowManager"]),
])
def test_healthy_hybrid_workloads_give_no_finding(
        kind: str, groups: list[str], hybrid_engines: Callable[[str], EngineHarness]) -> None:
    h = hybrid_engines(kind)
    assert sorted(_groups(h)) == sorted(groups), _groups(h)
    coordinator = h.scheduler.kv_cache_manager.coordinator
    assert getattr(coordinator.remove_skipped_blocks, "__kvguard_hook__", False), \
        "the sliding-window free is not hooked"
    hits_before = h.vllm_metric("vllm:prefix_cache_hits")
    steps = 0
    last = h.warmup_checkpoint_id
    for workload in (_window_passes_shared_blocks, _long_prompts_preemption_and_aborts) * 2:
        steps += workload(h)
        _drained_report_matches_vllm(h, last)
        last = h.latest().checkpoint_id
    assert steps >= MIN_STEPS, steps
    # vLLM itself says the paths ran: cache hits, preemptions, aborts, window frees.
    assert h.vllm_metric("vllm:prefix_cache_hits") > hits_before
    assert h.chaos.preemptions > 0, "the pool never ran short: no preemption"
    assert h.chaos.finish_statuses["FINISHED_ABORTED"] >= 8
    # The online audit judged every block many times while requests ran; it reports only
    # when its confirmed findings change from the last drained verdict (clean): none may.
    assert h.guard.online is not None and h.guard.online.stats.sweeps_total >= 20, \
        "the online audit hardly swept"
    online = h.online_reports()
    assert all(r.leaks == [] for r in online), [r.leaks for r in online if r.leaks]
    assert h.guard.ledger.num_double_frees == 0
    assert h.guard.errors.total == 0


HYBRID_FAULTS = ["fault_skip_free_on_abort", "fault_double_free_on_abort",
                 "fault_refcount_bump", "fault_preemption_skips_free",
                 "fault_prefix_hit_extra_ref", "fault_sliding_window_skips_free"]
"""The chaos matrix's fault classes that need neither a draft model (speculative decoding
wants a drafter of the same architecture) nor a KV connector."""


@pytest.mark.parametrize("name", HYBRID_FAULTS)
def test_every_injected_leak_is_caught_on_the_two_group_model(
        name: str, tmp_path_factory: pytest.TempPathFactory, run_dir: Path) -> None:
    """The chaos matrix's fault scenarios, run on the hybrid model: each is scored against
    vLLM's own pool after the drain (exact leaked block ids, cause, path, victim)."""
    _, scenarios = scenarios_for(tmp_path_factory.mktemp("hybrid-chaos"))
    s = scenarios[name]
    if "num_gpu_blocks_override" in s.engine:
        # Each token takes a block in each of the two groups: the same pressure needs
        # twice the blocks (12 would not even fit one max_model_len request).
        s = dataclasses.replace(s, engine={**s.engine, "num_gpu_blocks_override":
                                           2 * int(s.engine["num_gpu_blocks_override"])})
    hybrid = make_hybrid_model(tmp_path_factory.mktemp("hybrid-fault-model"))
    h = build_for(s, hybrid)
    try:
        assert len(_groups(h)) == 2, _groups(h)
        s.drive(h)
        report = scored_report(s, h)
        truth = h.pool_truth()
        assert truth.wrong_blocks, "the fault left vLLM's pool clean"
        assert score(s, report, truth, fault_victims(h)) == (Status.PASSED, ""), \
            report.explanation
    finally:
        h.guard.close()
