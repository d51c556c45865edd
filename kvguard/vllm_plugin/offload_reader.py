"""``VllmOffload``: the :class:`~kvguard.core.offload.OffloadSource` of vLLM's
OffloadingConnector (vLLM 0.32).

What it reads, all on the scheduler side (EngineCore), between steps, with ``getattr``:

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

__all__ = ["VllmOffload", "offload_source_of"]


def offload_source_of(scheduler: Any,
                      client_id_of: Callable[[str], str] | None = None) -> VllmOffload | None:
    """The engine's offloading connector, or None when it has none."""
    connector = getattr(scheduler, "connector", None)
    cs = getattr(connector, "connector_scheduler", None)
    if cs is None or not isinstance(getattr(cs, "_jobs", None), dict) \
            or getattr(cs, "manager", None) is None:
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
        jobs_raw: dict[int, Any] = getattr(cs, "_jobs", {}) or {}
        req_status: dict[str, Any] = getattr(cs, "_req_status", {}) or {}
        seen = self._first_seen
        for gone in seen.keys() - jobs_raw.keys():
            del seen[gone]
        jobs: list[OffloadJob] = []
        for job_id, st in jobs_raw.items():
            first = seen.setdefault(job_id, (now, self._reads))
            rid = str(getattr(st, "req_id", ""))
            rs = req_status.get(rid)
            req = getattr(rs, "req", None)
            finished = bool(req.is_finished()) if req is not None else True
            fenced = len(getattr(st, "fenced_block_ids", None) or ())
            if finished:
                fenced += len(getattr(st, "deferred_fence_block_ids", None) or ())
            # model_construct: no validation on the engine thread (every field is built
            # with its type here); hundreds of jobs can be in flight under load.
            jobs.append(OffloadJob.model_construct(
                job_id=int(job_id),
                kind=JobKind.STORE if getattr(st, "is_store", False) else JobKind.LOAD,
                request_id=rid, client_request_id=self._client(rid),
                request_finished=finished, chunks=len(getattr(st, "keys", ()) or ()),
                fenced_blocks=fenced, age_seconds=max(0.0, now - first[0]),
                age_steps=self._reads - first[1]))
        waiting: list[WaitingRequest] = []
        for rid, rs in req_status.items():
            started = getattr(rs, "deferred_lookup_start_time", None)
            req = getattr(rs, "req", None)
            if started is None or req is None or req.is_finished():
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
        m: Any = getattr(self._cs, "manager", None)
        try:
            capacity = int(m._num_chunks)
            allocated = int(m._num_allocated_chunks)
            free_list = len(m._free_list)
            evictable = int(m._num_evictable_cache_chunks)
            pending = int(m._num_write_pending_chunks)
        except (AttributeError, TypeError):
            return None
        used = allocated - free_list
        ready = used - pending
        return OffloadTier(capacity=capacity, ready=max(0, ready),
                           read_pinned=max(0, ready - evictable),
                           write_pending=max(0, pending), free=max(0, capacity - used))
