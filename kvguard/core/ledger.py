"""The ownership ledger: which request holds which KV blocks, fed by engine hooks.

The ledger is kvguard's own memory of block ownership. It deliberately
outlives the engine's bookkeeping: when vLLM pops a request's block table but
the blocks never return to the pool, the engine has forgotten who held them,
while the ledger still names the request, its finish reason and the exit path.

Invariants (checked by the property tests in ``tests/core``):

* ``owners_of(b)`` and each record's ``blocks`` describe the same multiset of
  (request, block) references; the null block is never recorded.
* A reference is released at most once. A release with no matching
  acquisition is recorded as a double free, never as a negative count.
* Memory is bounded: a finished request that holds nothing and has no transfer
  or deferred free pending is compacted into ``num_finished_compacted`` right
  away, so records exist only for live requests and for finished requests that
  still hold blocks (at most the pool size).

The ledger is not thread-safe; the engine calls it from its one scheduler
thread. It imports neither vLLM nor torch.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Final, cast

from kvguard.core.types import (
    AcquireKind,
    BlockId,
    FinishReason,
    LeakPath,
    RequestId,
    RequestPhase,
    finish_reason_path,
)

DOUBLE_FREE_HISTORY = 1024
"""How many double-free events the ledger remembers in detail (the count is exact)."""

EVENT_KINDS: Final = ("admit", "preempt", "finish", "delayed_free_begin", "delayed_free_end",
                      "deferred_free", "free", "release",
                      *(k.value for k in AcquireKind),
                      *(f"finish_{r.value}" for r in FinishReason))
"""Every key of ``OwnershipLedger.num_events``."""
_FINISH_KEY: Final = {r.value: f"finish_{r.value}" for r in FinishReason}

# The phases as module constants: a global load is specialised by CPython, an enum class
# attribute is not (142 ns per ``RequestPhase.WAITING`` on CPython 3.11, measured).
_WAITING: Final = RequestPhase.WAITING
_RUNNING: Final = RequestPhase.RUNNING
_PREEMPTED: Final = RequestPhase.PREEMPTED
_FINISHED: Final = RequestPhase.FINISHED
_CODE_KIND: Final = tuple(AcquireKind)
_KIND_CODE: Final = {k: i for i, k in enumerate(_CODE_KIND)}
"""``AcquireKind`` <-> the low bit of an unattributed tag (``_unattributed_tag``)."""
if len(_CODE_KIND) > 2:
    raise RuntimeError("OwnershipLedger tags an unattributed acquisition's kind in one bit: "
                       "widen the tag (_unattributed_tag) for a third AcquireKind")


@dataclass(slots=True)
class RequestRecord:
    """What the ledger knows about one request. Owned and mutated by the ledger only."""

    request_id: RequestId
    client_request_id: str
    admitted_at: float
    phase: RequestPhase = RequestPhase.WAITING
    finish_reason: FinishReason | None = None
    finished_at: float | None = None
    freed_at: float | None = None
    """When the engine declared the request freed (it may still hold blocks: a leak)."""
    num_preemptions: int = 0
    delayed_free_pending: bool = False
    """The KV connector asked to keep the blocks until its transfer completes."""
    delayed_free_started_at: float | None = None
    hold_deadline: float | None = None
    """The KV connector's own deadline for this delayed free (Unix s, renewals included,
    e.g. a NIXL lease that the decode side's heartbeats extend); ``None``: the connector
    exposes none and the configured bound applies from ``delayed_free_started_at``."""
    hold_source: str | None = None
    """Where ``hold_deadline`` was read (for the finding's detail)."""
    waited_for_remote_kv: bool = False
    """It finished while waiting for its KV from a remote engine (P/D decode side)."""
    remote_peer: str | None = None
    """Which remote engine and request it waited for, in words (P/D decode side)."""
    deferred_free_pending: bool = False
    """Blocks were popped for a free that waits for an in-flight step (``deferred_frees``)."""
    blocks: dict[BlockId, int] = field(default_factory=dict)
    """Block id -> number of references this request holds on it (normally 1)."""

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def exit_path(self) -> LeakPath:
        """The path a finished request took out of the engine: where a leak would hide."""
        if self.waited_for_remote_kv:
            return LeakPath.REMOTE_KV_WAIT
        if self.delayed_free_started_at is not None:
            return LeakPath.DELAYED_FREE
        if self.deferred_free_pending:
            return LeakPath.DEFERRED_FREE
        if self.finish_reason is None:
            return LeakPath.UNKNOWN
        path = finish_reason_path(self.finish_reason)
        if path is LeakPath.FINISH and self.num_preemptions:
            return LeakPath.PREEMPTION
        return path


@dataclass(frozen=True, slots=True)
class DoubleFreeEvent:
    """A release of a reference the ledger does not know to be held."""

    block_id: BlockId
    request_id: RequestId | None
    path: LeakPath


def same_id(request_id: str) -> str:
    """The default id mapping: the engine's request id is the client's."""
    return request_id


class OwnershipLedger:
    """Block ownership per request, with lifecycle phase, finish reason and times.

    All ``at`` arguments are Unix time in seconds (``time.time()``).
    """

    def __init__(self, *, null_block_ids: Iterable[int] = (0,),
                 client_id_of: Callable[[str], str] = same_id) -> None:
        """``null_block_ids``: the engine's placeholder blocks, never recorded.
        ``client_id_of``: maps the engine's internal request id to the client's (the
        engine adapter knows how; the default keeps the id)."""
        self.client_id_of = client_id_of
        self._null_blocks = frozenset(BlockId(b) for b in null_block_ids)
        self.num_double_frees = 0
        self.num_finished_compacted: Counter[FinishReason] = Counter()
        self._events: dict[str, int] = dict.fromkeys(EVENT_KINDS, 0)
        """Monotonic counts per event kind, kept across ``reset``. An exact ``dict`` with
        every key present: the hooks' ``d[k] += 1`` then takes CPython's specialised dict
        path (a ``Counter`` is a subclass and does not: 3x slower per event, measured)."""
        self._serial = 0
        """Unattributed acquisitions so far; monotonic across ``reset``."""
        self.reset()

    def reset(self) -> None:
        """Forget every record and reference, in place (hooks keep their reference to the
        ledger); the event counters keep counting."""
        self._records: dict[RequestId, RequestRecord] = {}
        # Block -> its owners. Compact on purpose (most blocks have one owner holding
        # one reference): the value is then the owner's RequestId itself (a string the
        # record already holds, so it costs no allocation); a dict otherwise.
        self._owners: dict[BlockId, RequestId | dict[RequestId, int]] = {}
        self._shared: set[BlockId] = set()
        """The blocks whose ``_owners`` value is a dict (for audits: everything else is one
        request holding one reference)."""
        self._unattributed: dict[BlockId, int] = {}
        self._unattributed_tag: dict[BlockId, int] = {}
        """Block -> its latest unattributed acquisition: ``serial << 1 | kind code``
        (``_KIND_CODE``). One dict for both: each such block costs one write when taken and
        one removal when claimed, on the hook path, instead of two."""
        self.double_frees: deque[DoubleFreeEvent] = deque(maxlen=DOUBLE_FREE_HISTORY)

    @property
    def null_block_ids(self) -> frozenset[BlockId]:
        return self._null_blocks

    @property
    def num_events(self) -> Counter[str]:
        """Monotonic event counts (exported as counters), kept across ``reset``: only the
        kinds that happened, a copy."""
        return Counter({k: n for k, n in self._events.items() if n})

    # ----------------------------------------------------------------- queries
    def record(self, request_id: RequestId) -> RequestRecord | None:
        return self._records.get(request_id)

    def records(self) -> Iterable[RequestRecord]:
        return self._records.values()

    def records_map(self) -> Mapping[RequestId, RequestRecord]:
        """Request -> record, read-only, for audits (a lookup without a method call)."""
        return self._records

    def owners_of(self, block_id: BlockId) -> Mapping[RequestId, int]:
        owners = self._owners.get(block_id)
        if owners is None:
            return {}
        if isinstance(owners, str):
            return {owners: 1}
        return owners

    def owners_map(self) -> Mapping[BlockId, RequestId | Mapping[RequestId, int]]:
        """Block -> owners, read-only, for audits: a ``RequestId`` when one request holds one
        reference, else {request: references}."""
        return self._owners

    def shared_block_ids(self) -> AbstractSet[BlockId]:
        """Blocks with more than one recorded reference (several owners, or one owner
        twice), read-only: every other owned block has one owner holding one reference."""
        return self._shared

    def unattributed_map(self) -> Mapping[BlockId, int]:
        """Block -> references no request has claimed yet."""
        return self._unattributed

    def owned_block_ids(self) -> Iterable[BlockId]:
        """Blocks with at least one recorded owner or unattributed reference."""
        return self._owners.keys() | self._unattributed.keys()

    def latest_double_free(self, block_id: int) -> DoubleFreeEvent | None:
        """The most recent remembered release of an unheld reference on ``block_id``."""
        return next((e for e in reversed(self.double_frees) if e.block_id == block_id), None)

    def unattributed_refs(self, block_id: BlockId) -> int:
        return self._unattributed.get(block_id, 0)

    def unattributed_kind(self, block_id: BlockId) -> AcquireKind | None:
        tag = self._unattributed_tag.get(block_id)
        return None if tag is None else _CODE_KIND[tag & 1]

    def unattributed_serial(self, block_id: BlockId) -> int:
        """Which pool call took the block's latest unattributed reference (0: none).

        Serials grow with every unattributed acquisition, so a block freed and taken
        again between two audits never shows the same serial twice: the online audit
        uses it to tell a reference nobody claimed from a new one."""
        return self._unattributed_tag.get(block_id, 0) >> 1

    @property
    def num_records(self) -> int:
        return len(self._records)

    @property
    def num_ownerships(self) -> int:
        """Live (request, block) references held in the ledger."""
        return sum(map(len, [r.blocks for r in self._records.values()]))

    def num_live_requests(self) -> int:
        """Requests not finished. Counted at C speed (the state is built once a second on
        the engine thread, over every record)."""
        phases = [r.phase for r in self._records.values()]
        return len(phases) - phases.count(RequestPhase.FINISHED)

    def finished_holding(self) -> list[RequestRecord]:
        """Finished requests that still hold at least one block."""
        finished = RequestPhase.FINISHED  # one enum lookup, not one per record
        return [r for r in self._records.values() if r.phase is finished and r.blocks]

    # ------------------------------------------------------------- lifecycle
    def on_request_admitted(self, request_id: RequestId, at: float) -> None:
        self._events["admit"] += 1
        if request_id in self._records:
            return  # re-admission of a streaming session: keep what it holds
        self._records[request_id] = RequestRecord(
            request_id=request_id,
            client_request_id=self.client_id_of(request_id),
            admitted_at=at,
        )

    def adopt(self, request_id: RequestId, at: float) -> None:
        """Track a request first met mid-life (records rebuilt from the engine's tables).
        Counts no event."""
        self._ensure(request_id, at)

    def on_request_preempted(self, request_id: RequestId) -> None:
        self._events["preempt"] += 1
        rec = self._records.get(request_id) or self._ensure(request_id)
        rec.phase = _PREEMPTED
        rec.num_preemptions += 1

    def on_request_finished(self, request_id: RequestId, reason: FinishReason, at: float) -> None:
        ev = self._events
        ev["finish"] += 1
        ev[_FINISH_KEY[reason._value_]] += 1
        rec = self._records.get(request_id) or self._ensure(request_id, at)
        rec.phase = _FINISHED
        rec.finish_reason = reason
        rec.finished_at = at

    def on_delayed_free_started(self, request_id: RequestId, at: float) -> None:
        """The KV connector keeps the request's blocks until its transfer completes."""
        self._events["delayed_free_begin"] += 1
        rec = self._ensure(request_id, at)
        rec.delayed_free_pending = True
        rec.delayed_free_started_at = at

    def on_hold_deadline(self, request_id: RequestId, deadline: float, source: str) -> None:
        """The KV connector's deadline for a delayed free (latest wins: a renewal moves it
        later, the connector letting go of the hold moves it to the moment it did)."""
        rec = self._records.get(request_id)
        if rec is not None and rec.delayed_free_pending:
            rec.hold_deadline = deadline
            rec.hold_source = source

    def on_waited_for_remote_kv(self, request_id: RequestId, peer: str | None = None) -> None:
        """The request finished while waiting for its KV from a remote engine (``peer``:
        which engine and request, in words)."""
        rec = self._records.get(request_id)
        if rec is not None:
            rec.waited_for_remote_kv = True
            rec.remote_peer = peer

    def on_deferred_free_started(self, request_id: RequestId) -> None:
        """The request's blocks were popped for a free that waits for an in-flight step."""
        self._events["deferred_free"] += 1
        self._ensure(request_id).deferred_free_pending = True

    def on_request_freed(self, request_id: RequestId, at: float) -> None:
        """The engine is done with the request (its block free was issued or skipped)."""
        self._events["free"] += 1
        rec = self._records.get(request_id)
        if rec is None:
            return
        if rec.delayed_free_pending:
            self._events["delayed_free_end"] += 1
        rec.delayed_free_pending = False
        rec.freed_at = at
        self._maybe_compact(rec)

    # ---------------------------------------------------------------- blocks
    # The three methods below run inside the engine's scheduler step, once per pool call
    # (about once per ``block_size`` tokens per request): their common cases are inlined
    # (one block, one owner, one reference), and no enum attribute, ``Counter`` or
    # per-block method call is on that path. A plain loop, on purpose: C-level bulk
    # updates (``dict.fromkeys``, ``map`` over dict methods) measured 1.5-2x slower for
    # the 1-16 blocks an event carries (CPython 3.11 specialises the loop's dict ops).
    def on_blocks_acquired(
        self,
        request_id: RequestId | None,
        block_ids: Iterable[int],
        kind: AcquireKind,
    ) -> None:
        """Record one reference per block, for ``request_id`` or unattributed."""
        self._events[kind._value_] += 1
        nulls = self._null_blocks
        if request_id is None:
            self._serial += 1
            tag = self._serial << 1 | _KIND_CODE[kind]
            unattributed = self._unattributed
            tags = self._unattributed_tag
            for bid in cast(Iterable[BlockId], block_ids):
                if bid in nulls:
                    continue
                unattributed[bid] = unattributed.get(bid, 0) + 1
                tags[bid] = tag
            return
        rec = self._records.get(request_id) or self._ensure(request_id)
        phase = rec.phase
        if phase is _WAITING or phase is _PREEMPTED:
            rec.phase = _RUNNING
        held = rec.blocks
        owners = self._owners
        for bid in cast(Iterable[BlockId], block_ids):
            if bid in nulls:
                continue
            if bid in owners:
                self._add_ref(rec, bid)
            else:  # a block nobody holds: its first reference
                held[bid] = 1
                owners[bid] = request_id

    def claim(self, request_id: RequestId, block_ids: Iterable[int]) -> None:
        """Make sure ``request_id`` holds each block, per the engine's own block table.

        Unattributed references (seen by a pool hook with no request at hand)
        are claimed first; a block the request already holds is left alone.
        Never removes anything: a block the engine dropped from its table
        without freeing it must stay on the request's record as evidence.
        """
        rec = self._records.get(request_id)
        if rec is None:
            return
        ids = block_ids if isinstance(block_ids, list) else list(block_ids)
        if not ids:
            return
        if rec.phase is _WAITING or rec.phase is _PREEMPTED:
            rec.phase = _RUNNING  # it holds blocks again: it was scheduled
        held = rec.blocks
        # At a finish or preemption the request usually holds all of them already.
        new = [b for b in cast(list[BlockId], ids) if b not in held]
        if not new:
            return
        nulls = self._null_blocks
        owners = self._owners
        unattributed = self._unattributed
        # An id listed twice (two KV groups' tables) is claimed once.
        for bid in dict.fromkeys(new) if len(new) > 1 else new:
            if bid in nulls:
                continue
            n = unattributed.get(bid, 0)
            if n == 1:  # the common case: the one reference an allocation left unnamed
                del unattributed[bid]
                self._unattributed_tag.pop(bid, None)
            elif n:  # a prefix shared before any claim: one of several, still unnamed
                unattributed[bid] = n - 1
            if bid in owners:
                self._add_ref(rec, bid)
            else:
                held[bid] = 1
                owners[bid] = request_id

    def on_blocks_released(
        self, request_id: RequestId | None, block_ids: Iterable[int]
    ) -> None:
        """Release one reference per block.

        With ``request_id``, the reference comes off that request. Without,
        it comes off the owner that is expected to be freeing (see
        ``_release_rank``): a finished request being freed, a preempted one, a
        live one, an unattributed reference, and last a request already freed.
        """
        self._events["release"] += 1
        nulls = self._null_blocks
        owners = self._owners
        if request_id is not None:
            rec = self._records.get(request_id)
            held: dict[BlockId, int] = rec.blocks if rec is not None else {}
            for bid in cast(Iterable[BlockId], block_ids):
                if bid in nulls:
                    continue
                if bid in held:
                    if held[bid] == 1 and owners.get(bid) == request_id:
                        # The common case: its one reference, and nobody else's.
                        del held[bid]
                        del owners[bid]
                    else:
                        self._drop_ref(cast(RequestRecord, rec), bid)
                elif self._unattributed.get(bid, 0) > 0:
                    self._take_unattributed(bid)
                else:
                    self._record_double_free(bid, request_id, rec)
            if rec is not None and not rec.blocks:
                self._after_release(rec)
            return
        for bid in cast(Iterable[BlockId], block_ids):
            if bid in nulls:
                continue
            owner = self._pick_releasing_owner(bid)
            if owner is not None and self._release_rank(owner)[0] < 3:
                self._drop_ref(owner, bid)
            elif self._unattributed.get(bid, 0) > 0:
                self._take_unattributed(bid)
                continue
            elif owner is not None:
                self._drop_ref(owner, bid)
            else:
                self._record_double_free(bid, None, None)
                continue
            self._after_release(owner)

    def compact(self, request_id: RequestId) -> None:
        """Forget ``request_id`` if it is finished, freed and holds nothing (as a free
        does; for a finish learnt after the free)."""
        rec = self._records.get(request_id)
        if rec is not None:
            self._maybe_compact(rec)

    def release_request(self, request_id: RequestId) -> None:
        """Give back every reference ``request_id`` holds, without a pool event (the engine
        freed it and no release can be seen: ``EventsSeen.pool_events`` off). Counts no
        event and no double free."""
        rec = self._records.get(request_id)
        if rec is None or not rec.blocks:
            return
        for bid, n in list(rec.blocks.items()):
            for _ in range(n):
                self._drop_ref(rec, bid)
        self._after_release(rec)

    # -------------------------------------------------------------- internals
    def _ensure(self, request_id: RequestId, at: float = 0.0) -> RequestRecord:
        rec = self._records.get(request_id)
        if rec is None:
            # A request the hooks first see mid-life (plugin loaded late, or a
            # missed admit): track it from here on.
            rec = RequestRecord(
                request_id=request_id,
                client_request_id=self.client_id_of(request_id),
                admitted_at=at,
            )
            self._records[request_id] = rec
        return rec

    def _add_ref(self, rec: RequestRecord, bid: BlockId) -> None:
        rec.blocks[bid] = rec.blocks.get(bid, 0) + 1
        rid = rec.request_id
        owners = self._owners.get(bid)
        if owners is None:
            self._owners[bid] = rid
        elif isinstance(owners, str):
            self._owners[bid] = {rid: 2} if owners == rid else {owners: 1, rid: 1}
            self._shared.add(bid)
        else:
            owners[rid] = owners.get(rid, 0) + 1

    def _drop_ref(self, rec: RequestRecord, bid: BlockId) -> None:
        """Take one reference on ``bid`` off ``rec``; the caller then calls
        :meth:`_after_release` (compaction is judged once per release call)."""
        n = rec.blocks[bid] - 1
        if n:
            rec.blocks[bid] = n
        else:
            del rec.blocks[bid]
        rid = rec.request_id
        owners = self._owners[bid]
        if isinstance(owners, str):
            del self._owners[bid]
        else:
            m = owners[rid] - 1
            if m:
                owners[rid] = m
            else:
                del owners[rid]
            if not owners:
                del self._owners[bid]
                self._shared.discard(bid)
            elif len(owners) == 1:
                ((only, refs),) = owners.items()
                if refs == 1:
                    self._owners[bid] = only
                    self._shared.discard(bid)

    def _after_release(self, rec: RequestRecord) -> None:
        """After references came off ``rec`` (once per release call, not per block)."""
        if not rec.blocks:
            if rec.deferred_free_pending:
                rec.deferred_free_pending = False
            self._maybe_compact(rec)

    def _take_unattributed(self, bid: BlockId) -> None:
        n = self._unattributed[bid] - 1
        if n:
            self._unattributed[bid] = n
        else:
            del self._unattributed[bid]
            self._unattributed_tag.pop(bid, None)

    @staticmethod
    def _release_rank(rec: RequestRecord) -> tuple[int, float]:
        """Who gives a reference back when the engine does not say: lower ranks first.

        A finished request whose free is in progress, then a preempted one (its
        blocks are being freed), then other live owners; a finished request
        already declared freed comes last (an unattributed reference goes first).
        """
        if rec.phase is _FINISHED:
            if rec.freed_at is None:
                return (0, rec.finished_at or 0.0)
            return (3, rec.finished_at or 0.0)
        if rec.phase is _PREEMPTED:
            return (1, 0.0)
        return (2, 0.0)

    def _pick_releasing_owner(self, bid: BlockId) -> RequestRecord | None:
        owners = self.owners_of(bid)
        if not owners:
            return None
        return min((self._records[rid] for rid in owners), key=self._release_rank)

    def _record_double_free(
        self, bid: BlockId, request_id: RequestId | None, rec: RequestRecord | None
    ) -> None:
        self.num_double_frees += 1
        path = rec.exit_path if rec is not None else LeakPath.UNKNOWN
        self.double_frees.append(DoubleFreeEvent(bid, request_id, path))

    def _maybe_compact(self, rec: RequestRecord) -> None:
        if (
            rec.phase is _FINISHED
            and rec.freed_at is not None
            and not rec.blocks
            and not rec.delayed_free_pending
        ):
            del self._records[rec.request_id]
            self.num_finished_compacted[rec.finish_reason or FinishReason.UNKNOWN] += 1

