"""The offload tier audited like the pool: jobs in flight, stuck jobs, tier accounting.

An offloading KV connector (vLLM's OffloadingConnector) copies KV blocks to a second
tier (CPU memory) and back. Its failures do not always leak a pool block:

* A **lost store completion** leaves no block referenced (the freed blocks are only
  *fenced*: re-allocating one flushes the store first), but the job stays in flight
  forever. vLLM then keeps stepping (``has_pending_push_work``), so the engine never goes
  idle again, the job's tier chunks stay write-pending, and a later request with the same
  prefix waits for them forever (``HIT_PENDING``) holding no block. kvguard's drained
  checkpoints still come (drained means no live request, not an idle engine): their pool
  audit says ``clean``, and their explanation names the stuck job; only the jobs say what
  is wrong.
* A **lost load completion** does hold blocks (the request waits in
  ``WAITING_FOR_REMOTE_KVS``, or, aborted, stays ``FINISHED_ABORTED``): the pool audit
  names it (``finished_request``, path ``delayed_free``); the jobs say which job.

This module is engine-agnostic: an :class:`OffloadSource` reads the engine, an
:class:`OffloadAudit` judges. Judging is O(jobs in flight); the tier's counts are O(1)
reads. Units: ages in seconds (and engine steps), tier sizes in *chunks* (the tier's
unit: ``blocks_per_chunk`` pool blocks each). Reports carry request ids, never prompt
text or token ids.

Invariants of a healthy tier at a drained moment (checked by :meth:`OffloadAudit.reconcile`):
``ready + write_pending + free == capacity``, write-pending chunks are exactly the chunks
of the store jobs in flight, and read-pinned chunks are at most the chunks the load jobs
in flight read.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["MAX_LISTED", "MIN_STEPS_STUCK", "JobKind", "OffloadAudit", "OffloadJob",
           "OffloadReading", "OffloadSource", "OffloadState", "OffloadTier", "OffloadVerdict",
           "WaitingRequest"]

MAX_LISTED = 20
"""Stuck jobs and waiting requests listed in the state (all are counted)."""
MIN_STEPS_STUCK = 2
"""A job is stuck only once the engine stepped this often since kvguard first saw it: an
in-process engine nobody steps has no chance to complete anything."""


class JobKind(enum.StrEnum):
    STORE = "store"
    LOAD = "load"


class OffloadVerdict(enum.StrEnum):
    """The offload audit's outcome (its own vocabulary, beside the pool's verdicts)."""

    OK = "ok"
    """Every job in flight is within its bound; the tier reconciled at the last drain."""
    STUCK = "stuck"
    """A job in flight is past its bound: its completion was lost (or the copy hangs)."""
    TIER_MISMATCH = "tier_mismatch"
    """At a drained moment the tier's chunk states disagree with the jobs in flight."""


class OffloadTier(BaseModel):
    """The tier's chunks by state, as the engine's own offload manager counts them."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    capacity: int = Field(ge=0, description="Chunks the tier can hold.")
    ready: int = Field(ge=0, description="Stored and loadable (read-pinned included).")
    read_pinned: int = Field(ge=0, description="Ready chunks a load in flight reads.")
    write_pending: int = Field(ge=0, description="Chunks a store in flight writes.")
    free: int = Field(ge=0)


class OffloadJob(BaseModel):
    """One job in flight, as the connector's scheduler side tracks it."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    job_id: int
    kind: JobKind
    request_id: str
    client_request_id: str | None = None
    request_finished: bool
    chunks: int = Field(description="Tier chunks (offload keys) the job covers.")
    fenced_blocks: int = Field(description="Freed pool blocks whose re-allocation must "
                                           "first flush this job.")
    age_seconds: float = Field(description="Since kvguard first saw the job.")
    age_steps: int = Field(description="Engine steps since kvguard first saw the job.")


class WaitingRequest(BaseModel):
    """A request the connector keeps waiting for chunks that are still being written."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    request_id: str
    client_request_id: str | None = None
    waited_seconds: float


class OffloadState(BaseModel):
    """The offload audit in the engine's published state (present with an offloading
    connector)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    connector: str
    verdict: OffloadVerdict
    explanation: str
    bound_seconds: float = Field(description="Age past which a job in flight is stuck.")
    bound_source: str
    tier: OffloadTier | None = Field(default=None, description="None: the manager's counts "
                                     "cannot be read (not vLLM's CPU manager).")
    jobs_in_flight: dict[str, int] = Field(default_factory=dict, description="By kind.")
    oldest_job_age_seconds: float = 0.0
    stuck_jobs: int = 0
    stuck: list[OffloadJob] = Field(default_factory=list,
                                    description=f"The oldest {MAX_LISTED}, oldest first.")
    waiting_requests: int = 0
    waiting: list[WaitingRequest] = Field(default_factory=list)
    stuck_jobs_total: int = Field(default=0, description="Distinct jobs ever found stuck.")
    tier_checked_at: float | None = Field(default=None, description="Unix s of the last "
                                          "drained reconciliation.")
    tier_mismatch: str | None = Field(default=None, description="What disagreed then.")


@dataclass(frozen=True, slots=True)
class OffloadReading:
    """One read of the engine's offload path (between steps)."""

    jobs: Sequence[OffloadJob]
    tier: OffloadTier | None
    waiting: Sequence[WaitingRequest]


class OffloadSource(Protocol):
    """The engine side: reads the connector and its manager; may raise (contained)."""

    @property
    def connector(self) -> str: ...

    def read(self) -> OffloadReading:
        """Jobs in flight (with kvguard's ages), the tier's counts, waiting requests."""


class OffloadAudit:
    """Judges readings against the bound; keeps the distinct stuck jobs' count."""

    def __init__(self, connector: str, bound_seconds: float, bound_source: str) -> None:
        self.connector = connector
        self.bound_seconds = bound_seconds
        self.bound_source = bound_source
        self._stuck_seen: set[int] = set()
        self.stuck_jobs_total = 0
        self.tier_checked_at: float | None = None
        self.tier_mismatch: str | None = None
        self.last: OffloadState | None = None

    def judge(self, reading: OffloadReading) -> OffloadState:
        """The state for this reading (also kept as :attr:`last`)."""
        jobs = sorted(reading.jobs, key=lambda j: -j.age_seconds)
        stuck = [j for j in jobs if j.age_seconds >= self.bound_seconds
                 and j.age_steps >= MIN_STEPS_STUCK]
        live_ids = {j.job_id for j in jobs}
        self._stuck_seen &= live_ids
        for j in stuck:
            if j.job_id not in self._stuck_seen:
                self._stuck_seen.add(j.job_id)
                self.stuck_jobs_total += 1
        by_kind = {k.value: sum(1 for j in jobs if j.kind is k) for k in JobKind}
        waiting = sorted(reading.waiting, key=lambda w: -w.waited_seconds)
        if stuck:
            verdict, text = OffloadVerdict.STUCK, self._explain_stuck(stuck, waiting)
        elif self.tier_mismatch is not None:
            verdict, text = OffloadVerdict.TIER_MISMATCH, (
                f"At the last drained moment the offload tier disagreed with the jobs in "
                f"flight: {self.tier_mismatch}. A chunk state changed without its job (a "
                "completion applied twice, or a job dropped without completing). Compare "
                "vLLM's kv_offload_* series; restart the engine to reset the tier.")
        else:
            verdict, text = OffloadVerdict.OK, (
                f"{len(jobs)} offload job(s) in flight, none older than the "
                f"{self.bound_seconds:g} s bound ({self.bound_source}).")
        self.last = OffloadState(
            connector=self.connector, verdict=verdict, explanation=text,
            bound_seconds=self.bound_seconds, bound_source=self.bound_source,
            tier=reading.tier, jobs_in_flight=by_kind,
            oldest_job_age_seconds=jobs[0].age_seconds if jobs else 0.0,
            stuck_jobs=len(stuck), stuck=stuck[:MAX_LISTED],
            waiting_requests=len(waiting), waiting=waiting[:MAX_LISTED],
            stuck_jobs_total=self.stuck_jobs_total, tier_checked_at=self.tier_checked_at,
            tier_mismatch=self.tier_mismatch)
        return self.last

    def reconcile(self, reading: OffloadReading, at: float) -> str | None:
        """At a drained moment: the tier's chunk states against the jobs in flight.
        Returns (and keeps) what disagrees, or None."""
        tier = reading.tier
        if tier is None:
            return None
        store_chunks = sum(j.chunks for j in reading.jobs if j.kind is JobKind.STORE)
        load_chunks = sum(j.chunks for j in reading.jobs if j.kind is JobKind.LOAD)
        problems: list[str] = []
        if tier.ready + tier.write_pending + tier.free != tier.capacity:
            problems.append(f"{tier.ready} ready + {tier.write_pending} write-pending + "
                            f"{tier.free} free chunks != capacity {tier.capacity}")
        if tier.write_pending != store_chunks:
            problems.append(f"{tier.write_pending} write-pending chunks, but the store jobs "
                            f"in flight cover {store_chunks}")
        if tier.read_pinned > load_chunks:
            problems.append(f"{tier.read_pinned} read-pinned chunks, but the load jobs in "
                            f"flight read {load_chunks}")
        self.tier_checked_at = at
        self.tier_mismatch = "; ".join(problems) or None
        return self.tier_mismatch

    def _explain_stuck(self, stuck: Sequence[OffloadJob],
                       waiting: Sequence[WaitingRequest]) -> str:
        head = stuck[0]
        who = head.client_request_id or head.request_id
        stores = sum(1 for j in stuck if j.kind is JobKind.STORE)
        lines = [f"{len(stuck)} offload job(s) in flight past the {self.bound_seconds:g} s "
                 f"bound ({self.bound_source}); the oldest: {head.kind.value} job "
                 f"{head.job_id} of request {who}, {head.age_seconds:.1f} s "
                 f"({head.age_steps} steps), {head.chunks} chunk(s), "
                 f"{head.fenced_blocks} fenced pool block(s)."]
        if stores:
            lines.append(
                "A store job that never completes leaks no pool block, but vLLM keeps stepping "
                "for it (has_pending_push_work), so the engine never goes idle. kvguard still "
                "audits the pool whenever no request is live (a drained checkpoint needs no "
                "idle engine), and those reports carry this job; its chunks stay "
                "write-pending, and every re-allocation of a fenced block flushes it again.")
        if waiting:
            names = ", ".join(w.client_request_id or w.request_id for w in waiting[:5])
            lines.append(f"{len(waiting)} request(s) wait for those chunks and will wait "
                         f"forever (vLLM: HIT_PENDING), holding no block: {names}"
                         + (" ..." if len(waiting) > 5 else "") + ".")
        lines.append("Next: the offload worker's completion for that job was lost (or its "
                     "copy hangs). Look at the worker's transfer queue and its "
                     "get_finished(); restarting the engine clears it, and "
                     "reset_prefix_cache drops the job from the scheduler's books.")
        return "\n".join(lines)
