"""``VllmTransfers``: the :class:`~kvguard.core.transfers.TransferSource` of one vLLM engine.

What kvguard reads from vLLM's KV connector in P/D disaggregation (vLLM 0.32-0.34; per
release in :mod:`kvguard.vllm_plugin.versions`):

- The scheduler's connector (``Scheduler.connector``): its class, ``kv_role`` and, for
  NIXL, ``connector_scheduler.engine_id`` (what the decode side's ``remote_engine_id``
  names) and ``_reqs_need_send`` (leases granted at ``request_finished``, not yet
  handed to the worker), in ``time.perf_counter`` seconds.
- The worker side, wherever it runs (a ``Worker`` process per rank with the
  multiprocess executor, EngineCore with the one-process one): its worker half
  (:mod:`kvguard.vllm_plugin.worker_half`) reports every step, in the step's
  ``kv_connector_worker_meta``, the leases it holds (renewals included), the leases that
  lapsed and after how many reads, reads that arrived after that, and the rank's
  finished transfers. :class:`~kvguard.core.worker_reports.RankJoin` joins the ranks:
  a hold ends when every rank let go, and ended expired when a lease lapsed on any.

Until a worker half has reported, :meth:`hold_deadlines` returns ``None`` and the
configured bound (``connector_bounds``) applies; ``hold_source`` says which, and where
the leases come from. Every vLLM name is read through its row of
:mod:`kvguard.vllm_plugin.versions` (``read``); the worker half's own
failures are counted there and reach the session as ``errors``.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kvguard.core.transfers import (
    TransferEvent,
    TransferEventKind,
    TransferOutcome,
    TransferRole,
    WorkerRankState,
)
from kvguard.core.worker_reports import RankJoin
from kvguard.vllm_plugin.connector_bounds import connector_hold_bound
from kvguard.vllm_plugin.versions import (
    KV_CONNECTOR,
    KV_ENGINE_ID,
    KV_ROLE,
    NIXL_CONNECTOR_SCHEDULER,
    NIXL_REQS_NEED_SEND,
    NIXL_SCHEDULER_ENGINE_ID,
    OUTPUT_FAILED_RECVING,
    OUTPUT_FINISHED_RECVING,
    OUTPUT_FINISHED_SENDING,
    OUTPUT_WORKER_META,
    REQUEST_KV_TRANSFER_PARAMS,
    SCHEDULER_CONNECTOR,
    SCHEDULER_VLLM_CONFIG,
    VLLM_KV_TRANSFER_CONFIG,
    read,
)
from kvguard.vllm_plugin.worker_half import maybe_install_in_process, reports_of


def _unix(perf_deadline: float, now_unix: float, now_perf: float) -> float:
    return now_unix + (perf_deadline - now_perf)


class VllmTransfers:
    """One scheduler's KV connector. Built only when the engine has one."""

    def __init__(self, scheduler: Any) -> None:
        self._scheduler = scheduler
        self._connector = read(scheduler, SCHEDULER_CONNECTOR)
        vllm_config = read(scheduler, SCHEDULER_VLLM_CONFIG)
        kv = read(vllm_config, VLLM_KV_TRANSFER_CONFIG)
        self._connector_name = str(read(kv, KV_CONNECTOR) or type(self._connector).__name__)
        role = read(kv, KV_ROLE)
        self._kv_role = str(role) if role is not None else None
        cs = read(self._connector, NIXL_CONNECTOR_SCHEDULER)
        engine_id = read(cs, NIXL_SCHEDULER_ENGINE_ID) or read(kv, KV_ENGINE_ID)
        self._kv_engine_id = str(engine_id) if engine_id is not None else None
        self._fallback = connector_hold_bound(vllm_config)
        self.join = RankJoin()
        """The worker halves' reports, joined across ranks."""
        # The one-process executor built the worker (and its connector) in this process
        # before the scheduler: give it its worker half if no plugin did.
        maybe_install_in_process(vllm_config)

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
        join = self.join
        if not join.reporting:
            return f"configured bound: {self._fallback.source}"
        where = ("its worker in EngineCore (one-process executor)"
                 if join.pids == {os.getpid()} else
                 f"kvguard's worker half in {join.world_size} worker process"
                 + ("es" if join.world_size > 1 else ""))
        return (f"{self._connector_name} live leases (renewed by the decode side's "
                f"heartbeats), reported by {where}")

    @property
    def errors(self) -> int:
        """Failures contained inside the worker halves, all ranks."""
        return sum(c.errors_total for c in self.join.ranks.values())

    def worker_ranks(self) -> list[WorkerRankState]:
        return [WorkerRankState(
            rank=c.rank, pid=c.pid, reports_total=c.reports_total,
            lease_lapses_total=c.lapses_total, late_reads_total=c.late_reads_total,
            finished_sending_total=c.finished_sending_total,
            finished_recving_total=c.finished_recving_total, dropped_total=c.dropped_total,
            errors_total=c.errors_total) for c in sorted(self.join.ranks.values(),
                                                         key=lambda c: c.rank)]

    # ------------------------------------------------------------------ reads
    def hold_deadlines(self) -> dict[str, float] | None:
        if not self.join.reporting:
            return None
        out = self.join.deadlines()
        now_unix, now_perf = time.time(), time.perf_counter()
        cs = read(self._connector, NIXL_CONNECTOR_SCHEDULER)
        src = read(cs, NIXL_REQS_NEED_SEND)  # granted, not yet handed to the worker
        if isinstance(src, dict):
            for rid, deadline in list(src.items()):
                if isinstance(deadline, int | float) and str(rid) not in out:
                    out[str(rid)] = _unix(float(deadline), now_unix, now_perf)
        return out

    def drain_events(self) -> list[TransferEvent]:
        """Nothing is queued between steps: the worker halves' news arrives with each
        step's output (:meth:`connector_output`)."""
        return []

    # ---------------------------------------------------- scheduler-side events
    def admitted(self, request: Any, at: float) -> TransferEvent | None:
        """A decode-side request that will read its KV from a remote prefill engine."""
        params = read(request, REQUEST_KV_TRANSFER_PARAMS)
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
        params = read(request, REQUEST_KV_TRANSFER_PARAMS)
        if not isinstance(params, dict) or not params.get("do_remote_decode"):
            return None
        return TransferEvent(TransferEventKind.STARTED, str(request.request_id), at,
                             role=TransferRole.PREFILL)

    def connector_output(self, output: Any, at: float) -> list[TransferEvent]:
        """What ``Scheduler._update_from_kv_xfer_finished`` is about to apply: the worker
        halves' news first (a lapsed lease is also in ``finished_sending``)."""
        events = self.join.feed(reports_of(read(output, OUTPUT_WORKER_META)))
        for rid in read(output, OUTPUT_FINISHED_RECVING) or ():
            events.append(TransferEvent(TransferEventKind.ENDED, str(rid), at,
                                        outcome=TransferOutcome.RECEIVED))
        for rid in read(output, OUTPUT_FAILED_RECVING) or ():
            events.append(TransferEvent(TransferEventKind.ENDED, str(rid), at,
                                        outcome=TransferOutcome.FAILED))
        # With a worker half reporting, a lapse was reported above (the same step), so
        # what is left ended by reads; without one, read and lapse look the same.
        sent = TransferOutcome.READ if self.join.reporting else TransferOutcome.RELEASED
        for rid in read(output, OUTPUT_FINISHED_SENDING) or ():
            events.append(TransferEvent(TransferEventKind.ENDED, str(rid), at, outcome=sent))
        return events


def transfers_of(scheduler: Any) -> VllmTransfers | None:
    """The transfer source of a scheduler with a KV connector, else ``None``."""
    if read(scheduler, SCHEDULER_CONNECTOR) is None:
        return None
    return VllmTransfers(scheduler)
