"""``Mirror``: one engine's resident prefix blocks as a router believes them, built only from the
engine's KV events.

Owned by one :class:`~kvguard.kv_events.subscriber.KvEventSubscriber` (its thread applies
batches); readers take :meth:`Mirror.view_at` under the subscriber's lock. Events arrive here
already decoded into kvguard's own records (:class:`Stored`, :class:`Removed`,
:class:`Cleared`): the mirror does not import vLLM, and it never holds token ids (a stored
block keeps its parent key and its token *count* only).

Semantics: the set of block keys one medium holds, with the number of cached **copies** of
each. vLLM announces every copy it caches and every copy it evicts: two requests that
computed the same block (the same prompt, then the same generated tokens) each cache their
own block under one key, vLLM's pool maps that key to both, and evicting one of them
publishes ``BlockRemoved`` for the key while the other copy still serves hits. So
``Stored`` adds one copy of each key, ``Removed`` takes one away and drops the key only at
its last copy (a key not present is counted in ``unknown_removes`` and ignored), and
``Cleared`` empties the set. A mirror that treats ``Stored`` as idempotent and ``Removed`` as
final (a plain set) loses a key the pool still holds whenever a duplicate copy is evicted:
measured on a real data-parallel server here, where it was judged ``missing``
(``keys_with_copies`` counts the keys held more than once now). Events of another medium
are counted and skipped.

One stream this cannot mirror exactly: a request sent with vLLM's per-request
``kv_cache_report_mode="full"`` (``SamplingParams.extra_args``) makes vLLM re-announce its
prefix-cache hits as ``BlockStored`` without caching another copy; such keys are counted
once more than the pool holds, and can outlive their last eviction (judged ``stale``). The
default (``incremental``) announces only what is cached.

Invariants: ``digest`` always equals ``digest_hex(blocks)``; every block's ``copies`` is at
least 1; ``last_seq`` is the highest sequence number applied (-1 before any); the undo log
holds, for each of the last ``undo_batches`` batches applied, whether each key whose
presence it changed was present before it, so that the key set after any batch still in the
log can be rebuilt (``view_at``). A change in the number of copies of a key that stays
present changes no view, and is not logged.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from kvguard.kv_events.digest import SetDigest

UNDO_BATCHES = 4096
"""Batches the mirror can roll back (a snapshot older than this is not comparable)."""


class Stored(NamedTuple):
    keys: list[str]
    parent: str | None
    num_tokens: int
    medium: str | None


class Removed(NamedTuple):
    keys: list[str]
    medium: str | None


class Cleared(NamedTuple):
    pass


Event = Stored | Removed | Cleared


@dataclass(slots=True)
class MirrorBlock:
    """One block key the mirror holds: its parent's key, tokens in it, when it arrived, and
    how many cached copies of it the events announced (>= 1)."""

    parent: str | None
    num_tokens: int
    stored_seq: int
    copies: int = 1


@dataclass(slots=True)
class _Delta:
    """What one batch changed in the key set: for each key whose presence it changed, whether
    the key was present before the batch (recorded at its first change in the batch)."""

    seq: int
    present_before: dict[str, bool] = field(default_factory=dict)

    def changed(self, key: str, was_present: bool) -> None:
        self.present_before.setdefault(key, was_present)


class MirrorView(NamedTuple):
    """The mirror as it was right after batch ``seq`` (``keys``: its block keys)."""

    seq: int
    keys: frozenset[str]


class Mirror:
    """The set of block keys one engine's events say are resident, for one medium."""

    def __init__(self, medium: str | None, *, undo_batches: int = UNDO_BATCHES) -> None:
        self.medium = medium
        self.blocks: dict[str, MirrorBlock] = {}
        self.digest = SetDigest()
        self.last_seq = -1
        self.clear_seq: int | None = None
        """Sequence number of the last ``Cleared`` applied (None: none since the last reset)."""
        self.batches_applied = 0
        self.events_applied = 0
        self.unknown_removes = 0
        self.other_medium_events = 0
        self._undo: deque[_Delta] = deque(maxlen=undo_batches)
        self._base_seq = -1
        """The mirror is known from this sequence number on (undo cannot go before it)."""

    def reset(self, seq: int = -1) -> None:
        """Forget everything (an engine restart): the mirror starts empty at ``seq``."""
        self.blocks.clear()
        self.digest.clear()
        self.last_seq = seq
        self.clear_seq = None
        self._undo.clear()
        self._base_seq = seq

    def skip_to(self, seq: int) -> None:
        """Batches up to ``seq`` are lost for good: go on from there (the undo log cannot
        cross the hole, so views before ``seq`` become unavailable)."""
        self.last_seq = seq
        self._undo.clear()
        self._base_seq = seq

    def apply(self, seq: int, events: list[Event]) -> None:
        """Apply batch ``seq`` (> ``last_seq``; the subscriber orders and deduplicates)."""
        delta = _Delta(seq)
        for ev in events:
            if isinstance(ev, Cleared):
                for key in self.blocks:
                    delta.changed(key, True)
                self.blocks.clear()
                self.digest.clear()
                self.clear_seq = seq
            elif ev.medium is not None and self.medium is not None and ev.medium != self.medium:
                self.other_medium_events += 1
                continue
            elif isinstance(ev, Stored):
                parent = ev.parent
                for key in ev.keys:
                    held = self.blocks.get(key)
                    if held is not None:
                        held.copies += 1
                    else:
                        self.blocks[key] = MirrorBlock(parent, ev.num_tokens // max(1, len(
                            ev.keys)), seq)
                        self.digest.add(key)
                        delta.changed(key, False)
                    parent = key
            else:
                for key in ev.keys:
                    block = self.blocks.get(key)
                    if block is None:
                        self.unknown_removes += 1
                        continue
                    if block.copies > 1:
                        block.copies -= 1
                        continue
                    del self.blocks[key]
                    self.digest.remove(key)
                    delta.changed(key, True)
            self.events_applied += 1
        self._undo.append(delta)
        self.last_seq = seq
        self.batches_applied += 1

    @property
    def keys_with_copies(self) -> int:
        """Keys the events say are cached more than once now (duplicate copies)."""
        return sum(1 for b in self.blocks.values() if b.copies > 1)

    def view_at(self, seq: int) -> MirrorView | None:
        """The mirror's keys right after batch ``seq``; None when the undo log does not reach
        back that far (or ``seq`` is ahead of the mirror)."""
        if seq > self.last_seq:
            return None
        keys = set(self.blocks)
        for delta in reversed(self._undo):
            if delta.seq <= seq:
                break
            for key, was_present in delta.present_before.items():
                if was_present:
                    keys.add(key)
                else:
                    keys.discard(key)
        else:
            oldest = self._undo[0].seq if self._undo else self.last_seq + 1
            if seq < max(self._base_seq, oldest - 1):
                return None
        return MirrorView(seq, frozenset(keys))
