"""Property tests: the ledger + reconciler against a reference block pool.

A random engine run (admissions, allocations, prefix hits, preemptions,
finishes and aborts, plus injected faults) drives both the reference pool and
the ledger with the events the vLLM hooks would produce. Whatever the run:

* the five block states sum to capacity and the free count kvguard observes
  is the pool's own;
* a clean run never produces a finding, and every drained moment is ``clean``
  or ``saturated`` (saturated iff cached/capacity >= the threshold);
* every injected fault is found at the next drained moment with the right
  cause, path, request and block count, and nothing else is;
* the ledger forgets every request that finished and freed cleanly.

Hook events come in three styles: *attributed* (every pool hook names the
request), *pool-level* (no request id, ``claim`` after each acquisition) and
*mixed*; the guarantees hold in all three.
"""

from __future__ import annotations

from _pool import Harness, Req
from hypothesis import HealthCheck, Phase, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvguard.core.findings import Reconciliation
from kvguard.core.types import (
    BlockState,
    Evidence,
    FinishReason,
    LeakCause,
    LeakPath,
    Verdict,
)
from kvguard.core.verdict import SATURATION_RATIO_DEFAULT, decide

MAX_LIVE = 10
NO_EXPLAIN = tuple(p for p in Phase if p is not Phase.explain)
CLEAN_REASONS = [
    FinishReason.STOPPED,
    FinishReason.LENGTH,
    FinishReason.ABORTED,
    FinishReason.ERROR,
    FinishReason.IGNORED,
]

STATEFUL = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    report_multiple_bugs=False,
    phases=NO_EXPLAIN,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


# --------------------------------------------------------------------- checks
def assert_states_match_pool(h: Harness, rec: Reconciliation, *, exact_owners: bool) -> None:
    """States sum to capacity; free/cached/observed-free agree with the reference pool."""
    s = rec.states
    assert s.capacity == h.pool.capacity
    assert s.total == h.pool.capacity, s.by_state()
    assert sum(s.by_state().values()) == s.capacity
    assert rec.num_free_reported == h.pool.num_free
    assert rec.num_free_observed == h.pool.num_free, (rec.num_free_observed, h.pool.num_free)
    free, cached = h.pool.count_states_truth()
    assert s[BlockState.FREE] == free
    assert s[BlockState.CACHED] == cached
    if not exact_owners:
        return
    live_blocks = {b for r in h.live() for b in r.blocks}
    leaked = {b for lk in h.leaks for b in lk.blocks} - live_blocks
    in_use = {b for b in range(1, h.pool.num_blocks) if h.pool.ref[b] > 0}
    assert s[BlockState.ACTIVE] == len(live_blocks)
    assert s[BlockState.HELD_BY_FINISHED] == len(leaked)
    assert s[BlockState.ORPHANED] == len(in_use - live_blocks - leaked)


def assert_verdict_clean_or_saturated(rec: Reconciliation) -> None:
    verdict, explanation = decide(rec)
    cached = rec.states[BlockState.CACHED]
    saturated = cached / rec.states.capacity >= SATURATION_RATIO_DEFAULT
    assert verdict is (Verdict.SATURATED if saturated else Verdict.CLEAN), (verdict, cached)
    assert explanation


def assert_drained_findings_exact(h: Harness, rec: Reconciliation) -> None:
    """At a drained moment the findings are exactly the injected faults."""
    held, orphans = h.expected_drained_findings()
    by_cause: dict[LeakCause, list] = {c: [] for c in LeakCause}
    for f in rec.findings:
        by_cause[f.cause].append(f)
    assert not by_cause[LeakCause.DOUBLE_FREE], rec.findings
    assert not by_cause[LeakCause.REFCOUNT_DRIFT], rec.findings

    got_held = {f.request_id: f.blocks for f in by_cause[LeakCause.FINISHED_REQUEST]}
    assert got_held == held, (got_held, held, rec.findings)
    finished_at = {lk.rid: lk.finished_at for lk in h.leaks}
    client = {lk.rid: lk.client_id for lk in h.leaks}
    for f in by_cause[LeakCause.FINISHED_REQUEST]:
        assert f.path is LeakPath.ABORT
        assert f.finish_reason is FinishReason.ABORTED
        assert f.client_request_id == client[f.request_id]
        assert f.held_for_seconds == h.t - finished_at[f.request_id]
        assert f.evidence is Evidence.DRAINED

    got_orphans = sum(f.blocks for f in by_cause[LeakCause.ORPHAN])
    assert got_orphans == len(orphans), (rec.findings, orphans)
    for f in by_cause[LeakCause.ORPHAN]:
        assert f.request_id is None
        assert set(f.block_ids) <= orphans

    assert rec.finished_requests_holding == len(held)
    by_cause_blocks = rec.leaked_blocks_by_cause()
    # Distinct blocks: requests that shared a prefix hold its blocks together, once each.
    leaked_ids = {b for lk in h.leaks for b in lk.blocks}
    assert by_cause_blocks[LeakCause.FINISHED_REQUEST] == len(leaked_ids)
    assert by_cause_blocks[LeakCause.ORPHAN] == len(orphans)
    assert rec.leaked_blocks() == len(leaked_ids) + len(orphans)
    for f in by_cause[LeakCause.FINISHED_REQUEST]:
        others = {b for g in rec.findings if g is not f for b in g.all_block_ids}
        assert f.shared_blocks == len(f.all_block_ids & others)
    verdict, explanation = decide(rec)
    if held or orphans:
        assert verdict is Verdict.LEAK
        for rid in held:
            assert client[rid] in explanation or len(held) > 5
    else:
        assert_verdict_clean_or_saturated(rec)


# ------------------------------------------------------------- state machine
class PoolMachine(RuleBasedStateMachine):
    """A random engine run; subclasses fix the hook style and whether faults happen."""

    style = "attributed"  # attributed | pool | mixed
    faults = False

    def __init__(self) -> None:
        super().__init__()
        self.h: Harness | None = None
        self.checkpoints = 0

    def _attributed(self, data: st.DataObject) -> bool:
        if self.style == "attributed":
            return True
        if self.style == "pool":
            return False
        return data.draw(st.booleans(), label="attributed")

    @initialize(num_blocks=st.integers(min_value=9, max_value=65))
    def start(self, num_blocks: int) -> None:
        self.h = Harness(num_blocks)

    # engine operations --------------------------------------------------
    @precondition(lambda self: len(self.h.live()) < MAX_LIVE)
    @rule()
    def admit(self) -> None:
        self.h.admit()

    def _pick(self, data: st.DataObject, reqs: list[Req]) -> Req:
        rid = data.draw(st.sampled_from([r.rid for r in reqs]), label="request")
        return self.h.reqs[rid]

    @precondition(lambda self: self.h.live() and self.h.pool.num_free > 0)
    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        req = self._pick(data, self.h.live())
        n = data.draw(st.integers(1, min(4, self.h.pool.num_free)), label="n")
        mask = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="hashed")
        self.h.allocate(req, n, hash_mask=mask, attributed=self._attributed(data))

    @precondition(lambda self: any(self.h.hashed_candidates(r) for r in self.h.live()))
    @rule(data=st.data())
    def prefix_hit(self, data: st.DataObject) -> None:
        req = self._pick(data, [r for r in self.h.live() if self.h.hashed_candidates(r)])
        cands = self.h.hashed_candidates(req)
        blocks = data.draw(
            st.lists(st.sampled_from(cands), min_size=1, max_size=4, unique=True),
            label="hit",
        )
        self.h.prefix_hit(req, blocks, attributed=self._attributed(data))

    @precondition(lambda self: any(r.blocks for r in self.h.live()))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        req = self._pick(data, [r for r in self.h.live() if r.blocks])
        self.h.preempt(req, attributed=self._attributed(data))

    @precondition(lambda self: self.h.live())
    @rule(data=st.data(), reason=st.sampled_from(CLEAN_REASONS))
    def finish(self, data: st.DataObject, reason: FinishReason) -> None:
        req = self._pick(data, self.h.live())
        self.h.finish(req, reason, attributed=self._attributed(data))

    @rule(data=st.data())
    def drained_checkpoint(self, data: st.DataObject) -> None:
        """Drain (finish and free everything live), then audit: the checkpoint protocol."""
        h = self.h
        h.drain(attributed=self._attributed(data))
        assert h.is_drained()
        walk = data.draw(st.booleans(), label="walk_free_queue")
        rec = h.reconcile(walk_free_queue=walk)
        self.checkpoints += 1
        assert_states_match_pool(h, rec, exact_owners=True)
        assert_drained_findings_exact(h, rec)
        # Memory is bounded: only requests that still hold blocks are remembered.
        assert h.ledger.num_records == len({lk.rid for lk in h.leaks}), [
            r.request_id for r in h.ledger.records()
        ]
        assert h.ledger.num_ownerships == sum(len(lk.blocks) for lk in h.leaks)
        if not self.faults:
            assert h.ledger.num_records == 0
            assert sum(h.ledger.num_finished_compacted.values()) == h.num_finished_clean

    # faults ---------------------------------------------------------------
    @precondition(lambda self: self.faults and self.h.live())
    @rule(data=st.data())
    def fault_skip_free_on_abort(self, data: st.DataObject) -> None:
        req = self._pick(data, self.h.live())
        self.h.skip_free_on_abort(req)

    @precondition(lambda self: self.faults)
    @rule(data=st.data())
    def fault_bump_ref(self, data: st.DataObject) -> None:
        cands = self.h.bump_candidates()
        assume(cands)
        self.h.bump_ref(data.draw(st.sampled_from(cands), label="bumped"))

    # invariants (checked after every step) ------------------------------------
    @invariant()
    def states_sum_to_capacity(self) -> None:
        if self.h is None:
            return
        rec = self.h.reconcile(evidence=Evidence.ONLINE)
        assert_states_match_pool(self.h, rec, exact_owners=not self.faults)
        if not self.faults:
            assert rec.findings == [], rec.findings
            assert rec.finished_requests_holding == 0

    @invariant()
    def ledger_references_match_engine_tables(self) -> None:
        """In a clean run the ledger's references are exactly the engine's block tables."""
        if self.h is None or self.faults:
            return
        h = self.h
        truth = {(r.rid, b) for r in h.live() for b in r.blocks}
        got = {(rec.request_id, b) for rec in h.ledger.records() for b in rec.blocks}
        # Pool-level releases may take a shared block's reference off another
        # live holder; per-block counts must still match.
        per_block_truth: dict[int, int] = {}
        for _, b in truth:
            per_block_truth[b] = per_block_truth.get(b, 0) + 1
        per_block_got = {b: sum(h.ledger.owners_of(b).values()) for b in h.ledger.owned_block_ids()}
        assert per_block_got == per_block_truth
        if self.style == "attributed":
            assert got == truth


def _machine(style: str, faults: bool) -> type[PoolMachine]:
    return type(f"PoolMachine_{style}_{'faults' if faults else 'clean'}", (PoolMachine,),
                {"style": style, "faults": faults})


TestCleanRunAttributedHooks = _machine("attributed", False).TestCase
TestCleanRunAttributedHooks.settings = STATEFUL
TestCleanRunPoolLevelHooks = _machine("pool", False).TestCase
TestCleanRunPoolLevelHooks.settings = STATEFUL
TestCleanRunMixedHooks = _machine("mixed", False).TestCase
TestCleanRunMixedHooks.settings = STATEFUL
TestFaultsFoundAttributedHooks = _machine("attributed", True).TestCase
TestFaultsFoundAttributedHooks.settings = STATEFUL
TestFaultsFoundPoolLevelHooks = _machine("pool", True).TestCase
TestFaultsFoundPoolLevelHooks.settings = STATEFUL
TestFaultsFoundMixedHooks = _machine("mixed", True).TestCase
TestFaultsFoundMixedHooks.settings = STATEFUL
