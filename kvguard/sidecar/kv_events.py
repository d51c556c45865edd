"""``KvEventsWatch``: the sidecar's KV-event mirror check, one subscriber per engine.

Owned by the sidecar's refresh task (``update`` after each refresh of the state files); HTTP
handlers and the metrics collector read ``checks`` and the subscribers' counters. For every
engine whose state says it publishes KV events (``EngineState.kv_events``: data-parallel
ranks each have their own endpoint, vLLM offsets it per rank), it keeps one
:class:`~kvguard.kv_events.subscriber.KvEventSubscriber` connected to that endpoint, and
judges the engine's latest pool snapshot against the mirror at the snapshot's sequence number
(:func:`~kvguard.kv_events.verdict.judge`). A subscriber starts when the engine's state first
names its endpoint and is replaced when the endpoint changes; batches published before it
connected come from the replay endpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvguard.core.state import EngineState
from kvguard.kv_events.subscriber import KvEventSubscriber, SubscriberOptions
from kvguard.kv_events.verdict import KvEventsCheck, KvEventsVerdict, MirrorFacts, judge

InputFilterFactory = Callable[[str], Callable[[int, bool], bool] | None]
"""Engine name -> a subscriber input filter (tests only, see KvEventSubscriber)."""


@dataclass(slots=True)
class WatchedEngine:
    subscriber: KvEventSubscriber
    endpoint: str
    epoch: str
    """The engine epoch the mirror started for (updated when the subscriber sees a restart)."""
    restarts_seen: int = 0
    judged: tuple[object, ...] | None = None
    """What the last verdict was computed from: unchanged, it is not computed again (a
    comparison copies the mirror's keys; the store refreshes every half second)."""


class KvEventsWatch:
    def __init__(self, *, replay: bool = True, receive_hwm: int = 0,
                 input_filter_for: InputFilterFactory | None = None) -> None:
        """``replay``: ask the engine's replay endpoint for missed batches (off: a router
        without replay, whose gaps stay open). ``receive_hwm``: each subscriber's ZMQ
        receive high-water mark in batches (0: unbounded; a bounded one drops on this side
        when the subscriber falls behind, as a router with a small queue does)."""
        self.engines: dict[str, WatchedEngine] = {}
        self.replay = replay
        self.receive_hwm = receive_hwm
        self.checks: dict[str, KvEventsCheck] = {}
        self._input_filter_for = input_filter_for

    def update(self, states: Iterable[EngineState], now: float | None = None) -> None:
        """Follow every engine in ``states`` that publishes KV events and judge its mirror."""
        now = time.time() if now is None else now
        for st in states:
            kv = st.kv_events
            if kv is None:
                continue
            w = self.engines.get(st.engine)
            if w is None or w.endpoint != kv.endpoint:
                if w is not None:
                    w.subscriber.close()
                flt = self._input_filter_for(st.engine) if self._input_filter_for else None
                sub = KvEventSubscriber(SubscriberOptions(
                    endpoint=kv.endpoint,
                    replay_endpoint=kv.replay_endpoint if self.replay else None, topic=kv.topic,
                    medium=kv.medium, receive_hwm=self.receive_hwm), input_filter=flt)
                sub.start()
                w = self.engines[st.engine] = WatchedEngine(sub, kv.endpoint, st.epoch)
            sub = w.subscriber
            if sub.restarts_total != w.restarts_seen:
                w.restarts_seen = sub.restarts_total
                w.epoch = st.epoch
            snap = kv.snapshot
            if snap is not None:
                sub.want_through(snap.last_seq)
            with sub.lock:
                m = sub.mirror
                key = (st.epoch, w.epoch, snap, m.batches_applied, m.last_seq, sub.gap_open,
                       sub.restarts_total)
                if key == w.judged and st.engine in self.checks:
                    continue
                view = m.view_at(snap.last_seq) if snap is not None else None
                facts = MirrorFacts(last_seq=m.last_seq, clear_seq=m.clear_seq,
                                    lost_since_reset=sub.gap_open, epoch=w.epoch)
            w.judged = key
            check = judge(snap, view, facts, engine_epoch=st.epoch, now=now)
            if check.verdict is KvEventsVerdict.CONSISTENT:
                sub.mark_in_sync()
            self.checks[st.engine] = check

    def close(self) -> None:
        for w in self.engines.values():
            w.subscriber.close()
        self.engines.clear()
