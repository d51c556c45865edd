"""The online audit: ownership verdicts at engine step boundaries, with no drain.

A busy server may never drain, so waiting for a drained checkpoint can mean
never judging at all. Between two engine steps, though, the pool and the
ledger already agree on every block, except blocks in a *declared* transition:
a delayed free (KV transfer or offload in flight) or a deferred free (waits
for an in-flight step), both bounded in time, and references taken by a pool
call that no request has claimed yet. The online audit checks that agreement
a slice at a time, at step boundaries, inside a time budget.

**Sweep.** One sweep (1) claims every request's block table into the ledger,
so that references taken by pool calls with no request at hand get their
owner, then (2) reads the pool slice by slice and judges each block. A sweep
covers the whole pool; how many steps it takes (``K``) follows from the budget.

**Budget.** Each step earns ``budget_fraction`` x the scheduler time of that
step (``schedule`` + ``update_from_output``, measured by the caller) of audit
time; audit work spends it, measured with ``perf_counter``, in units of at
most ``slice_blocks`` blocks or ``claim_requests`` tables. Credit may go
negative by one unit (repaid by later steps) and is capped at
``max_pause_seconds``, so no single step boundary pauses longer. Over any run,
audit time <= ``budget_fraction`` x scheduler time + one unit: the overhead
bound (in units of scheduler time, the performance target's unit) holds by
construction, on any machine and for any pool size; ``K`` follows from it.

**Confirmation.** A block is reported only when two consecutive audits of it
(one sweep apart, with a claim phase between them) judge it suspect with the
same *fingerprint* (the same owners, counts, or unattributed acquisition).
A block caught mid-transition, freed and taken again, or merely not claimed
yet changes fingerprint or becomes consistent, so it is never confirmed.

**Latency.** A leak that appears during sweep ``n`` is confirmed by the end of
sweep ``n + 2``: detection takes at most three sweeps (``3 K`` steps), two
when the leak appears before its block is reached in sweep ``n``. Delayed and
deferred frees are legitimate until ``delayed_free_bound_seconds`` after they
began; latency for those counts from the bound.

Judges only ownership (the pool boundary). Tensor, allocator and device
boundaries need a quiet device and stay with drained checkpoints. Imports
neither vLLM nor torch; the engine side is a :class:`PoolAccess`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress
from time import perf_counter
from typing import Protocol, cast

from kvguard.core.classify import Fingerprint, HoldRule, classify_block
from kvguard.core.findings import Finding, Reconciliation
from kvguard.core.ledger import OwnershipLedger
from kvguard.core.reconciler import ReconcileOptions, judge_block
from kvguard.core.report import PoolReport
from kvguard.core.snapshot import PoolSlice, count_falsy
from kvguard.core.types import (
    BlockId,
    BlockState,
    Evidence,
    RequestId,
    RequestPhase,
)


class PoolAccess(Protocol):
    """What the online audit reads from an engine, between steps, on its thread."""

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, null blocks included."""

    @property
    def null_block_ids(self) -> frozenset[int]: ...

    def read(self, lo: int, hi: int) -> PoolSlice:
        """Blocks ``lo..hi-1``: ref counts, cached flags, and how many of them are out of
        the free queue."""

    def in_free_queue(self, lo: int, hi: int) -> Sequence[bool]:
        """Free-queue membership of blocks ``lo..hi-1`` (read only when counts disagree)."""

    def request_ids(self) -> list[str]:
        """Every request that has a block table in the engine now."""

    def request_blocks(self, request_id: str) -> list[int]:
        """That request's block ids, per the engine's own tables."""

    def num_free(self) -> int:
        """The pool's own free-block count."""


@dataclass(frozen=True, slots=True)
class OnlineOptions:
    """How much the online audit may cost, and how it judges holds. Seconds, ratios."""

    budget_fraction: float = 0.005
    """Audit time per second of scheduler time (0.005: at most 0.5 % of it)."""
    max_pause_seconds: float = 0.002
    """Most audit time banked for one step, so that an idle gap never buys a long pause."""
    slice_blocks: int = 256
    """Most blocks judged per unit of work."""
    claim_requests: int = 16
    """Most request tables claimed per unit of work."""
    delayed_free_bound_seconds: float = 30.0
    """A delayed or deferred free is legitimate for this long after it began."""


class StepBudget:
    """Audit time earned per step, in seconds: a token bucket on measured time."""

    def __init__(self, fraction: float, max_credit: float) -> None:
        self.fraction = fraction
        self.max_credit = max_credit
        self.credit = 0.0

    def earn(self, step_seconds: float) -> float:
        """Add ``fraction`` x the engine time one step took; returns the credit (seconds)."""
        if step_seconds > 0.0:
            self.credit = min(self.credit + self.fraction * step_seconds, self.max_credit)
        return self.credit

    def spend(self, seconds: float) -> None:
        self.credit -= seconds


@dataclass(slots=True)
class SweepResult:
    """One completed sweep: block states over the sweep and the confirmed findings."""

    sweep: int
    """1-based, since the last restart."""
    states: PoolReport
    """Each block counted once, at the moment its slice was read (not one instant); its
    ``num_free_reported`` is the engine's count when the sweep ended."""
    findings: list[Finding]
    steps: int
    seconds: float
    busy_seconds: float
    """Audit time spent in this sweep."""
    can_confirm: bool
    """False for the first sweep after a restart: nothing can have been seen twice yet."""

    def reconciliation(self) -> Reconciliation:
        return Reconciliation(states=self.states, findings=self.findings,
                              finished_requests_holding=len({
                                  f.request_id for f in self.findings if f.request_id}),
                              num_free_observed=self.states[BlockState.FREE]
                              + self.states[BlockState.CACHED])


@dataclass(slots=True)
class OnlineStats:
    """Counters of the online audit (monotonic ones survive restarts)."""

    sweeps_total: int = 0
    busy_seconds_total: float = 0.0
    blocks_audited_total: int = 0
    confirmed_total: int = 0
    """Blocks ever confirmed as suspect."""
    restarts_total: int = 0
    last_sweep_steps: int = 0
    last_sweep_seconds: float = 0.0
    last_sweep_busy_seconds: float = 0.0
    last_sweep_at: float | None = None
    """Unix time the last sweep ended."""


@dataclass(slots=True)
class _Judged:
    """One slice, judged: state counts of the checked blocks and their suspects."""

    counts: dict[BlockState, int] = field(default_factory=lambda: {s: 0 for s in BlockState})
    suspects: dict[int, Fingerprint] = field(default_factory=dict)
    n_positive: int = 0
    """Checked blocks with ref count > 0 (they must be out of the free queue)."""
    cached: int = 0
    """Checked blocks with a prefix hash."""


@dataclass(slots=True)
class _Confirmed:
    fingerprint: Fingerprint
    findings: list[Finding] = field(default_factory=list)


class OnlineAuditor:
    """Sweeps the pool at step boundaries within a time budget; confirms suspects twice.

    Call :meth:`tick` once per engine step, on the engine thread, between steps, and
    :meth:`work` when it returns True (:meth:`step` does both). Not thread-safe (like the
    ledger it reads).
    """

    def __init__(self, pool: PoolAccess, ledger: OwnershipLedger, opts: OnlineOptions) -> None:
        self.pool = pool
        self.ledger = ledger
        self.opts = opts
        self.budget = StepBudget(opts.budget_fraction, opts.max_pause_seconds)
        self.stats = OnlineStats()
        self.confirmed: dict[int, _Confirmed] = {}
        """Blocks seen suspect with one fingerprint on two consecutive audits."""
        self._seen: dict[int, Fingerprint] = {}
        self._forget()

    # ------------------------------------------------------------- lifecycle
    def restart(self) -> None:
        """Forget suspects and start a new sweep (after the ledger was reset or rebuilt)."""
        self.stats.restarts_total += 1
        self._forget()

    def _forget(self) -> None:
        self.confirmed.clear()
        self._seen.clear()
        self._sweep = 0
        self._begin_sweep()

    def _begin_sweep(self) -> None:
        self._claim_ids: list[str] | None = None
        self._claim_pos = 0
        self._cursor = 0
        self._steps = 0
        self._busy = 0.0
        self._started: float | None = None
        self._counts = {s: 0 for s in BlockState}

    @property
    def pending_blocks(self) -> int:
        """Blocks seen suspect once, waiting for their second audit."""
        return len(self._seen)

    # ------------------------------------------------------------------ step
    def step(self, step_seconds: float, wall: float) -> SweepResult | None:
        """One step boundary: :meth:`tick`, then :meth:`work` if it earned any credit."""
        return self.work(wall) if self.tick(step_seconds) else None

    def tick(self, step_seconds: float) -> bool:
        """Count one engine step and earn budget for its ``step_seconds`` of engine time.
        True when there is credit to spend. Runs at every step, and on most steps there is
        none (a unit of work costs many steps' credit): kept to two calls."""
        self._steps += 1
        if self._started is None:
            self._started = perf_counter()
        return self.budget.earn(step_seconds) > 0.0

    def work(self, wall: float) -> SweepResult | None:
        """Spend the earned credit on units of work (at least one).

        ``wall``: Unix time (for hold bounds and reports). Returns the sweep's result
        when this completed one.
        """
        credit = self.budget.credit
        if credit <= 0.0:
            return None
        now = t0 = perf_counter()
        done = False
        spent = 0.0
        while spent < credit:
            done = self._unit(wall)
            spent = perf_counter() - t0
            if done:
                break
        self._busy += spent
        if not done:
            self.charge(spent)
            return None
        result = self._end_sweep(now + spent, wall)
        # Ending a sweep (its report of block states, its findings) is audit work too: on
        # a small pool sweeps end every few steps, and uncharged it would exceed the budget.
        self.charge(perf_counter() - t0)
        return result

    def charge(self, seconds: float) -> None:
        """Count ``seconds`` of audit work against the budget (and in the totals): the
        auditor's own, and what its caller does with a sweep's result."""
        self.budget.spend(seconds)
        self.stats.busy_seconds_total += seconds

    def _unit(self, wall: float) -> bool:
        """One unit of work; True when it completed the sweep."""
        if self._claim_ids is None:
            self._claim_ids = self.pool.request_ids()
        if self._claim_pos < len(self._claim_ids):
            self._claim_some()
            return False
        return self._audit_slice(wall)

    def _claim_some(self) -> None:
        ids = cast(list[str], self._claim_ids)
        chunk = ids[self._claim_pos:self._claim_pos + self.opts.claim_requests]
        self._claim_pos += len(chunk)
        for rid in chunk:
            self.ledger.claim(RequestId(rid), self.pool.request_blocks(rid))

    def _end_sweep(self, now: float, wall: float) -> SweepResult:
        self._sweep += 1
        st = self.stats
        st.sweeps_total += 1
        st.last_sweep_steps = self._steps
        st.last_sweep_seconds = now - (self._started if self._started is not None else now)
        st.last_sweep_busy_seconds = self._busy
        st.last_sweep_at = wall
        capacity = self.pool.num_blocks - len(self.pool.null_block_ids)
        result = SweepResult(
            sweep=self._sweep,
            states=PoolReport.from_counts(capacity=capacity, counts=self._counts,
                                          num_free_reported=self.pool.num_free()),
            findings=self.findings(wall),
            steps=self._steps, seconds=st.last_sweep_seconds, busy_seconds=self._busy,
            can_confirm=self._sweep >= 2)
        self._begin_sweep()
        return result

    # ------------------------------------------------------------- judging
    def _audit_slice(self, wall: float) -> bool:
        n = self.pool.num_blocks
        lo = self._cursor
        hi = min(lo + self.opts.slice_blocks, n)
        self._cursor = hi
        if lo >= hi:
            return True
        refs, cached, n_out = self.pool.read(lo, hi)  # a PoolSlice
        ids = range(lo, hi)
        owners = cast(Mapping[int, object], self.ledger.owners_map())
        unattr = cast(Mapping[int, int], self.ledger.unattributed_map())
        check = set(compress(ids, refs))
        if owners:
            check |= owners.keys() & ids
        if unattr:
            check |= unattr.keys() & ids
        nulls_here = [b for b in self.pool.null_block_ids if lo <= b < hi]
        check.difference_update(nulls_here)
        judged = self._judge(lo, refs, cached, check, None, wall)
        if n_out is not None and n_out != judged.n_positive + len(nulls_here):
            # Some block's free-queue membership contradicts its ref count: judge every
            # block of this slice again, with its membership (a corrupt pool; rare).
            in_q = self.pool.in_free_queue(lo, hi)
            check = set(ids).difference(nulls_here)
            judged = self._judge(lo, refs, cached, check, in_q, wall)
        else:
            in_q = None
        counts = self._counts
        for state, k in judged.counts.items():
            counts[state] += k
        # Blocks not checked: ref count 0, no owner, in the free queue (or unknown).
        rest = (hi - lo) - len(check) - len(nulls_here)
        cached_rest = (hi - lo) - count_falsy(cached) - judged.cached \
            - sum(1 for b in nulls_here if cached[b - lo])
        counts[BlockState.CACHED] += cached_rest
        counts[BlockState.FREE] += rest - cached_rest
        self.stats.blocks_audited_total += hi - lo
        self._confirm(lo, hi, refs, cached, in_q, judged.suspects, wall)
        return hi >= n

    def _judge(self, lo: int, refs: list[int], cached: Sequence[object], check: set[int],
               in_q: Sequence[bool] | None, wall: float) -> _Judged:
        """Judge the blocks in ``check`` (ids; ``refs``/``cached`` start at ``lo``).

        The common case, one reference held by one live owner, takes a few dict lookups;
        everything else goes through :func:`judge_fingerprint`.
        """
        ledger = self.ledger
        owners_get = cast(Mapping[int, object], ledger.owners_map()).get
        unattr = cast(Mapping[int, int], ledger.unattributed_map())
        records_get = ledger.records_map().get
        bound = self.opts.delayed_free_bound_seconds
        finished = RequestPhase.FINISHED
        out = _Judged()
        counts = out.counts
        suspects = out.suspects
        fast = n_pos = n_cached = 0
        for b in check:
            i = b - lo
            rc = refs[i]
            if rc == 1 and in_q is None:
                o = owners_get(b)
                if o.__class__ is str and b not in unattr:
                    rec = records_get(cast(RequestId, o))
                    if rec is not None and rec.phase is not finished:
                        fast += 1
                        if cached[i]:
                            n_cached += 1
                        continue
            if rc > 0:
                n_pos += 1
            is_cached = bool(cached[i])
            if is_cached:
                n_cached += 1
            state, fp = judge_fingerprint(
                BlockId(b), rc, is_cached, None if in_q is None else bool(in_q[i]),
                ledger, wall, bound)
            counts[state] += 1
            if fp is not None:
                suspects[b] = fp
        counts[BlockState.ACTIVE] += fast
        out.n_positive = n_pos + fast
        out.cached = n_cached
        return out

    def _confirm(self, lo: int, hi: int, refs: list[int], cached: Sequence[object],
                 in_q: Sequence[bool] | None, suspects: dict[int, Fingerprint],
                 wall: float) -> None:
        ids = range(lo, hi)
        # Blocks audited clean now lose any earlier suspicion.
        for d in (self._seen, self.confirmed):
            if d:
                for b in (d.keys() & ids) - suspects.keys():
                    del d[b]
        for b, fp in suspects.items():
            c = self.confirmed.get(b)
            if c is not None:
                if c.fingerprint == fp:
                    continue
                del self.confirmed[b]
            elif self._seen.get(b) == fp:
                del self._seen[b]
                findings = judge_block(
                    BlockId(b), refs[b - lo], bool(cached[b - lo]),
                    None if in_q is None else bool(in_q[b - lo]), self.ledger,
                    ReconcileOptions(now=wall, evidence=Evidence.ONLINE,
                                     delayed_free_bound_seconds=(
                                         self.opts.delayed_free_bound_seconds)))
                # The same classifier judged the fingerprint: a suspect always has findings.
                self.confirmed[b] = _Confirmed(fp, findings)
                self.stats.confirmed_total += 1
                continue
            self._seen[b] = fp

    def findings(self, wall: float) -> list[Finding]:
        """Confirmed suspects grouped per (cause, request, path), like a drained audit's."""
        groups: dict[tuple[object, ...], Finding] = {}
        for b in sorted(self.confirmed):
            for one in self.confirmed[b].findings:
                key = (one.cause, one.request_id, one.path)
                f = groups.get(key)
                if f is None:
                    f = Finding(cause=one.cause, path=one.path, blocks=0,
                                request_id=one.request_id,
                                client_request_id=one.client_request_id,
                                finish_reason=one.finish_reason,
                                held_for_seconds=_held_for(self.ledger, one, wall),
                                evidence=Evidence.ONLINE, detail=one.detail)
                    groups[key] = f
                f.add_block(b)
        return sorted(groups.values(),
                      key=lambda f: (f.cause.value, -f.blocks, f.request_id or ""))


def _held_for(ledger: OwnershipLedger, f: Finding, wall: float) -> float | None:
    rec = ledger.record(f.request_id) if f.request_id is not None else None
    if rec is None or rec.finished_at is None:
        return f.held_for_seconds
    return max(0.0, wall - rec.finished_at)


def judge_fingerprint(
    b: BlockId, rc: int, is_cached: bool, in_free_queue: bool | None,
    ledger: OwnershipLedger, now: float, bound: float,
) -> tuple[BlockState, Fingerprint | None]:
    """A block's state between steps, and its fingerprint when it is suspect.

    The shared classifier (:func:`kvguard.core.classify.classify_block`) with the
    between-steps hold rule: a delayed or deferred free within ``bound`` seconds is
    legitimate, and a reference no request has claimed yet is suspect with its
    acquisition's serial in the fingerprint, so it confirms only if the same reference
    stays unclaimed through a whole claim phase.
    """
    dbl = ledger.latest_double_free(b) if ledger.num_double_frees else None
    j = classify_block(b, rc, is_cached, in_free_queue, ledger,
                       HoldRule(now=now, bound_seconds=bound, between_steps=True), dbl)
    return j.state, j.fingerprint
