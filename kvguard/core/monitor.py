"""The monitor Protocol: one kvguard feature, called by the guard session at its moments.

A :class:`~kvguard.core.session.GuardSession` is a coordinator. It owns the spine every
feature shares (the ownership ledger, the drained audit, the checkpoint counter and pace,
the report history and the published state) and a list of monitors, one per feature
(the online audit, P/D transfers, the offload audit, the KV-event snapshot, request
tracing, idle re-checks, memory attribution, the drain model), each in its own file under
:mod:`kvguard.core.monitors`. The session calls each monitor at the moments below, in
the order the monitors were attached; a monitor implements only the moments it needs and
inherits the do-nothing rest from :class:`BaseMonitor` (the session never calls a moment
a monitor did not override, so an unused moment costs nothing, not even on the hot path).

::

                 engine hooks ─┐                    ┌─ state file (sidecar, metrics, CLI)
                               ▼                    │
     ┌──────────── GuardSession (coordinator) ──────┴──────────────┐
     │ ledger · drained audit · checkpoint ids · pace · history     │
     └──┬──────┬──────┬──────┬──────┬──────┬──────┬──────┬─────────┘
        drain  P/D    offload idle  memory online KV-    tracing   (+ your monitor)
        model  trans. audit  re-   attrib. audit events
                             check

Writing a monitor (e.g. a verdict computed between steps):

1. Subclass :class:`BaseMonitor`; set :attr:`~BaseMonitor.name` (the label its contained
   failures are counted under in ``kvguard_hook_errors_total``).
2. Take a :class:`MonitorHost` (the session) in the constructor for what the spine
   offers: the engine adapter (``host.adapter.activity()`` says what runs and waits), the
   ledger, the settings, containment, a new checkpoint id and recording a report.
3. Override the moments you need. Every moment runs on the engine's scheduler thread,
   between steps, must not block, and must stay cheap where it runs per step
   (:meth:`~Monitor.on_step_end`, :meth:`~Monitor.after_drain_check`: a budget of a few µs
   when there is nothing to do). Contain your own failures (``with host.contain(name):``)
   wherever the engine must go on without your answer; an exception that escapes a moment
   is counted under the engine hook that led to it.
4. Add your section of the published state: a key in :class:`StateSection` (and the
   same-named field in :class:`~kvguard.core.state.EngineState`), returned by
   :meth:`~Monitor.state_section`; add to a drained report in
   :meth:`~Monitor.on_drained_report` (``report.model_copy(update=...)``: reports are
   frozen).
5. Attach it: ``session.add_monitor(monitor)``.

A sketch (a verdict between steps on requests that wait; zero cost while none does)::

    class WaitWatch(BaseMonitor):
        name = "wait_watch"

        def __init__(self, host: MonitorHost) -> None:
            self.host = host
            self.waiting_since: float | None = None

        def after_drain_check(self, step_seconds: float | None) -> None:
            if step_seconds is None:
                return  # an abort path, not a step
            act = self.host.adapter.activity()
            if not act.waiting or act.running:
                self.waiting_since = None
            elif self.waiting_since is None:
                self.waiting_since = time.time()

        def state_section(self) -> StateSection:
            return {}  # e.g. {"wait_watch": WaitWatchState(...)} with its EngineState field

A verdict that deserves a report of its own builds one (:mod:`kvguard.core.checkpoint`)
with ``**host.stamp(taken_at)`` and hands it to ``host.record(report)`` (as the online
audit does); a part of every drained report goes in :meth:`Monitor.on_drained_report`.
The ledger (``host.ledger``) names each finished request still holding blocks and each
hold's deadline: read it, never write it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import NamedTuple, Protocol, TypedDict

from kvguard.config import KvguardConfig
from kvguard.core.checkpoint import ReportStamp
from kvguard.core.drain_model import DrainPrediction
from kvguard.core.engine import EngineAdapter
from kvguard.core.hook_errors import HookErrors
from kvguard.core.ledger import OwnershipLedger
from kvguard.core.offload import OffloadState
from kvguard.core.reclaim import ReclaimState
from kvguard.core.report import CheckpointReport, PoolReport
from kvguard.core.state import OnlineState, TracingState
from kvguard.core.transfers import TransferEvent, TransfersState
from kvguard.core.types import FinishReason, RequestId
from kvguard.core.wedge_monitor import WedgeState
from kvguard.kv_events.snapshot import KvEventsState


class DrainBlocker(NamedTuple):
    """Why a moment is not drained (:meth:`GuardSession.drain_blocker`)."""

    reason: str
    live_work: bool
    """Requests waiting or running (a later free re-arms the drain check)."""
    until: float | None = None
    """Unix s at which the blocking hold stops being legitimate (None: not a hold)."""


class StateSection(TypedDict, total=False):
    """A monitor's part of the published :class:`~kvguard.core.state.EngineState`: each key
    is the name of an ``EngineState`` field, owned by exactly one monitor (a field no
    monitor returns keeps its default, ``None``: the feature is off)."""

    drain: DrainPrediction
    transfers: TransfersState | None
    offload: OffloadState | None
    online: OnlineState | None
    kv_events: KvEventsState | None
    tracing: TracingState | None
    wedge: WedgeState | None
    reclaim: ReclaimState | None


class MonitorHost(Protocol):
    """What the session offers its monitors (the spine). Read on the engine's thread."""

    last_pool: PoolReport | None
    """The pool's states as last judged (a drained audit or an online sweep sets it)."""

    @property
    def adapter(self) -> EngineAdapter:
        """The engine: pool reads, block tables, ``activity()`` (running, waiting)."""

    @property
    def ledger(self) -> OwnershipLedger:
        """Who owns which block (the session feeds it; monitors read it)."""

    @property
    def engine(self) -> str:
        """The name the session publishes under."""

    @property
    def epoch(self) -> str: ...

    @property
    def config(self) -> KvguardConfig: ...

    @property
    def errors(self) -> HookErrors: ...

    @property
    def delayed_free_bound(self) -> float:
        """Seconds a delayed free may last (configured, else the engine's own bound)."""

    def contain(self, hook: str) -> AbstractContextManager[None]:
        """A block whose exception is counted under ``hook`` and not raised."""

    def take_id(self) -> int:
        """The next checkpoint id (every report, drained or not, takes one)."""

    def stamp(self, taken_at: float) -> ReportStamp:
        """A new report's stamp (:class:`~kvguard.core.checkpoint.ReportStamp`: the next
        checkpoint id, the engine, its epoch, ``taken_at``), made in this one place."""

    def record(self, report: CheckpointReport) -> CheckpointReport:
        """Keep ``report`` in the history, tell the monitors (:meth:`Monitor.on_report`),
        count it and publish the state."""

    def wake_after(self, seconds: float) -> None:
        """Have the idle engine call :meth:`GuardSession.on_idle` in ``seconds`` (earliest
        wake wins; nothing happens where the engine integration has no waker)."""

    def ledger_errors_since_checkpoint(self) -> int:
        """Hook failures that may have left the ledger short of events since it was last
        known whole (a drained checkpoint or a rebuild)."""

    def resync_ledger(self) -> None:
        """Rebuild the ledger from the engine's block tables (monitors hear
        :meth:`Monitor.on_ledger_reset`)."""


class Monitor(Protocol):
    """One feature of the guard session. Moments in the order they occur for one request
    and one step; units are seconds, ``at``/``now`` Unix seconds unless said otherwise."""

    name: str
    """The hook label its contained failures are counted under (e.g. ``transfers``)."""

    # -- request lifecycle (once per request and transition)
    def on_request_admitted(self, request_id: RequestId, at: float) -> None:
        """A request entered the engine."""

    def on_request_finished(self, request_id: RequestId, reason: FinishReason,
                            at: float) -> None:
        """A request finished; the ledger already knows (its blocks may still be held)."""

    def on_request_freed(self, request_id: RequestId, at: float) -> None:
        """The engine is done with the request; the ledger already knows."""

    def on_transfer(self, event: TransferEvent) -> None:
        """What the KV connector did for one request (P/D)."""

    # -- steps (hot path)
    def on_step_end(self, step_seconds: float | None) -> None:
        """A step ended (``step_seconds``: its scheduler time), or an abort path returned
        (None). Runs *before* the session decides whether this moment is drained: what a
        monitor learns here (a hold's new deadline) counts for that decision."""

    def after_drain_check(self, step_seconds: float | None) -> None:
        """The same step end, *after* the drain decision (and any drained report it made):
        work that must see its outcome. ``host.adapter.activity()`` says what is running
        and waiting now (read it only when needed: it is not free)."""

    def on_idle(self) -> bool:
        """The idle engine woke the session (:meth:`GuardSession.on_idle`). True: this
        monitor asks for a drained audit now."""

    # -- drained audit
    def drain_blocker(self, now: float) -> DrainBlocker | None:
        """Asked when the session found nothing of its own in the way of a drain: what of
        this feature keeps this moment from being drained (``until``: when it stops), or
        None."""

    def before_drained_audit(self, now: float) -> None:
        """A drained audit is about to read the pool (bring what the ledger is judged by
        up to date)."""

    def on_drained_report(self, report: CheckpointReport, now: float) -> CheckpointReport:
        """A drained report is being built: return it with this feature's part added (or
        unchanged). Called in monitor order; the result goes to the next monitor."""

    def on_report(self, report: CheckpointReport) -> None:
        """A report (drained, online or skipped) was recorded and is about to be published."""

    def on_ledger_reset(self) -> None:
        """The ledger started fresh (its records were incomplete): forget what refers to
        the old records."""

    def on_config_changed(self, config: KvguardConfig) -> None:
        """Settings were replaced at run time."""

    # -- published state and end
    def state_section(self) -> StateSection:
        """This feature's part of the published state (built at every publish: cheap)."""

    def close(self) -> None:
        """The engine shuts down."""


class BaseMonitor:
    """A monitor that does nothing at every moment: subclass it and override the moments
    a feature needs (the session calls only those)."""

    name = "monitor"

    def on_request_admitted(self, request_id: RequestId, at: float) -> None:
        return None

    def on_request_finished(self, request_id: RequestId, reason: FinishReason,
                            at: float) -> None:
        return None

    def on_request_freed(self, request_id: RequestId, at: float) -> None:
        return None

    def on_transfer(self, event: TransferEvent) -> None:
        return None

    def on_step_end(self, step_seconds: float | None) -> None:
        return None

    def after_drain_check(self, step_seconds: float | None) -> None:
        return None

    def on_idle(self) -> bool:
        return False

    def drain_blocker(self, now: float) -> DrainBlocker | None:
        return None

    def before_drained_audit(self, now: float) -> None:
        return None

    def on_drained_report(self, report: CheckpointReport, now: float) -> CheckpointReport:
        return report

    def on_report(self, report: CheckpointReport) -> None:
        return None

    def on_ledger_reset(self) -> None:
        return None

    def on_config_changed(self, config: KvguardConfig) -> None:
        return None

    def state_section(self) -> StateSection:
        return {}

    def close(self) -> None:
        return None


MOMENTS = ("on_request_admitted", "on_request_finished", "on_request_freed", "on_transfer",
           "on_step_end", "after_drain_check", "on_idle", "drain_blocker",
           "before_drained_audit", "on_drained_report", "on_report", "on_ledger_reset",
           "on_config_changed", "state_section", "close")
"""Every moment of :class:`Monitor`, by name."""


def overrides(monitor: Monitor, moment: str) -> bool:
    """Whether ``monitor`` does something at ``moment`` (a :class:`BaseMonitor` subclass
    that does not override it does nothing there; any other monitor is asked)."""
    if not isinstance(monitor, BaseMonitor):
        return True
    return getattr(type(monitor), moment) is not getattr(BaseMonitor, moment)
