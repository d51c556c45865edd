"""``Mirror``: one engine's resident prefix blocks as a router believes them, built only from the
engine's KV events.

Owned by one :class:`~kvguard.kv_events.subscriber.KvEventSubscriber` (its thread applies
batches); readers take :meth:`Mirror.view_at` under the subscriber's lock. Events arrive here
already decoded into kvguard's own records (:class:`Stored`, :class:`Removed`,
:class:`Cleared`): the mirror does not import vLLM, and it never holds token ids (a stored
block keeps its parent key and its token *count* only).

Semantics, as routers apply them (llm-d's indexer, Dynamo's radix tree): a set of block keys
for one medium; ``Stored`` adds keys (a key already present stays, once), ``Removed`` drops
them (a key not present is counted in ``unknown_removes`` and ignored), ``Cleared`` empties
the set. Events of another medium are counted and skipped.

Invariants: ``digest`` always equals ``digest_hex(blocks)``; ``last_seq`` is the highest
sequence number applied (-1 before any); the undo log holds, for each of the last
``undo_batches`` batches applied, exactly what it added and removed, so that the mirror as it
was after any batch still in the log can be rebuilt (``view_at``).
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
    """One block the mirror holds: its parent's key, tokens in it, and when it arrived."""

    parent: str | None
    num_tokens: int
    stored_seq: int


@dataclass(slots=True)
class _Delta:
    seq: int
    added: list[str] = field(default_factory=list)
    removed: dict[str, MirrorBlock] = field(default_factory=dict)


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
                delta.removed.update((k, b) for k, b in self.blocks.items()
                                     if k not in delta.removed)
                self.blocks.clear()
                self.digest.clear()
                self.clear_seq = seq
            elif ev.medium is not None and self.medium is not None and ev.medium != self.medium:
                self.other_medium_events += 1
                continue
            elif isinstance(ev, Stored):
                parent = ev.parent
                for key in ev.keys:
                    if key not in self.blocks:
                        self.blocks[key] = MirrorBlock(parent, ev.num_tokens // max(1, len(
                            ev.keys)), seq)
                        self.digest.add(key)
                        delta.added.append(key)
                    parent = key
            else:
                for key in ev.keys:
                    block = self.blocks.pop(key, None)
                    if block is None:
                        self.unknown_removes += 1
                        continue
                    self.digest.remove(key)
                    if key not in delta.removed:
                        delta.removed[key] = block
            self.events_applied += 1
        self._undo.append(delta)
        self.last_seq = seq
        self.batches_applied += 1

    def view_at(self, seq: int) -> MirrorView | None:
        """The mirror's keys right after batch ``seq``; None when the undo log does not reach
        back that far (or ``seq`` is ahead of the mirror)."""
        if seq > self.last_seq:
            return None
        keys = set(self.blocks)
        for delta in reversed(self._undo):
            if delta.seq <= seq:
                break
            keys.difference_update(delta.added)
            keys.update(delta.removed)
        else:
            oldest = self._undo[0].seq if self._undo else self.last_seq + 1
            if seq < max(self._base_seq, oldest - 1):
                return None
        return MirrorView(seq, frozenset(keys))
