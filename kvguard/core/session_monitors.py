"""The session's monitors: their slots in a fixed order, the moments' call lists, and the
public handles of the built-in features (``session.online``, ``session.tracer``, ...).

:class:`MonitorSlots` is the part of :class:`~kvguard.core.session.GuardSession` that
keeps its list of monitors (:mod:`kvguard.core.monitor`). The built-in features sit in
slots, in the order their moments run (the drain model first, tracing last); a slot is
None while its feature is off. Features the engine integration turns on after
construction (memory attribution, the KV-event snapshot, tracing) are set through the
properties below, as attributes always were. Monitors added with :meth:`add_monitor` run
after the built-in ones.
"""

from __future__ import annotations

from typing import Any

from kvguard.core.drain_model import DrainEstimator
from kvguard.core.monitor import MOMENTS, Monitor, MonitorHost, overrides
from kvguard.core.monitors.attribution import MemoryAttribution, MemoryAttributor
from kvguard.core.monitors.drain_forecast import DrainForecast
from kvguard.core.monitors.idle_recheck import IdleRecheck
from kvguard.core.monitors.kv_events import KvEventsMirror, KvEventsSource
from kvguard.core.monitors.offload import OffloadMonitor
from kvguard.core.monitors.online_audit import OnlineAudit
from kvguard.core.monitors.reclaim import ReclaimWatch
from kvguard.core.monitors.tracing import RequestTraces, RequestTracing
from kvguard.core.monitors.transfers import TransferMonitor
from kvguard.core.monitors.wedge import WedgeWatch
from kvguard.core.offload import OffloadAudit
from kvguard.core.online import OnlineAuditor
from kvguard.core.reclaim import Reclaimer
from kvguard.core.transfers import TransferLog
from kvguard.core.wedge_monitor import WedgeMonitor
from kvguard.kv_events.snapshot import KvEventsSnapshot


class MonitorSlots:
    """The monitors of one session (its subclass fills the slots in ``__init__``)."""

    drain_forecast: DrainForecast
    _transfers: TransferMonitor | None
    _offload: OffloadMonitor | None
    _idle: IdleRecheck
    _attribution: MemoryAttribution | None
    _online: OnlineAudit | None
    _kv_events: KvEventsMirror | None
    _tracing: RequestTracing | None
    _wedge: WedgeWatch | None
    _reclaim: ReclaimWatch | None
    _extra: list[Monitor]
    _moments: dict[str, list[Any]]
    """Moment name -> the bound methods of the monitors that act at it."""
    _step_end: list[Any]
    _after_drain_check: list[Any]

    def _host(self) -> MonitorHost:
        raise NotImplementedError

    @property
    def monitors(self) -> list[Monitor]:
        """The features on now, in the order their moments run."""
        slots: list[Monitor | None] = [
            self.drain_forecast, self._transfers, self._offload, self._idle,
            self._attribution, self._online, self._kv_events, self._tracing, self._wedge,
            self._reclaim]
        return [m for m in slots if m is not None] + self._extra

    def add_monitor(self, monitor: Monitor) -> None:
        """Attach a feature (:mod:`kvguard.core.monitor`); its moments run after the
        built-in features'."""
        self._extra.append(monitor)
        self._rebuild()

    def _rebuild(self) -> None:
        """Per moment, the bound methods of the monitors that act at it (so that a moment
        no monitor uses costs a loop over an empty list)."""
        ms = self.monitors
        self._moments = {moment: [getattr(m, moment) for m in ms if overrides(m, moment)]
                         for moment in MOMENTS}
        self._step_end = self._moments["on_step_end"]
        self._after_drain_check = self._moments["after_drain_check"]

    # Features the engine integration turns on after construction.
    @property
    def attributor(self) -> MemoryAttributor | None:
        return self._attribution.attributor if self._attribution is not None else None

    @attributor.setter
    def attributor(self, attributor: MemoryAttributor | None) -> None:
        self._attribution = (MemoryAttribution(self._host(), attributor)
                             if attributor is not None else None)
        self._rebuild()

    @property
    def kv_events(self) -> KvEventsSource | None:
        """The KV-event mirror check's engine side (None: the engine publishes no KV events)."""
        return self._kv_events.source if self._kv_events is not None else None

    @kv_events.setter
    def kv_events(self, source: KvEventsSource | None) -> None:
        self._kv_events = KvEventsMirror(self._host(), source) if source is not None else None
        self._rebuild()

    @property
    def kv_events_snapshot(self) -> KvEventsSnapshot | None:
        """Read at the last drained checkpoint."""
        return self._kv_events.snapshot if self._kv_events is not None else None

    @property
    def tracer(self) -> RequestTraces | None:
        """Findings into the requests' traces (set by the engine integration when an OTLP
        endpoint is configured; None: off, and no call is made)."""
        return self._tracing.tracer if self._tracing is not None else None

    @tracer.setter
    def tracer(self, tracer: RequestTraces | None) -> None:
        if self._tracing is not None:
            self._tracing.detach()
        self._tracing = (RequestTracing(self._host(), tracer, self.transfers)
                         if tracer is not None else None)
        self._rebuild()

    @property
    def wedge(self) -> WedgeMonitor | None:
        """The wedge verdict (set by the engine integration that can read what waits in
        the engine; None: off)."""
        return self._wedge.wedge if self._wedge is not None else None

    @wedge.setter
    def wedge(self, wedge: WedgeMonitor | None) -> None:
        self._wedge = WedgeWatch(self._host(), wedge) if wedge is not None else None
        self._reclaim = None  # it judges the old wedge monitor's verdicts: set it again
        self._rebuild()

    @property
    def reclaim(self) -> ReclaimWatch | None:
        """The opt-in reclaim (None: ``KVGUARD_RECLAIM`` off, or no wedge monitor)."""
        return self._reclaim

    def start_reclaim(self, reclaimer: Reclaimer, after_verdicts: int) -> ReclaimWatch:
        """Reclaim the dead owners the wedge monitor names (it must be set first); its
        moments run right after the wedge monitor's."""
        wedge = self.wedge
        if wedge is None:
            raise ValueError("reclaim needs the wedge monitor: set session.wedge first")
        self._reclaim = ReclaimWatch(self._host(), wedge, reclaimer, after_verdicts)
        self._rebuild()
        return self._reclaim

    @property
    def transfers(self) -> TransferLog | None:
        """The P/D transfer log (None: the engine has no KV connector)."""
        return self._transfers.log if self._transfers is not None else None

    @property
    def offload(self) -> OffloadAudit | None:
        """The offload job audit (None: the engine has no offloading connector)."""
        return self._offload.audit if self._offload is not None else None

    @property
    def online(self) -> OnlineAuditor | None:
        """The online audit (None: ``KVGUARD_ONLINE_AUDIT`` off)."""
        return self._online.auditor if self._online is not None else None

    @property
    def drain(self) -> DrainEstimator:
        """Arrival and completion rates for the drain prediction (fed by the events)."""
        return self.drain_forecast.estimator
