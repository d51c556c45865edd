"""``VllmTransfers``: the :class:`~kvguard.core.transfers.TransferSource` of one vLLM engine.

What kvguard reads from vLLM's KV connector in P/D disaggregation (vLLM 0.32):

- The scheduler's connector (``Scheduler.connector``): its class, ``kv_role`` and, for
  NIXL, ``connector_scheduler.engine_id`` (what the decode side's ``remote_engine_id``
  names) and ``_reqs_need_send`` (leases granted at ``request_finished``, not yet
  handed to the worker), in ``time.perf_counter`` seconds.
- The worker's connector, where it lives in this process (the uniprocess executor of a
  one-worker engine; vLLM's ``get_kv_transfer_group()``): NIXL's
  ``connector_worker._reqs_to_send``, the live lease of every held request, which the
  decode side's heartbeats extend. Its lease reaper (``_reap_expired_send_leases``) and
  its notification read (``nixl_wrapper.get_new_notifs``) are wrapped to learn which
  leases lapsed, after how many reads, and which reads arrived after that.

With a multi-process executor the worker is elsewhere: :meth:`hold_deadlines` returns
``None`` and the configured bound (``connector_bounds``) applies; ``hold_source`` says
which. Everything is read with ``getattr`` and every wrapper passes the engine's own
result through unchanged; a failure inside one is counted by the session's containment
(here: swallowed and counted in ``errors``) and never reaches the engine.

Worker-side wrappers may run on another thread than the scheduler's: they only append
to a ``deque`` that :meth:`drain_events` empties on the scheduler thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from kvguard.core.transfers import TransferEvent, TransferEventKind, TransferOutcome, TransferRole
from kvguard.vllm_plugin.connector_bounds import connector_hold_bound

MAX_QUEUED_EVENTS = 4096
"""Worker-side events kept until the scheduler thread reads them (oldest dropped)."""


def _unix(perf_deadline: float, now_unix: float, now_perf: float) -> float:
    return now_unix + (perf_deadline - now_perf)


class VllmTransfers:
    """One scheduler's KV connector. Built only when the engine has one."""

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler
        self._connector = getattr(scheduler, "connector", None)
        vllm_config = getattr(scheduler, "vllm_config", None)
        kv = getattr(vllm_config, "kv_transfer_config", None)
        self._connector_name = str(getattr(kv, "kv_connector", None)
                                   or type(self._connector).__name__)
        role = getattr(kv, "kv_role", None)
        self._kv_role = str(role) if role is not None else None
        cs = getattr(self._connector, "connector_scheduler", None)
        engine_id = getattr(cs, "engine_id", None) or getattr(kv, "engine_id", None)
        self._kv_engine_id = str(engine_id) if engine_id is not None else None
        self._fallback = connector_hold_bound(vllm_config)
        self._sched_leases: Mapping[str, float] | None = None
        self._worker: Any = None
        self._worker_wrapped = False
        self._events: deque[TransferEvent] = deque(maxlen=MAX_QUEUED_EVENTS)
        self.errors = 0
        """Failures inside the worker-side wrappers (contained)."""

    # --------------------------------------------------------------- identity
    @property
    def connector(self) -> str:
        return self._connector_name

    @property
    def kv_role(self) -> str | None:
        return self._kv_role

    @property
    def kv_engine_id(self) -> str | None:
        return self._kv_engine_id

    @property
    def hold_source(self) -> str:
        if self._find_worker() is not None:
            return (f"{self._connector_name} live leases (renewed by the decode side's "
                    "heartbeats)")
        return f"configured bound: {self._fallback.source}"

    # ----------------------------------------------------------------- worker
    def _find_worker(self) -> Any:
        """NIXL's worker-side connector when it lives in this process, else ``None``."""
        if self._worker is not None:
            return self._worker
        try:
            from vllm.distributed.kv_transfer import kv_transfer_state
        except Exception:
            return None
        agent = getattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", None)
        worker = getattr(agent, "connector_worker", None)
        if worker is None or not isinstance(getattr(worker, "_reqs_to_send", None), dict):
            return None
        self._worker = worker
        self._wrap_worker(worker)
        return worker

    def _wrap_worker(self, worker: Any) -> None:
        if self._worker_wrapped:
            return
        self._worker_wrapped = True
        reap = getattr(worker, "_reap_expired_send_leases", None)
        if callable(reap):
            worker._reap_expired_send_leases = self._wrapped_reap(worker, reap)
        wrapper: Any = getattr(worker, "nixl_wrapper", None)
        notifs = getattr(wrapper, "get_new_notifs", None)
        if wrapper is not None and callable(notifs):
            try:
                wrapper.get_new_notifs = self._wrapped_notifs(worker, notifs)
            except Exception:  # a C extension object without a __dict__: no late reads
                self.errors += 1

    def _wrapped_reap(self, worker: Any, orig: Callable[..., Any]) -> Callable[..., Any]:
        def _reap_expired_send_leases(done_sending: Any, *args: Any, **kwargs: Any) -> Any:
            if not getattr(worker, "_reqs_to_send", None):
                return orig(done_sending, *args, **kwargs)  # no lease: nothing can lapse
            before: dict[str, int] = {}
            expected: dict[str, int] = {}
            try:
                before = dict(getattr(worker, "consumer_notification_counts_by_req", {}))
                expected = dict(getattr(worker, "expected_consumer_notifications_by_req", {}))
                held = set(worker._reqs_to_send)
            except Exception:
                self.errors += 1
                held = set()
            ret = orig(done_sending, *args, **kwargs)
            try:
                if held:
                    now = time.time()
                    for rid in held - set(worker._reqs_to_send):
                        reads = int(before.get(rid, 0))
                        want = int(expected.get(rid, 1) or 1)
                        outcome = (TransferOutcome.EXPIRED_UNREAD if reads == 0 else
                                   TransferOutcome.EXPIRED_PARTLY_READ if reads < want else
                                   TransferOutcome.READ)
                        self._events.append(TransferEvent(
                            TransferEventKind.ENDED, str(rid), now, outcome=outcome,
                            reads=reads))
            except Exception:
                self.errors += 1
            return ret
        return _reap_expired_send_leases

    def _wrapped_notifs(self, worker: Any, orig: Callable[..., Any]) -> Callable[..., Any]:
        def get_new_notifs(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            try:
                for notifs in out.values():  # usually none: nothing to do per step
                    for n in notifs:
                        msg = n.decode("utf-8") if isinstance(n, bytes | bytearray) else str(n)
                        if msg.startswith("HB:"):
                            continue  # a lease renewal, not a read
                        rid = msg.rsplit(":", 1)[0]
                        if rid not in worker._reqs_to_send and rid not in getattr(
                                worker, "_reqs_to_process", ()):
                            self._events.append(TransferEvent(
                                TransferEventKind.LATE_READ, rid, time.time()))
            except Exception:
                self.errors += 1
            return out
        return get_new_notifs

    # ------------------------------------------------------------------ reads
    def hold_deadlines(self) -> dict[str, float] | None:
        worker = self._find_worker()
        if worker is None:
            return None
        now_unix, now_perf = time.time(), time.perf_counter()
        out: dict[str, float] = {}
        cs = getattr(self._connector, "connector_scheduler", None)
        for src in (getattr(cs, "_reqs_need_send", None), getattr(worker, "_reqs_to_send", None)):
            if not isinstance(src, dict):
                continue
            for _ in range(3):  # the worker thread may change the dict while it is copied
                try:
                    items = list(src.items())
                    break
                except RuntimeError:
                    items = []
            for rid, deadline in items:
                if isinstance(deadline, int | float):
                    out[str(rid)] = _unix(float(deadline), now_unix, now_perf)
        return out

    def drain_events(self) -> list[TransferEvent]:
        out: list[TransferEvent] = []
        while self._events:
            out.append(self._events.popleft())
        return out

    # ---------------------------------------------------- scheduler-side events
    def admitted(self, request: Any, at: float) -> TransferEvent | None:
        """A decode-side request that will read its KV from a remote prefill engine."""
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict) or not params.get("do_remote_prefill"):
            return None
        engine = params.get("remote_engine_id")
        remote = params.get("remote_request_id")
        return TransferEvent(TransferEventKind.STARTED, str(request.request_id), at,
                             role=TransferRole.DECODE,
                             remote_engine_id=str(engine) if engine is not None else None,
                             remote_request_id=str(remote) if remote is not None else None)

    @staticmethod
    def hold_started(request: Any, at: float) -> TransferEvent | None:
        """A prefill-side request whose blocks vLLM keeps for a remote decode read."""
        params = getattr(request, "kv_transfer_params", None)
        if not isinstance(params, dict) or not params.get("do_remote_decode"):
            return None
        return TransferEvent(TransferEventKind.STARTED, str(request.request_id), at,
                             role=TransferRole.PREFILL)

    def connector_output(self, output: Any, at: float) -> list[TransferEvent]:
        """What ``Scheduler._update_from_kv_xfer_finished`` is about to apply: queued
        worker events first (a lapsed lease is also in ``finished_sending``)."""
        events = self.drain_events()
        for rid in getattr(output, "finished_recving", None) or ():
            events.append(TransferEvent(TransferEventKind.ENDED, str(rid), at,
                                        outcome=TransferOutcome.RECEIVED))
        for rid in getattr(output, "failed_recving", None) or ():
            events.append(TransferEvent(TransferEventKind.ENDED, str(rid), at,
                                        outcome=TransferOutcome.FAILED))
        # With the worker in this process its reaper reported lapsed leases (queued above),
        # so what is left ended by a read; out of process, read and lapse look the same.
        sent = TransferOutcome.READ if self._find_worker() is not None \
            else TransferOutcome.RELEASED
        for rid in getattr(output, "finished_sending", None) or ():
            events.append(TransferEvent(TransferEventKind.ENDED, str(rid), at, outcome=sent))
        return events


def transfers_of(scheduler: Any) -> VllmTransfers | None:
    """The transfer source of a scheduler with a KV connector, else ``None``."""
    if getattr(scheduler, "connector", None) is None:
        return None
    return VllmTransfers(scheduler)
