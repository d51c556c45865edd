"""A torch-CPU ``OffloadingWorker`` with fault knobs: vLLM's real offload path on CPU.

vLLM 0.32's ``CPUOffloadingSpec.get_worker`` refuses a CPU-only build
(``v1/kv_offload/cpu/spec.py:200``: its worker copies with CUDA streams). Everything
else of the offload path (the OffloadingConnector's scheduler side, vLLM's
``CPUOffloadingManager`` and its LRU policy, the fences on freed blocks, preemption
flushes, ``reset_prefix_cache``) is plain Python and runs. This worker implements vLLM's
``OffloadingWorker`` interface (``submit_store``, ``submit_load``, ``get_finished``,
``wait``) with torch-CPU copies (:mod:`kvguard.testing.offload_copy`) so that the real
path runs end to end on CPU, in tests and in a CPU server.

**Test and chaos tooling, not a product part.** On a GPU, vLLM's own worker does this
job; nobody serving on GPUs needs this module. It lives beside kvguard's other chaos
tools for that reason.

Timing model (one *step* = one ``get_finished`` call, which vLLM's model runner makes
once per engine step, empty steps included):

* A job submitted before step ``s`` completes in step ``s + complete_after_steps - 1``
  (``complete_after_steps = 1``: at the first ``get_finished`` after its submission).
  Its bytes are copied then, not at submission: a store reads the device block when
  it completes, so a block that vLLM re-allocated without fencing the store first
  would be stored with the new owner's bytes, and a reload would differ (the
  byte-identity check of the chaos scenarios catches a missing fence).
* ``wait(job_ids)`` (vLLM's fence: a freed block that a store still reads is about
  to be re-allocated, or a preempted request's stores are flushed) copies those jobs'
  bytes at once; they are reported at the next ``get_finished``, as vLLM's GPU worker
  reports a synchronized CUDA event.
* Completions are reported as ``TransferResult``\\ s in submission order, per
  direction (stores and loads are two ordered queues, as in vLLM's worker), with
  ``transfer_size`` in bytes and ``transfer_time`` in seconds of copying.

Faults (``kv_connector_extra_config``, so they work in a server too; see
:class:`OffloadFaults`): lose the completion of every k-th store or load job (the
bytes still move when the job is due or fenced: only the report is lost, and it
does not hold up later jobs), and report every completion N steps late. In-process
tests can also arm a loss of the next n jobs of a kind (:meth:`TorchCpuOffloadingWorker.arm_loss`)
and hand lost completions back (:meth:`TorchCpuOffloadingWorker.release_lost`).

Invariants: each job is reported at most once (vLLM raises ``KeyError`` on a double
report); every reported result has ``success=True`` (vLLM asserts it); worker state is
bounded by the jobs in flight plus the lost ones.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvguard.errors import ConfigError
from kvguard.testing.offload_copy import CopyOp, RefShape, apply_copies, plan_copies

__all__ = ["OffloadFaults", "TorchCpuOffloadingWorker", "live_workers"]

EXTRA_PREFIX = "kvguard_"
_FAULT_KEYS = frozenset({"kvguard_complete_after_steps", "kvguard_lose_store_every",
                         "kvguard_lose_load_every"})


@dataclass(frozen=True, slots=True)
class OffloadFaults:
    """The worker's settings from ``kv_connector_extra_config`` (keys prefixed ``kvguard_``).

    ``complete_after_steps`` (>= 1, default 1): steps a job stays in flight.
    ``lose_store_every`` / ``lose_load_every`` (>= 0, 0 = off): the k-th, 2k-th, ...
    job of that kind never reports its completion (counted from the engine's first job,
    its warm-up included).
    """

    complete_after_steps: int = 1
    lose_store_every: int = 0
    lose_load_every: int = 0

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> OffloadFaults:
        """Parse the ``kvguard_*`` keys; other keys belong to vLLM's spec.

        Raises:
            ConfigError: an unknown ``kvguard_*`` key, or a value of the wrong type/range.
        """
        unknown = sorted(k for k in extra if k.startswith(EXTRA_PREFIX) and k not in _FAULT_KEYS)
        if unknown:
            raise ConfigError("kv_connector_extra_config", unknown,
                              f"only kvguard keys {sorted(_FAULT_KEYS)}")
        steps = _int(extra, "kvguard_complete_after_steps", 1, minimum=1)
        return cls(complete_after_steps=steps,
                   lose_store_every=_int(extra, "kvguard_lose_store_every", 0, minimum=0),
                   lose_load_every=_int(extra, "kvguard_lose_load_every", 0, minimum=0))


def _int(extra: dict[str, Any], key: str, default: int, *, minimum: int) -> int:
    value = extra.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(key, value, f"an int >= {minimum}")
    return value


@dataclass(slots=True)
class _Job:
    job_id: int
    is_store: bool
    ops: list[CopyOp]
    steps_left: int
    lost: bool
    copied: bool = False
    dequeued: bool = False
    copy_seconds: float = 0.0
    nbytes: int = 0


_WORKERS: weakref.WeakSet[TorchCpuOffloadingWorker] = weakref.WeakSet()


def live_workers() -> list[TorchCpuOffloadingWorker]:
    """Workers alive in this process (in-process engines only), oldest first."""
    return sorted(_WORKERS, key=lambda w: w.created_seq)


_created = 0


class TorchCpuOffloadingWorker(OffloadingWorker):
    """vLLM's ``OffloadingWorker`` on torch-CPU tensors; see the module docstring."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int,
                 num_chunks: int, faults: OffloadFaults) -> None:
        global _created
        if num_chunks <= 0:
            raise ConfigError("cpu_bytes_to_use", num_chunks,
                              "enough bytes for at least one offload chunk")
        self.blocks_per_chunk = blocks_per_chunk
        self.num_chunks = num_chunks
        self.faults = faults
        self.device: list[torch.Tensor] = []
        self.offload: list[torch.Tensor] = []
        self.page_bytes: list[int] = []
        for t in kv_caches.tensors:
            page = int(t.page_size_bytes)
            self.device.append(t.tensor.view(torch.int8).view(-1, page))
            self.offload.append(torch.zeros((num_chunks, page * blocks_per_chunk),
                                            dtype=torch.int8))
            self.page_bytes.append(page)
        self.refs: list[list[RefShape]] = [
            [RefShape(r.tensor_idx, int(r.page_size_bytes)) for r in group]
            for group in kv_caches.group_data_refs]
        self._queues: tuple[deque[_Job], deque[_Job]] = (deque(), deque())  # stores, loads
        self._by_id: dict[int, _Job] = {}
        self._lost: dict[int, _Job] = {}
        self._released: list[_Job] = []
        self._submitted = [0, 0]  # stores, loads
        self._arm = [0, 0]
        self.steps = 0
        self.fenced_jobs = 0
        """Jobs still in flight that vLLM fenced (``wait``): re-allocation or preemption."""
        self.bytes_copied = [0, 0]
        _created += 1
        self.created_seq = _created
        _WORKERS.add(self)

    # ---------------------------------------------------------------- test controls
    def arm_loss(self, *, stores: int = 0, loads: int = 0) -> None:
        """Lose the completions of the next ``stores`` store and ``loads`` load jobs."""
        self._arm[0] += stores
        self._arm[1] += loads

    def release_lost(self) -> list[int]:
        """Report every lost job at the next ``get_finished`` (its bytes copied then)."""
        ids = sorted(self._lost)
        for job in self._lost.values():
            job.lost = False
            job.steps_left = 0
            if job.dequeued:
                self._released.append(job)
        self._lost.clear()
        return ids

    @property
    def lost_job_ids(self) -> frozenset[int]:
        return frozenset(self._lost)

    @property
    def jobs_in_flight(self) -> int:
        return len(self._by_id)

    # ---------------------------------------------------------- OffloadingWorker
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, src_spec, dst_spec, is_store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        return self._submit(job_id, dst_spec, src_spec, is_store=False)

    def get_finished(self) -> list[TransferResult]:
        self.steps += 1
        results: list[TransferResult] = []
        for queue in self._queues:
            for job in queue:
                job.steps_left -= 1
            while queue and queue[0].steps_left <= 0:
                job = queue.popleft()
                job.dequeued = True
                self._copy(job)
                if job.lost:
                    continue  # stays in _by_id (a fence still finds it) and in _lost
                results.append(self._result(job))
        released, self._released = self._released, []
        results.extend(self._result(job) for job in released)
        return results

    def _result(self, job: _Job) -> TransferResult:
        del self._by_id[job.job_id]
        return TransferResult(job_id=job.job_id, success=True, transfer_size=job.nbytes,
                              transfer_time=job.copy_seconds)

    def wait(self, job_ids: set[int]) -> None:
        for job_id in job_ids:
            job = self._by_id.get(job_id)
            if job is not None:
                self.fenced_jobs += 1
                self._copy(job)
                if not job.lost:
                    job.steps_left = 0

    def shutdown(self) -> None:
        for queue in self._queues:
            queue.clear()
        self._by_id.clear()
        self._lost.clear()
        self._released.clear()

    # --------------------------------------------------------------- internals
    def _submit(self, job_id: int, device_spec: GPULoadStoreSpec, tier_spec: LoadStoreSpec,
                *, is_store: bool) -> bool:
        if not isinstance(tier_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"expected CPU chunk ids, got {type(tier_spec).__name__}")
        ops = plan_copies(device_spec.block_ids.tolist(), list(device_spec.group_sizes),
                          list(device_spec.block_indices), tier_spec.block_ids.tolist(),
                          self.refs, self.page_bytes, self.blocks_per_chunk)
        kind = 0 if is_store else 1
        self._submitted[kind] += 1
        every = self.faults.lose_store_every if is_store else self.faults.lose_load_every
        lost = bool(every) and self._submitted[kind] % every == 0
        if self._arm[kind] > 0:
            self._arm[kind] -= 1
            lost = True
        job = _Job(job_id, is_store, ops, self.faults.complete_after_steps, lost)
        self._by_id[job_id] = job
        self._queues[kind].append(job)
        if lost:
            self._lost[job_id] = job
        return True

    def _copy(self, job: _Job) -> None:
        if job.copied:
            return
        t0 = time.perf_counter()
        job.nbytes = apply_copies(job.ops, self.device, self.offload, to_offload=job.is_store)
        job.copy_seconds = time.perf_counter() - t0
        job.copied = True
        self.bytes_copied[0 if job.is_store else 1] += job.nbytes
