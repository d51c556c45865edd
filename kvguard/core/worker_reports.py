"""What the worker processes of one engine report about KV transfers, joined per request.

An engine's KV connector has two halves: the scheduler side (with the engine's
scheduler and block pool) and a worker side in every worker process, one per
tensor/pipeline-parallel rank. The worker side holds what only it knows: the live
lease of every held request, which lease lapsed (its blocks released unread), which
read notification came after that, and which transfers finished on *this* rank. The
worker half of kvguard (:mod:`kvguard.vllm_plugin.worker_half`) sends one
:class:`RankReport` per rank and step with something to say; :class:`RankJoin`, on the
scheduler side, turns them into :class:`~kvguard.core.transfers.TransferEvent` s:

- a prefill hold ends when **every** rank has reported it finished (the engine frees
  the blocks only then), and it ended *expired* when its lease lapsed on **any** rank;
- a read reported on a rank after that rank's lease lapsed is a late read (the hazard
  ``freed_before_read`` once the hold has ended expired);
- a request's live deadline is the latest over the ranks that still list its lease.

Pure: no engine, no clock, no I/O. Bounded: requests waiting for their other ranks and
late reads waiting for their hold to end are capped (the oldest is dropped and counted).
Not thread-safe; the session calls it on the engine's scheduler thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvguard.core.transfers import TransferEvent, TransferEventKind, TransferOutcome

MAX_PARTIAL = 4096
"""Requests some, not all, ranks have reported finished (oldest dropped beyond this)."""


@dataclass(frozen=True, slots=True)
class LeaseLapse:
    """A rank's lease on a held request lapsed: its worker released the blocks."""

    request_id: str
    reads: int
    """Read notifications this rank had when the lease lapsed."""
    expected_reads: int
    """Readers the decode side announced (1 until the first read says otherwise)."""
    at: float
    """Unix seconds."""


@dataclass(frozen=True, slots=True)
class LateRead:
    """A read notification for a request this rank no longer held (its lease lapsed)."""

    request_id: str
    at: float


@dataclass(frozen=True, slots=True)
class RankReport:
    """One worker rank's news since its previous report. Travels between processes
    (pickled by vLLM with the step's output): plain values only.

    Counters (``*_total``) are cumulative since the worker half started on the rank, so
    that a later report supersedes an earlier one; the rest is news since the last one.
    """

    rank: int
    """The worker's rank in its engine (pipeline rank x tensor size + tensor rank)."""
    world_size: int
    """Ranks of the engine that report (tensor x pipeline parallel size)."""
    pid: int
    """The worker's process id (equal to EngineCore's with a one-process executor)."""
    lapses: tuple[LeaseLapse, ...] = ()
    late_reads: tuple[LateRead, ...] = ()
    finished_sending: tuple[str, ...] = ()
    """Held requests this rank let go of this step (read, or lease lapsed)."""
    finished_recving: tuple[str, ...] = ()
    deadlines: Mapping[str, float] = field(default_factory=dict)
    """Leases granted or renewed since the last report: request id -> Unix deadline."""
    lapses_total: int = 0
    late_reads_total: int = 0
    dropped_total: int = 0
    """News the worker half could not keep (its buffer was full): never blocks the worker."""
    errors_total: int = 0
    """Failures inside the worker half, contained (the worker ran on unchanged)."""


@dataclass(slots=True)
class RankCounts:
    """What one rank has reported so far (the scheduler side's view)."""

    rank: int
    pid: int
    reports_total: int = 0
    lapses_total: int = 0
    late_reads_total: int = 0
    finished_sending_total: int = 0
    finished_recving_total: int = 0
    dropped_total: int = 0
    errors_total: int = 0


@dataclass(slots=True)
class _Partial:
    ranks_done: set[int] = field(default_factory=set)
    lapsed: dict[int, LeaseLapse] = field(default_factory=dict)
    late_reads: list[LateRead] = field(default_factory=list)


class RankJoin:
    """Joins the :class:`RankReport` s of one engine's ranks into per-request events."""

    def __init__(self) -> None:
        self.world_size = 0
        """The largest world size any report announced (0: no report yet)."""
        self.ranks: dict[int, RankCounts] = {}
        self._partial: OrderedDict[str, _Partial] = OrderedDict()
        self._live: dict[int, dict[str, float]] = {}
        """Per rank: the leases it still lists, request id -> Unix deadline."""
        self._lapsed_on: OrderedDict[str, set[int]] = OrderedDict()
        """Requests whose hold ended with a lapse, and on which ranks (for late reads)."""
        self.partial_dropped_total = 0
        """Requests given up on while waiting for their other ranks (over the bound)."""

    @property
    def reporting(self) -> bool:
        """A worker half has reported at least once."""
        return bool(self.ranks)

    @property
    def pids(self) -> set[int]:
        return {c.pid for c in self.ranks.values()}

    def deadlines(self) -> dict[str, float]:
        """The live deadline of every lease some rank still lists: the latest over them
        (the engine keeps the blocks until the last rank lets go)."""
        out: dict[str, float] = {}
        for leases in self._live.values():
            for rid, d in leases.items():
                if d > out.get(rid, float("-inf")):
                    out[rid] = d
        return out

    def feed(self, reports: Iterable[RankReport]) -> list[TransferEvent]:
        """Apply one step's reports (any order, any subset of ranks); the events for the
        transfer log, oldest first."""
        events: list[TransferEvent] = []
        for rep in reports:
            events.extend(self._feed_one(rep))
        return events

    def _feed_one(self, rep: RankReport) -> list[TransferEvent]:
        self.world_size = max(self.world_size, rep.world_size, rep.rank + 1)
        counts = self.ranks.get(rep.rank)
        if counts is None or counts.pid != rep.pid:  # first report, or a restarted worker
            counts = self.ranks[rep.rank] = RankCounts(rep.rank, rep.pid)
        counts.reports_total += 1
        counts.lapses_total = rep.lapses_total
        counts.late_reads_total = rep.late_reads_total
        counts.dropped_total = rep.dropped_total
        counts.errors_total = rep.errors_total
        counts.finished_sending_total += len(rep.finished_sending)
        counts.finished_recving_total += len(rep.finished_recving)
        live = self._live.setdefault(rep.rank, {})
        live.update(rep.deadlines)
        events: list[TransferEvent] = []
        for lapse in rep.lapses:
            self._partial_of(lapse.request_id).lapsed[rep.rank] = lapse
        for rid in rep.finished_sending:
            live.pop(rid, None)
            part = self._partial_of(rid)
            part.ranks_done.add(rep.rank)
            if len(part.ranks_done) >= self.world_size:
                del self._partial[rid]
                events.extend(self._ended(rid, part))
        for late in rep.late_reads:
            lapsed_ranks = self._lapsed_on.get(late.request_id)
            pending = self._partial.get(late.request_id)
            if pending is not None:  # its other ranks still hold it: wait for the end
                pending.late_reads.append(late)
            elif lapsed_ranks is not None:
                events.append(TransferEvent(TransferEventKind.LATE_READ, late.request_id,
                                            late.at))
        return events

    def _partial_of(self, rid: str) -> _Partial:
        part = self._partial.get(rid)
        if part is None:
            part = self._partial[rid] = _Partial()
            while len(self._partial) > MAX_PARTIAL:
                self._partial.popitem(last=False)
                self.partial_dropped_total += 1
        return part

    def _ended(self, rid: str, part: _Partial) -> list[TransferEvent]:
        if not part.lapsed:
            return []  # ended by reads on every rank: vLLM's finished_sending says so
        lapses = list(part.lapsed.values())
        at = max(lp.at for lp in lapses)
        reads = min(lp.reads for lp in lapses)
        unread = any(lp.reads == 0 for lp in lapses)
        outcome = (TransferOutcome.EXPIRED_UNREAD if unread
                   else TransferOutcome.EXPIRED_PARTLY_READ
                   if any(lp.reads < lp.expected_reads for lp in lapses)
                   else TransferOutcome.READ)
        self._lapsed_on[rid] = set(part.lapsed)
        while len(self._lapsed_on) > MAX_PARTIAL:
            self._lapsed_on.popitem(last=False)
        events = [TransferEvent(TransferEventKind.ENDED, rid, at, outcome=outcome,
                                reads=reads)]
        events.extend(TransferEvent(TransferEventKind.LATE_READ, rid, late.at)
                      for late in part.late_reads)
        return events
