"""Fault injection in vLLM's own code paths, below kvguard's hooks (tests and staging only).

Each fault is a real bug class; it lives in :mod:`kvguard.chaos.faults.scheduler` (a vLLM
``Scheduler`` subclass plus per-instance patches of vLLM's single-type KV managers), never
in kvguard's plugin or hooks, so kvguard learns of it only from what vLLM then does.

Faults (what vLLM then does; the public report each mirrors):

- ``skip_free_on_abort``: an aborted request's blocks are never freed, its table stays
  (vllm #32255, #29987).
- ``double_free_on_abort``: an aborted request's blocks are freed twice, ref_cnt -1 in
  the free queue (SGLang #6888, PR #12224).
- ``refcount_bump``: ``ref_cnt += 1`` on a finishing request's last block, outside every
  pool call (copy-on-write pairs, connectors bound to the pool; design.md section 5).
- ``preemption_skips_free``: a preemption drops the request's tables without freeing
  its blocks (vllm #52360).
- ``spec_rollback_keeps_blocks``: at finish, blocks past the computed tokens (rejected
  drafts and their lookahead) leave the table without being freed (SGLang PR #19518,
  sglang-jax #1147).
- ``prefix_hit_extra_ref``: a prefix-cache hit takes a second reference on a cached
  block (xLLM #828).
- ``deferred_free_never_released``: a finished request's free is parked in
  ``deferred_frees`` and never drained (vllm PR #45357's fence; vllm-rbln PR #903).
- ``sliding_window_removal_skips_free``: blocks that slid out of the window are nulled
  in the table but never freed (vllm PR #25431's path; vllm-ascend PR #10394).
- ``remote_kv_never_arrives`` (P/D decode side): the connector's ``finished_recving`` for
  the victim is lost, so it waits for its KV for good; aborted, it keeps its blocks
  (vllm #46283, Mooncake #35943).
- ``send_completion_lost`` (P/D prefill side): the connector's ``finished_sending`` for
  the victim is lost, so its blocks stay after the decode side read them or the lease
  lapsed (Dynamo #3730, vllm #58222's outcome).

``deferred_frees`` is used by vLLM 0.32 only with async scheduling (or pipeline
parallelism) plus a KV-consumer connector (``defer_block_free``); otherwise vLLM never
defers and never drains ``deferred_frees``. The fault forces the deferral for its victim
(on the CPU default, synchronous, and on async engines without a KV consumer), and the
parked entry is never released. With a KV consumer, vLLM's own fence would release it.

Importing this package does not import vLLM; :mod:`.scheduler` does.
"""

from __future__ import annotations

from kvguard.chaos.faults.plan import Fault, FaultPlan
from kvguard.testing.scheduling import Scheduling

SCHEDULER_CLS = "kvguard.chaos.faults.scheduler.ChaosScheduler"
"""``--scheduler-cls`` / ``scheduler_cls`` value that loads the faulty scheduler."""
ASYNC_SCHEDULER_CLS = "kvguard.chaos.faults.scheduler.AsyncChaosScheduler"
"""The same on vLLM's ``AsyncScheduler``, for engines with async scheduling."""


def scheduler_cls_for(scheduling: Scheduling) -> str:
    """The chaos scheduler class for an engine's scheduling mode."""
    return ASYNC_SCHEDULER_CLS if scheduling is Scheduling.ASYNC else SCHEDULER_CLS


__all__ = ["ASYNC_SCHEDULER_CLS", "SCHEDULER_CLS", "Fault", "FaultPlan", "scheduler_cls_for"]
