"""The scenario matrix: exceptional exits where KV blocks really leak, and healthy twins.

Each scenario drives a fresh real engine and states what a correct kvguard must
conclude. ``drive`` returns evidence that the path was really exercised (e.g.
"7 preemptions"); it raises ``NotExercised`` when the engine did not take the
path, so a scenario can never pass vacuously.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvguard.chaos.expect import ExpectedLeak as ExpectedLeak
from kvguard.chaos.expect import ExpectedOffload as ExpectedOffload
from kvguard.chaos.expect import NotExercised as NotExercised
from kvguard.chaos.faults import Fault
from kvguard.chaos.harness import EngineHarness, prompt
from kvguard.core.offload import JobKind, OffloadVerdict
from kvguard.core.types import Evidence, LeakCause, LeakPath, Verdict

HEALTHY = frozenset({Verdict.CLEAN, Verdict.SATURATED})


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    injected: str
    """What was done to the engine, in words."""
    drive: Callable[[EngineHarness], str]
    verdicts: frozenset[Verdict] = HEALTHY
    leak: ExpectedLeak | None = None
    engine: Mapping[str, object] = field(default_factory=dict)
    """EngineSpec overrides (``extra`` for vLLM kwargs such as kv_transfer_config)."""
    faults: Mapping[Fault, int] = field(default_factory=dict)
    """Armed in the chaos scheduler (vLLM's code paths, below kvguard's hooks)."""
    delayed_free_bound_seconds: float = 30.0
    kvguard: Mapping[str, object] = field(default_factory=dict)
    """KvguardConfig overrides for this scenario (e.g. the online audit's budget)."""
    evidence: Evidence = Evidence.DRAINED
    """Which report is scored: the latest drained checkpoint, or the latest online one
    (a leak that keeps the engine from ever draining)."""
    reproduces: str = ""
    """Which real report (design.md section 5) this scenario stands for."""
    offload: ExpectedOffload | None = None
    """Scenarios on an offloading connector: what kvguard's offload audit must say."""
    never_drains: bool = False
    """The fault keeps the engine from ever draining again (with async scheduling there is
    always a batch in flight after it, so no drained checkpoint at all after the warm-up):
    the pool is scored on the latest drained report when there is one; without one, only
    on no report since the warm-up claiming a leak. The offload audit is scored as usual."""
    may_be_unsupported: bool = False
    """If the engine cannot be built with this configuration, report ``unsupported`` with
    vLLM's own error instead of failing (e.g. offloading connectors on the CPU build)."""


def _connector(**extra: object) -> dict[str, object]:
    return {"extra": {"kv_transfer_config": {
        "kv_connector": "DelayedFreeConnector",
        "kv_connector_module_path": "kvguard.chaos.delay_connector",
        "kv_role": "kv_both", "kv_connector_extra_config": extra}}}


# ------------------------------------------------------------------ drivers
def _disconnects(concurrency: int) -> Callable[[EngineHarness], str]:
    def drive(h: EngineHarness) -> str:
        ids = [h.add(prompt(i, 40 + i % 30), max_tokens=80) for i in range(concurrency)]
        h.step(6)
        running = sum(1 for r in h.scheduler.running)
        h.abort(*ids[::2])
        h.run_to_completion()
        h.drain_scheduler()
        n = h.vllm_aborted(ids[::2])
        if n < len(ids[::2]):
            raise NotExercised(f"vLLM aborted only {n} of {len(ids[::2])} requests")
        return f"{n} aborted of {concurrency} ({running} running at the abort)"
    return drive


def _abort_while_queued(h: EngineHarness) -> str:
    ids = [h.add(prompt(100 + i, 50), max_tokens=40) for i in range(4)]
    h.step(3)
    queued = [r.request_id.rsplit("-", 1)[0] for r in h.scheduler.waiting]
    if not queued:
        raise NotExercised("no request was queued")
    h.abort(*queued)
    h.run_to_completion()
    h.drain_scheduler()
    _require_aborted(h, queued)
    return f"{len(queued)} aborted while queued of {len(ids)}"


def _require_aborted(h: EngineHarness, client_ids: list[str]) -> None:
    """vLLM itself must have finished each request as ``FINISHED_ABORTED``."""
    lost = [c for c in client_ids if h.vllm_status(c) != "FINISHED_ABORTED"]
    if lost:
        raise NotExercised("the abort did not reach the engine for "
                           + ", ".join(f"{c} (vLLM: {h.vllm_status(c)})" for c in lost))


def _abort_long_prefill(h: EngineHarness) -> str:
    rid = h.add(prompt(200, 400), max_tokens=20)
    h.step(2)
    req = h.scheduler.requests[h.internal_id(rid)]
    done = int(req.num_computed_tokens)
    if not 0 < done < 400:
        raise NotExercised(f"prefill was not in progress ({done}/400 tokens computed)")
    h.abort(rid)
    h.run_to_completion()
    h.drain_scheduler()
    _require_aborted(h, [rid])
    return f"aborted after {done}/400 prompt tokens"


def _abort_racing_final_step(h: EngineHarness) -> str:
    rid = h.add(prompt(300, 60), max_tokens=8)
    internal = h.internal_id(rid)
    h.step_until(lambda: h.scheduler.requests[internal].num_output_tokens >= 7)
    h.abort(rid)  # lands in the same engine iteration as the final token
    h.run_to_completion()
    h.drain_scheduler()
    _require_aborted(h, [rid])
    return "aborted with 7 of 8 tokens out"


def _preemption_storm(h: EngineHarness) -> str:
    for i in range(6):
        h.add(prompt(400 + i, 60), max_tokens=150)
    h.run_to_completion()
    h.drain_scheduler()
    n = int(h.vllm_metric("vllm:num_preemptions"))
    if n == 0:
        raise NotExercised("vLLM counted no preemption (vllm:num_preemptions)")
    return f"{n} preemptions in a {h.num_usable()}-block pool"


def _shared_prefix_abort(h: EngineHarness) -> str:
    shared = prompt(500, 96)
    ids = [h.add(shared + prompt(510 + i, 10), max_tokens=40) for i in range(4)]
    h.step(4)
    h.abort(ids[1])
    h.run_to_completion()
    h.drain_scheduler()
    _require_aborted(h, [ids[1]])
    hits = int(h.vllm_metric("vllm:prefix_cache_hits"))
    if hits == 0:
        raise NotExercised("vLLM counted no prefix-cache hit (vllm:prefix_cache_hits)")
    return f"{hits} prefix-hit tokens, one sharer aborted"


def _saturation(h: EngineHarness) -> str:
    for i in range(30):
        h.add(prompt(600 + i, 96), max_tokens=2)
        h.run_to_completion()
    h.drain_scheduler()
    r = h.latest()
    return f"{r.pool.cached if r.pool else 0}/{h.num_usable()} blocks cached"


def _spec_decode(h: EngineHarness) -> str:
    # Only this scenario's drafts count, not the engine's warm-up request's.
    before = _spec_decode_counts(h)
    for i in range(4):
        h.add(prompt(700 + i, 40), max_tokens=40)
    h.run_to_completion()
    h.drain_scheduler()
    return _require_rejections(h, before)


def _spec_decode_counts(h: EngineHarness) -> tuple[int, int]:
    """vLLM's own (draft, accepted) token counters."""
    return (int(h.vllm_metric("vllm:spec_decode_num_draft_tokens")),
            int(h.vllm_metric("vllm:spec_decode_num_accepted_tokens")))


def _require_rejections(h: EngineHarness, before: tuple[int, int] = (0, 0)) -> str:
    drafts, accepted = _spec_decode_counts(h)
    drafts, accepted = drafts - before[0], accepted - before[1]
    if drafts == 0 or accepted >= drafts:
        raise NotExercised(f"vLLM rejected no draft ({accepted}/{drafts} accepted)")
    return f"{drafts - accepted} of {drafts} draft tokens rejected"


def _delayed_free(h: EngineHarness) -> str:
    for i in range(3):
        h.add(prompt(800 + i, 70), max_tokens=5)
    h.run_to_completion()
    pending = len(h.scheduler.requests)
    h.drain_scheduler()
    if pending == 0:
        raise NotExercised("no free was delayed")
    return f"{pending} frees delayed by the connector, then completed"


def _delayed_free_never(h: EngineHarness) -> str:
    h.add(prompt(900, 70), max_tokens=5, rid="never-1")
    h.add(prompt(901, 40), max_tokens=5)
    h.run_to_completion()
    h.step_until(lambda: getattr(h.latest_drained(), "verdict", None) is Verdict.LEAK,
                 max_steps=10**6, pause_seconds=0.005,
                 max_seconds=h.guard.delayed_free_bound + 20)
    return f"never-1 holds {h.blocks_of('never-1')} blocks past the bound"


def _fail_after_admission(h: EngineHarness) -> str:
    from vllm.v1.request import RequestStatus

    ids = [h.add(prompt(1000 + i, 50), max_tokens=40) for i in range(3)]
    h.step(4)
    victims = [h.internal_id(ids[0]), h.internal_id(ids[1])]
    h.scheduler.finish_requests(victims, RequestStatus.FINISHED_ERROR)
    # Finished inside the scheduler only: the engine's client side still waits for them,
    # so wait for the scheduler (not the client) to empty.
    h.drain_scheduler()
    n = h.chaos.finish_statuses["FINISHED_ERROR"]
    if n != 2:
        raise NotExercised(f"vLLM finished {n} requests with FINISHED_ERROR, expected 2")
    return "2 requests failed (FINISHED_ERROR) after admission"


def _skip_free_on_abort(h: EngineHarness) -> str:
    victim = "victim-skip"
    h.add(prompt(1100, 70), max_tokens=60, rid=victim)
    other = h.add(prompt(1101, 30), max_tokens=30)
    h.step_until(lambda: h.blocks_of(victim) >= 3)
    held = h.blocks_of(victim)
    h.abort(victim)
    h.run_to_completion()
    h.drain_scheduler()
    _require_aborted(h, [victim])
    _require_fired(h, Fault.SKIP_FREE_ON_ABORT)
    return f"{victim} aborted holding {held} blocks ({other} ran normally)"


def _require_fired(h: EngineHarness, fault: Fault) -> None:
    if not h.chaos.faults.times_fired(fault):
        raise NotExercised(f"the fault {fault.value} never fired: vLLM did not take its path")


def _double_free_on_abort(h: EngineHarness) -> str:
    victim = "victim-double"
    h.add(prompt(1150, 70), max_tokens=60, rid=victim)
    h.step_until(lambda: h.blocks_of(victim) >= 3)
    held = h.blocks_of(victim)
    h.abort(victim)  # the pool is now corrupt: step no further than the batch in flight
    # With async scheduling the batch scheduled before the abort still runs; the engine
    # drains once it is processed (nothing else is scheduled, so nothing is allocated).
    h.step_until(lambda: not h.batches_in_flight())
    _require_aborted(h, [victim])
    _require_fired(h, Fault.DOUBLE_FREE_ON_ABORT)
    return f"{victim} aborted holding {held} blocks, each freed twice"


def _refcount_bump(h: EngineHarness) -> str:
    h.add(prompt(1200, 70), max_tokens=10)
    h.run_to_completion()
    h.drain_scheduler()
    _require_fired(h, Fault.REFCOUNT_BUMP)
    return "one block's ref_cnt bumped behind every hook"


def _hook_errors(h: EngineHarness) -> str:
    h.fail_kvguard_finish_hook(3)  # kvguard's own code raising: not an engine fault
    for i in range(4):
        h.add(prompt(1300 + i, 40), max_tokens=12)
    h.run_to_completion()
    h.drain_scheduler()
    n = h.guard.errors.total
    if n != 3:
        raise NotExercised(f"{n} hook errors counted, expected 3")
    if h.latest().verdict is not Verdict.SKIPPED:
        raise NotExercised("the checkpoint after kvguard's own errors was not skipped")
    h.add(prompt(1310, 40), max_tokens=4)  # the next drained checkpoint is judged again
    h.run_to_completion()
    h.drain_scheduler()
    return "3 exceptions inside kvguard hooks, contained and counted; one checkpoint skipped"


def _preemption_skips_free(h: EngineHarness) -> str:
    for i in range(6):
        h.add(prompt(1400 + i, 60), max_tokens=150)
    h.run_to_completion()
    h.drain_scheduler()
    n = int(h.vllm_metric("vllm:num_preemptions"))
    if n == 0:
        raise NotExercised("vLLM counted no preemption (vllm:num_preemptions)")
    _require_fired(h, Fault.PREEMPTION_SKIPS_FREE)
    return f"{n} preemptions; the first one dropped its tables without freeing"


def _spec_rollback_keeps_blocks(h: EngineHarness) -> str:
    # Prompt + output end just short of a block boundary, so the last step's lookahead
    # (3 draft tokens) reaches into a block that no computed token uses.
    before = _spec_decode_counts(h)  # not the warm-up request's drafts
    for i in range(8):
        h.add(prompt(1500 + i, 40), max_tokens=21 + i % 3)
        h.run_to_completion()
        drafts, accepted = _spec_decode_counts(h)
        # Until the fault fired and vLLM rejected some draft: the victim's drafts may all
        # have been accepted (seen with async scheduling), and the path needs rejections.
        if h.chaos.faults.times_fired(Fault.SPEC_ROLLBACK_KEEPS_BLOCKS) \
                and drafts - before[0] > accepted - before[1]:
            break
    h.drain_scheduler()
    rejected = _require_rejections(h, before)
    _require_fired(h, Fault.SPEC_ROLLBACK_KEEPS_BLOCKS)
    return rejected + "; one finished request kept its rejected-draft blocks"


def _prefix_hit_extra_ref(h: EngineHarness) -> str:
    shared = prompt(1600, 96)
    h.add(shared + prompt(1601, 10), max_tokens=8)
    h.run_to_completion()
    h.add(shared + prompt(1602, 10), max_tokens=8)  # hits the 3 cached prefix blocks
    h.run_to_completion()
    h.drain_scheduler()
    hits = int(h.vllm_metric("vllm:prefix_cache_hits"))
    if hits == 0:
        raise NotExercised("vLLM counted no prefix-cache hit (vllm:prefix_cache_hits)")
    _require_fired(h, Fault.PREFIX_HIT_EXTRA_REF)
    return f"{hits} prefix-hit tokens; one hit took two references"


def _deferred_free_never_released(h: EngineHarness) -> str:
    from kvguard.chaos.sustained import SustainedLoad

    h.add(prompt(1700, 70), max_tokens=6, rid="parked-1")
    h.run_to_completion()
    _require_fired(h, Fault.DEFERRED_FREE_NEVER_RELEASED)
    if not len(h.scheduler.deferred_frees):
        raise NotExercised("vLLM's deferred_frees is empty: the free was not deferred")
    # Under load (the engine never drains: a free stays parked), only the online audit
    # can judge; it reports once the hold outlives the bound and two sweeps agree.
    load = SustainedLoad(h, concurrency=4, backlog=1)
    deadline = time.monotonic() + h.guard.delayed_free_bound + 90.0
    while not any(r.verdict is Verdict.LEAK for r in h.online_reports()):
        if time.monotonic() > deadline:
            raise NotExercised("no online report within the bound + 90 s")
        load.step()
    h.run_to_completion()
    h.drain_scheduler()
    return (f"parked-1's free parked in deferred_frees for good "
            f"({load.started} requests of load beside it)")


def _sliding_window_skips_free(h: EngineHarness) -> str:
    h.add(prompt(1800, 200), max_tokens=40)
    h.run_to_completion()
    h.drain_scheduler()
    _require_fired(h, Fault.SLIDING_WINDOW_REMOVAL_SKIPS_FREE)
    return "blocks that slid out of the 64-token window were nulled, never freed"


def matrix(draft_model_dir: Path | None = None,
           hybrid_model_dir: Path | None = None) -> list[Scenario]:
    """Every scenario, in the order ``kvguard chaos`` runs them."""
    spec_extra: dict[str, object] = {}
    if draft_model_dir is not None:
        spec_extra = {"extra": {"speculative_config": {
            "method": "draft_model", "model": str(draft_model_dir),
            "num_speculative_tokens": 3}}}
    hybrid: dict[str, object] = {}
    if hybrid_model_dir is not None:
        hybrid = {"model_dir": hybrid_model_dir}
    return [
        Scenario("disconnect_c1", "client disconnects mid-stream, 1 concurrent", _disconnects(1)),
        Scenario("disconnect_c8", "client disconnects mid-stream, 8 concurrent", _disconnects(8)),
        Scenario("disconnect_c32", "client disconnects mid-stream, 32 concurrent (queueing)",
                 _disconnects(32)),
        Scenario("abort_queued", "abort while queued", _abort_while_queued,
                 engine={"max_num_seqs": 1}, reproduces="vllm #41269 (reject before admission)"),
        Scenario("abort_long_prefill", "abort during a chunked 400-token prefill",
                 _abort_long_prefill, engine={"max_num_batched_tokens": 64}),
        Scenario("abort_final_step", "abort racing the final decode step",
                 _abort_racing_final_step, reproduces="vllm #29987 (healthy twin)"),
        Scenario("preemption_storm", "6 long requests in a 11-block pool", _preemption_storm,
                 engine={"num_gpu_blocks_override": 12, "max_model_len": 256},
                 reproduces="vllm #52360 (preemption; no async store on CPU)"),
        Scenario("shared_prefix_abort", "4 sharers of a 3-block prefix, one aborted",
                 _shared_prefix_abort),
        Scenario("prefix_saturation", "30 distinct prefixes fill the cache",
                 _saturation, verdicts=frozenset({Verdict.SATURATED})),
        Scenario("spec_decode_rejections", "speculative decoding with a draft model "
                 "(rejected drafts roll back)", _spec_decode, engine=spec_extra),
        Scenario("delayed_free_late", "KV transfer completes 5 steps late (within bound)",
                 _delayed_free, engine=_connector(complete_after_steps=5)),
        *_offload_scenarios(),
        Scenario("fail_after_admission", "2 requests fail (FINISHED_ERROR) after admission",
                 _fail_after_admission),
        Scenario("hook_exceptions", "3 exceptions inside kvguard's own hooks (records then "
                 "incomplete: one checkpoint skipped, then judged again)", _hook_errors),
        Scenario("fault_skip_free_on_abort", "FAULT: the aborted request's free is skipped",
                 _skip_free_on_abort, verdicts=frozenset({Verdict.LEAK}),
                 leak=ExpectedLeak(LeakCause.FINISHED_REQUEST, LeakPath.ABORT,
                                   frozenset({"victim-skip"})),
                 faults={Fault.SKIP_FREE_ON_ABORT: 1},
                 reproduces="vllm #32255 / #29987 (free missed on abort)"),
        Scenario("fault_transfer_never_completes",
                 "FAULT: a KV transfer completion never arrives", _delayed_free_never,
                 verdicts=frozenset({Verdict.LEAK}),
                 leak=ExpectedLeak(LeakCause.FINISHED_REQUEST, LeakPath.DELAYED_FREE,
                                   frozenset({"never-1"})),
                 engine=_connector(complete_after_steps=2,
                                   never_complete_request_prefixes=["never-"]),
                 delayed_free_bound_seconds=1.0,
                 reproduces="vllm #46283, #20139 (delayed free never completes)"),
        Scenario("fault_double_free_on_abort", "FAULT: the aborted request's blocks freed twice",
                 _double_free_on_abort, verdicts=frozenset({Verdict.LEAK}),
                 leak=ExpectedLeak(LeakCause.DOUBLE_FREE, LeakPath.ABORT,
                                   frozenset({"victim-double"})),
                 faults={Fault.DOUBLE_FREE_ON_ABORT: 1},
                 reproduces="SGLang #6888 (double free)"),
        Scenario("fault_refcount_bump", "FAULT: a ref_cnt bump nobody releases",
                 _refcount_bump, verdicts=frozenset({Verdict.LEAK}),
                 leak=ExpectedLeak(LeakCause.ORPHAN, None), faults={Fault.REFCOUNT_BUMP: 1},
                 reproduces="copy-on-write / connector ref bumps (design.md section 5)"),
        Scenario("fault_preemption_skips_free",
                 "FAULT: a preemption drops the request's tables without freeing",
                 _preemption_skips_free, verdicts=frozenset({Verdict.LEAK}),
                 leak=ExpectedLeak(LeakCause.FINISHED_REQUEST, LeakPath.PREEMPTION,
                                   named_by_fault=True),
                 # Without prefix caching: the re-run would take prefix hits on its own
                 # leaked blocks, which kvguard's ledger cannot tell from new references
                 # (it then reports the leftover reference as an unclaimed prefix hit).
                 engine={"num_gpu_blocks_override": 12, "max_model_len": 256,
                         "enable_prefix_caching": False},
                 faults={Fault.PREEMPTION_SKIPS_FREE: 1},
                 reproduces="vllm #52360 (preemption loses the free)"),
        Scenario("fault_spec_rollback_keeps_blocks",
                 "FAULT: a finished request keeps its rejected-draft blocks",
                 _spec_rollback_keeps_blocks, verdicts=frozenset({Verdict.LEAK}),
                 leak=ExpectedLeak(LeakCause.FINISHED_REQUEST, LeakPath.FINISH,
                                   named_by_fault=True),
                 engine=spec_extra, faults={Fault.SPEC_ROLLBACK_KEEPS_BLOCKS: 1},
                 reproduces="SGLang #19518, sglang-jax #1147 (draft slots never freed)"),
        Scenario("fault_prefix_hit_extra_ref",
                 "FAULT: a prefix-cache hit takes a second reference",
                 _prefix_hit_extra_ref, verdicts=frozenset({Verdict.LEAK}),
                 leak=ExpectedLeak(LeakCause.ORPHAN, None),
                 faults={Fault.PREFIX_HIT_EXTRA_REF: 1},
                 reproduces="xLLM #828 (prefix-cache reference never released)"),
        Scenario("fault_deferred_free_never_released",
                 "FAULT: a free parked in deferred_frees is never released",
                 _deferred_free_never_released, verdicts=frozenset({Verdict.LEAK}),
                 leak=ExpectedLeak(LeakCause.FINISHED_REQUEST, LeakPath.DEFERRED_FREE,
                                   frozenset({"parked-1"})),
                 faults={Fault.DEFERRED_FREE_NEVER_RELEASED: 1},
                 delayed_free_bound_seconds=1.0, evidence=Evidence.ONLINE,
                 kvguard={"online_budget_fraction": 0.2},
                 reproduces="vllm #45357 (deferred-free fence), vllm-rbln PR #903"),
        Scenario("fault_sliding_window_skips_free",
                 "FAULT: blocks sliding out of the window are never freed (hybrid model)",
                 _sliding_window_skips_free, verdicts=frozenset({Verdict.LEAK}),
                 leak=ExpectedLeak(LeakCause.ORPHAN, None),
                 engine=hybrid, faults={Fault.SLIDING_WINDOW_REMOVAL_SKIPS_FREE: 1},
                 kvguard={"online_audit": False},
                 reproduces="vllm-ascend PR #10394 (remove_skipped_blocks), vllm #25431"),
    ]


def _offload_scenarios() -> list[Scenario]:
    """vLLM's real OffloadingConnector (:mod:`kvguard.chaos.offload_scenarios`)."""
    from kvguard.chaos import offload_scenarios as o

    ok = ExpectedOffload(OffloadVerdict.OK)
    return [
        Scenario("offload_connector", "KV offload through vLLM's OffloadingConnector: store, "
                 "evict, reload (jobs 2 steps long)", o.drive_reload_after_eviction,
                 engine=o.offload_engine(complete_after_steps=2), offload=ok,
                 reproduces="vllm #52360 (async store)"),
        Scenario("offload_abort_during_load", "abort while its KV loads from the offload tier",
                 o.drive_abort_during_load, engine=o.offload_engine(complete_after_steps=4),
                 offload=ok, reproduces="vllm #32255 (abort while waiting for KV)"),
        Scenario("offload_reset_stores_in_flight", "reset_prefix_cache with offload stores "
                 "in flight", o.drive_reset_with_stores_in_flight,
                 engine=o.offload_engine(complete_after_steps=6), offload=ok),
        Scenario("offload_preemption_stores", "preemptions with offload stores in flight",
                 o.drive_preemption_with_stores,
                 engine={**o.offload_engine(complete_after_steps=3),
                         "num_gpu_blocks_override": 12},
                 offload=ok, reproduces="vllm #52360 (preemption during an async store)"),
        Scenario("offload_tier_full", "the offload tier is too small for a prefix (vLLM "
                 "cannot store its chunks)", o.drive_tier_full,
                 engine=o.offload_engine(o.TIER_OF_3_CHUNKS), offload=ok),
        Scenario("fault_offload_load_lost", "FAULT: an offload load completion never arrives "
                 "(the request is then aborted)", o.drive_load_lost,
                 verdicts=frozenset({Verdict.LEAK}),
                 leak=ExpectedLeak(LeakCause.FINISHED_REQUEST, LeakPath.DELAYED_FREE,
                                   frozenset({"lost-load"})),
                 engine=o.offload_engine(), delayed_free_bound_seconds=1.0,
                 offload=ExpectedOffload(OffloadVerdict.STUCK, JobKind.LOAD,
                                         frozenset({"lost-load"})),
                 reproduces="vllm #46283 (transfer completion never arrives)"),
        Scenario("fault_offload_store_lost", "FAULT: an offload store completion never "
                 "arrives (no block leaks; the engine never idles; a same-prefix request "
                 "waits for ever)", o.drive_store_lost,
                 engine=o.offload_engine(), delayed_free_bound_seconds=1.0,
                 never_drains=True,
                 offload=ExpectedOffload(OffloadVerdict.STUCK, JobKind.STORE,
                                         frozenset({"lost-store"}), frozenset({"waits"})),
                 reproduces="vllm #52360 (async store never completes)"),
    ]

