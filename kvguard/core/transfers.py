"""KV transfers between engines (P/D disaggregation): what one engine saw of each.

In prefill/decode disaggregation a *prefill* engine computes a request's KV, finishes
it after one token and keeps its blocks (a delayed free) until the *decode* engine has
read them, or until the hold's lease lapses; the decode engine admits the request
with ``kv_transfer_params`` naming the prefill engine and that engine's request id,
allocates blocks and waits for the KV. Each engine's :class:`TransferLog` keeps a
bounded record of the transfers it took part in, for the JSON state; a cross-engine
view (:mod:`kvguard.core.transfer_links`) joins the two sides' records on the prefill
engine's KV-connector id and request id (``remote_engine_id`` / ``remote_request_id``
on the decode side), never on a Prometheus label.

Hazards are not leaks: a prefill engine that frees blocks when their lease lapses,
before any decode read them, and then sees a read arrive for that request served the
decode engine memory that may already hold another request's KV (silent corruption).

No prompt text or token ids are recorded: request ids, engine ids, times, outcomes.
Not thread-safe; the session calls it from the engine's scheduler thread.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

MAX_RECORDS = 64
"""Ended transfers kept per engine (the counts are exact; pending ones are all kept)."""
MAX_HAZARDS = 32


class TransferRole(enum.StrEnum):
    """This engine's side of a transfer."""

    PREFILL = "prefill"
    """It computed the KV and holds it for a remote reader (``do_remote_decode``)."""
    DECODE = "decode"
    """It reads the KV from a remote engine (``do_remote_prefill``)."""


class TransferOutcome(enum.StrEnum):
    """How a transfer ended, as this engine saw it."""

    PENDING = "pending"
    READ = "read"
    """Prefill side: the decode side read the blocks and said so; the hold ended."""
    EXPIRED_UNREAD = "expired_unread"
    """Prefill side: the lease lapsed before any read; the blocks were freed."""
    EXPIRED_PARTLY_READ = "expired_partly_read"
    """Prefill side: the lease lapsed after some, not all, readers had read."""
    RECEIVED = "received"
    """Decode side: the KV arrived."""
    FAILED = "failed"
    """Decode side: the connector reported the load as failed."""
    ABORTED_WAITING = "aborted_waiting"
    """Decode side: the request finished (aborted) while it waited for the KV."""
    RELEASED = "released"
    """The hold ended without the connector saying why."""


class HazardKind(enum.StrEnum):
    FREED_BEFORE_READ = "freed_before_read"
    """The prefill engine freed a request's blocks when its lease lapsed unread, and a
    decode engine read them afterwards: what it read may be another request's KV."""


class TransferRecord(BaseModel):
    """One transfer as one engine saw it. Times are Unix seconds."""

    model_config = ConfigDict(extra="forbid", strict=True)

    request_id: str = Field(description="This engine's internal request id.")
    client_request_id: str
    role: TransferRole
    remote_engine_id: str | None = Field(
        default=None, description="Decode side: the prefill engine's KV-connector id.")
    remote_request_id: str | None = Field(
        default=None, description="Decode side: the prefill engine's request id.")
    started_at: float
    hold_deadline: float | None = Field(
        default=None, description="Prefill side: the lease's end as last read, renewals "
                                  "included.")
    ended_at: float | None = None
    outcome: TransferOutcome = TransferOutcome.PENDING
    reads: int | None = Field(default=None, description="Prefill side: reads completed "
                                                        "when the lease lapsed.")


class TransferHazard(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    kind: HazardKind
    request_id: str
    client_request_id: str
    freed_at: float | None = Field(description="When the lease lapsed and the blocks were "
                                               "freed.")
    read_at: float = Field(description="When the late read was reported.")
    detail: str


class WorkerRankState(BaseModel):
    """What one worker rank's half of kvguard has reported (its connector's worker side:
    :mod:`kvguard.core.worker_reports`). Counters are since that worker started."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    rank: int = Field(description="Pipeline rank x tensor size + tensor rank.")
    pid: int = Field(description="The worker's process (EngineCore's with a one-process "
                                 "executor).")
    reports_total: int = 0
    lease_lapses_total: int = Field(
        default=0, description="Leases this rank released unread or partly read (vLLM "
                               "counts the same in vllm:nixl_num_kv_expired_reqs).")
    late_reads_total: int = Field(
        default=0, description="Read notifications for requests this rank no longer held "
                               "(vllm:nixl_num_notifications_after_expiry).")
    finished_sending_total: int = 0
    finished_recving_total: int = 0
    dropped_total: int = Field(default=0, description="News the worker half dropped: its "
                                                      "buffer was full.")
    errors_total: int = Field(default=0, description="Failures inside the worker half, "
                                                     "contained.")


class TransfersState(BaseModel):
    """The KV transfers one engine took part in, as published in its state."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    connector: str = Field(description="The KV connector's class, e.g. NixlConnector.")
    kv_role: str | None = Field(default=None, description="kv_producer, kv_consumer, kv_both.")
    kv_engine_id: str | None = Field(
        default=None, description="This engine's id in its connector: what a decode "
                                  "engine's remote_engine_id names.")
    hold_source: str = Field(description="Where delayed-free bounds come from: the "
                                         "connector's live leases, or a configured bound.")
    pending: int = 0
    outcomes_total: dict[str, int] = Field(default_factory=dict)
    hazards_total: dict[str, int] = Field(default_factory=dict)
    records: list[TransferRecord] = Field(default_factory=list,
                                          description="Pending ones, then the latest ended.")
    hazards: list[TransferHazard] = Field(default_factory=list, description="Latest last.")
    worker_ranks: list[WorkerRankState] = Field(
        default_factory=list, description="The connector's worker side, per rank, as "
                                          "kvguard's worker half reported it; empty until "
                                          "one reports (then hold_source is a configured "
                                          "bound).")


class TransferEventKind(enum.StrEnum):
    STARTED = "started"
    ENDED = "ended"
    LATE_READ = "late_read"
    """A read was reported for a request whose hold had already ended."""


@dataclass(frozen=True, slots=True)
class TransferEvent:
    """What an engine's KV connector did for one request (fed to the session)."""

    kind: TransferEventKind
    request_id: str
    at: float
    """Unix seconds."""
    role: TransferRole | None = None
    """``started`` only."""
    outcome: TransferOutcome | None = None
    """``ended`` only."""
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    reads: int | None = None


class TransferSource(Protocol):
    """An engine's KV connector, as far as transfers between engines go.

    Read on the engine's scheduler thread, between steps; it must not block. Events
    the connector produces on another thread are queued by the source and handed over
    by :meth:`drain_events`.
    """

    @property
    def connector(self) -> str: ...

    @property
    def kv_role(self) -> str | None: ...

    @property
    def kv_engine_id(self) -> str | None: ...

    @property
    def hold_source(self) -> str:
        """Where hold deadlines come from (the connector's live leases, or a fallback)."""

    def hold_deadlines(self) -> Mapping[str, float] | None:
        """The connector's live deadline (Unix s, renewals included) of every delayed free
        it still holds, by request id; ``None`` when the connector's leases cannot be read
        (then the configured bound applies). A request it no longer lists has been let go."""

    def drain_events(self) -> list[TransferEvent]:
        """What the connector did since the last call, oldest first."""

    @property
    def errors(self) -> int:
        """Failures contained inside the source's own wrappers so far."""

    def worker_ranks(self) -> list[WorkerRankState]:
        """What the connector's worker side reported, per rank (empty: nothing yet)."""


class TransferLog:
    """The transfers of one engine: pending ones by request id, the latest ended ones."""

    def __init__(self, *, connector: str, kv_role: str | None, kv_engine_id: str | None,
                 hold_source: str) -> None:
        self.connector = connector
        self.kv_role = kv_role
        self.kv_engine_id = kv_engine_id
        self.hold_source = hold_source
        self._pending: dict[str, TransferRecord] = {}
        self._ended: OrderedDict[str, TransferRecord] = OrderedDict()
        self._hazards: deque[TransferHazard] = deque(maxlen=MAX_HAZARDS)
        self.outcomes: Counter[str] = Counter()
        self.hazard_counts: Counter[str] = Counter()
        self.worker_ranks: list[WorkerRankState] = []
        """As last read from the source (set by the session)."""
        self.on_ended: Callable[[TransferRecord], None] | None = None
        """Called with each record :meth:`ended` closes (set by the session; must not raise)."""
        self.on_hazard: Callable[[TransferHazard], None] | None = None
        """Called with each new hazard (set by the session; must not raise)."""

    def get(self, request_id: str) -> TransferRecord | None:
        return self._pending.get(request_id) or self._ended.get(request_id)

    def pending(self) -> list[TransferRecord]:
        return list(self._pending.values())

    def started(self, request_id: str, client_request_id: str, role: TransferRole, at: float,
                *, remote_engine_id: str | None = None,
                remote_request_id: str | None = None) -> None:
        if request_id in self._pending:
            return
        self._pending[request_id] = TransferRecord(
            request_id=request_id, client_request_id=client_request_id, role=role,
            remote_engine_id=remote_engine_id, remote_request_id=remote_request_id,
            started_at=at)

    def deadline(self, request_id: str, deadline: float) -> None:
        rec = self._pending.get(request_id)
        if rec is not None:
            rec.hold_deadline = deadline

    def ended(self, request_id: str, outcome: TransferOutcome, at: float,
              *, reads: int | None = None) -> TransferRecord | None:
        """Close a pending transfer (no-op for an unknown or already ended one)."""
        rec = self._pending.pop(request_id, None)
        if rec is None:
            return None
        rec.outcome = outcome
        rec.ended_at = at
        rec.reads = reads if reads is not None else rec.reads
        self.outcomes[outcome.value] += 1
        self._ended[request_id] = rec
        while len(self._ended) > MAX_RECORDS:
            self._ended.popitem(last=False)
        if self.on_ended is not None:
            self.on_ended(rec)
        return rec

    def read_after_expiry(self, request_id: str, at: float) -> TransferHazard | None:
        """A read was reported for a request whose blocks this (prefill) engine already
        freed on lease expiry: the hazard, once per request."""
        rec = self._ended.get(request_id)
        if rec is None or rec.outcome not in (TransferOutcome.EXPIRED_UNREAD,
                                              TransferOutcome.EXPIRED_PARTLY_READ):
            return None
        if any(h.request_id == request_id for h in self._hazards):
            return None
        late = at - rec.ended_at if rec.ended_at is not None else None
        hz = TransferHazard(
            kind=HazardKind.FREED_BEFORE_READ, request_id=request_id,
            client_request_id=rec.client_request_id, freed_at=rec.ended_at, read_at=at,
            detail=("the lease lapsed and its blocks were freed "
                    + (f"{late:.1f} s " if late is not None else "")
                    + "before a decode engine read them: that read may have returned "
                      "another request's KV"))
        self._hazards.append(hz)
        self.hazard_counts[hz.kind.value] += 1
        if self.on_hazard is not None:
            self.on_hazard(hz)
        return hz

    def state(self) -> TransfersState:
        return TransfersState(
            connector=self.connector, kv_role=self.kv_role, kv_engine_id=self.kv_engine_id,
            hold_source=self.hold_source, pending=len(self._pending),
            outcomes_total=dict(self.outcomes), hazards_total=dict(self.hazard_counts),
            records=[r.model_copy() for r in (*self._pending.values(), *self._ended.values())],
            hazards=list(self._hazards), worker_ranks=list(self.worker_ranks))
