"""``VllmOffload``: the :class:`~kvguard.core.offload.OffloadSource` of vLLM's
OffloadingConnector (vLLM 0.32-0.34).

What it reads, all on the scheduler side (EngineCore), between steps, each name through its
row of :mod:`kvguard.vllm_plugin.versions` (``read``; the same in 0.32, 0.33 and 0.34):

- ``Scheduler.connector.connector_scheduler._jobs``: job id -> ``TransferJobStatus``
  (``req_id``, ``is_store``, ``keys``, ``fenced_block_ids``,
  ``deferred_fence_block_ids``), the jobs the workers have not all reported done.
- ``connector_scheduler._req_status``: per request, ``deferred_lookup_start_time``
  (``time.monotonic``) is set while the connector answers "ask again later" for it
  (the manager's ``HIT_PENDING``: its prefix is still being written).
- ``connector_scheduler.manager`` when it is vLLM's ``CPUOffloadingManager``: its chunk
  counters (``_num_chunks``, ``_num_allocated_chunks``, ``_free_list``,
  ``_num_evictable_cache_chunks``, ``_num_write_pending_chunks``), O(1). Other managers
  (the tiering manager) give no tier counts.

vLLM does not time its jobs: kvguard stamps a job when it first sees it (its age is
at least the time since then, at the poll's resolution) and counts the reads since, one
per poll. State kept here is bounded by the jobs in flight. Cost: O(jobs in flight +
requests the connector tracks) per read, at most every ``TRANSFER_POLL_SECONDS`` at step
ends; the models are built without validation.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvguard.core.offload import JobKind, OffloadJob, OffloadReading, OffloadTier, WaitingRequest
from kvguard.vllm_plugin.versions import (
    CPU_TIER_COUNTERS,
    JOB_DEFERRED_FENCE_BLOCK_IDS,
    JOB_FENCED_BLOCK_IDS,
    JOB_IS_STORE,
    JOB_KEYS,
    JOB_REQ_ID,
    OFFLOAD_CONNECTOR_SCHEDULER,
    OFFLOAD_JOBS,
    OFFLOAD_MANAGER,
    OFFLOAD_REQ_STATUS,
    OFFLOAD_STATE_DEFERRED_LOOKUP_START,
    OFFLOAD_STATE_REQ,
    REQUEST_IS_FINISHED,
    SCHEDULER_CONNECTOR,
    read,
)

__all__ = ["VllmOffload", "offload_source_of"]


def offload_source_of(scheduler: Any,
                      client_id_of: Callable[[str], str] | None = None) -> VllmOffload | None:
    """The engine's offloading connector, or None when it has none."""
    connector = read(scheduler, SCHEDULER_CONNECTOR)
    cs = read(connector, OFFLOAD_CONNECTOR_SCHEDULER)
    if cs is None or not isinstance(read(cs, OFFLOAD_JOBS), dict) \
            or read(cs, OFFLOAD_MANAGER) is None:
        return None
    return VllmOffload(type(connector).__name__, cs, client_id_of)


class VllmOffload:
    """One OffloadingConnector's scheduler side."""

    def __init__(self, name: str, connector_scheduler: Any,
                 client_id_of: Callable[[str], str] | None = None) -> None:
        self._name = name
        self._cs = connector_scheduler
        self._client_id_of = client_id_of
        self._first_seen: dict[int, tuple[float, int]] = {}
        self._reads = 0

    @property
    def connector(self) -> str:
        return self._name

    def read(self) -> OffloadReading:
        now = time.monotonic()
        self._reads += 1
        cs = self._cs
        jobs_raw: dict[int, Any] = read(cs, OFFLOAD_JOBS) or {}
        req_status: dict[str, Any] = read(cs, OFFLOAD_REQ_STATUS) or {}
        seen = self._first_seen
        for gone in seen.keys() - jobs_raw.keys():
            del seen[gone]
        jobs: list[OffloadJob] = []
        for job_id, st in jobs_raw.items():
            first = seen.setdefault(job_id, (now, self._reads))
            rid = str(read(st, JOB_REQ_ID, ""))
            rs = req_status.get(rid)
            req = read(rs, OFFLOAD_STATE_REQ)
            finished = _finished(req)
            fenced = len(read(st, JOB_FENCED_BLOCK_IDS) or ())
            if finished:
                fenced += len(read(st, JOB_DEFERRED_FENCE_BLOCK_IDS) or ())
            # model_construct: no validation on the engine thread (every field is built
            # with its type here); hundreds of jobs can be in flight under load.
            jobs.append(OffloadJob.model_construct(
                job_id=int(job_id),
                kind=JobKind.STORE if read(st, JOB_IS_STORE, False) else JobKind.LOAD,
                request_id=rid, client_request_id=self._client(rid),
                request_finished=finished, chunks=len(read(st, JOB_KEYS) or ()),
                fenced_blocks=fenced, age_seconds=max(0.0, now - first[0]),
                age_steps=self._reads - first[1]))
        waiting: list[WaitingRequest] = []
        for rid, rs in req_status.items():
            started = read(rs, OFFLOAD_STATE_DEFERRED_LOOKUP_START)
            req = read(rs, OFFLOAD_STATE_REQ)
            if started is None or req is None or _finished(req):
                continue
            waiting.append(WaitingRequest.model_construct(request_id=str(rid),
                                          client_request_id=self._client(str(rid)),
                                          waited_seconds=max(0.0, now - float(started))))
        return OffloadReading(jobs=jobs, tier=self._tier(), waiting=waiting)

    def _client(self, rid: str) -> str | None:
        if self._client_id_of is None or not rid:
            return None
        return self._client_id_of(rid)

    def _tier(self) -> OffloadTier | None:
        m: Any = read(self._cs, OFFLOAD_MANAGER)
        chunks, allocated_, free_list_, evictable_, pending_ = (read(m, c)
                                                                for c in CPU_TIER_COUNTERS)
        try:
            capacity = int(chunks)
            allocated = int(allocated_)
            free_list = len(free_list_)
            evictable = int(evictable_)
            pending = int(pending_)
        except TypeError:  # another manager (None read): no tier counts
            return None
        used = allocated - free_list
        ready = used - pending
        return OffloadTier(capacity=capacity, ready=max(0, ready),
                           read_pinned=max(0, ready - evictable),
                           write_pending=max(0, pending), free=max(0, capacity - used))


def _finished(req: Any) -> bool:
    """Whether vLLM's request is finished (a request no longer tracked counts as finished)."""
    if req is None:
        return True
    is_finished = read(req, REQUEST_IS_FINISHED)
    return bool(is_finished()) if callable(is_finished) else True
