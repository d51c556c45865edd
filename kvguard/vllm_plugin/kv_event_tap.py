"""``KvEventTap``: the engine's side of the KV-event mirror check (vLLM).

Two things, both on the scheduler thread, both contained (a failure is counted in
``errors_total`` and never reaches the engine):

* **Sequence numbers.** vLLM's ``ZmqEventPublisher`` numbers batches in the order
  ``publish`` hands them over (its thread takes them from a FIFO queue and numbers each one,
  from 0, per process). The tap wraps the scheduler's publisher's ``publish`` (one counter
  increment per step that has events), so ``batches_published - 1`` is the sequence number of
  the last batch handed over, known on the engine thread without reading the publisher's
  thread. It also wraps ``BlockPool.reset_prefix_cache`` (rare) to learn which batch carries
  each ``AllBlocksCleared``, and asks the engine's guard for a checkpoint right away: vLLM
  publishes the clear only at its next step, so an idle engine would otherwise leave the
  pre-reset comparison standing as the current one; the checkpoint reads the pool with the
  clear still queued (``pending_events``), which the sidecar reports as ``pending``.
* **The pool's hashed blocks** at a drained checkpoint (:meth:`KvEventTap.snapshot`): the keys
  of ``BlockPool.cached_block_hash_to_block`` converted to the form the events carry (vLLM's
  own ``get_group_id`` and ``maybe_convert_block_hash``), their count and digest
  (:mod:`kvguard.kv_events.digest`), and the keys themselves up to ``max_keys``. Cost: one pass
  over the cached blocks on the engine thread at a drained checkpoint: 1.4 µs per cached block
  measured here (144 ms for 100k, on 2 loaded cores); nothing between checkpoints but one
  counter increment per step that has events (0.3 µs).

Installed only when the scheduler has a real publisher (``--kv-events-config`` with
``enable_kv_cache_events``); otherwise :func:`maybe_tap_kv_events` returns None and nothing
is wrapped.
"""

from __future__ import annotations

import logging
from typing import Any

from kvguard.kv_events.digest import SetDigest, block_key
from kvguard.kv_events.snapshot import KvEventsSnapshot, KvEventsState
from kvguard.vllm_plugin.versions import (
    BLOCK_POOL_ENABLE_KV_CACHE_EVENTS,
    BLOCK_POOL_KV_EVENT_QUEUE,
    BLOCK_POOL_MEDIUM,
    HASH_MAP_CACHE,
    SCHEDULER_KV_EVENT_PUBLISHER,
    read,
)

log = logging.getLogger("kvguard")


class KvEventTap:
    """Batches handed to one scheduler's KV-event publisher, and its pool's hashed blocks."""

    def __init__(self, scheduler: Any, *, max_keys: int) -> None:
        from vllm import envs
        from vllm.distributed.kv_events import AllBlocksCleared

        self._scheduler = scheduler
        publisher = read(scheduler, SCHEDULER_KV_EVENT_PUBLISHER)
        config = publisher.get_publisher_config()
        self.endpoint: str = str(config.endpoint)
        self.replay_endpoint: str | None = config.replay_endpoint
        self.topic: str = config.topic or ""
        self.block_pool = scheduler.kv_cache_manager.block_pool
        self.medium: str | None = read(self.block_pool, BLOCK_POOL_MEDIUM)
        self.max_keys = max_keys
        self.batches_published = 0
        """Batches handed to the publisher (the last one's sequence number is this - 1)."""
        self.clear_seq: int | None = None
        self.clears_total = 0
        self.errors_total = 0
        self._clear_queued = False
        self._cleared_type = AllBlocksCleared
        self._int_hashes = bool(envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
        """vLLM's ``maybe_convert_block_hash`` mode, read once (vLLM reads the variable on
        every call; it does not change while the engine runs)."""
        self._wrap_publish(publisher)
        self._wrap_reset(self.block_pool)

    def _wrap_publish(self, publisher: Any) -> None:
        orig = publisher.publish

        def publish(events: Any) -> None:
            orig(events)  # raises exactly as without kvguard (then nothing was queued)
            self.batches_published += 1
            if self._clear_queued:
                try:
                    if any(type(e) is self._cleared_type for e in events.events):
                        self.clear_seq = self.batches_published - 1
                        self._clear_queued = False
                except Exception:
                    self.errors_total += 1

        publisher.publish = publish

    def _wrap_reset(self, pool: Any) -> None:
        orig = pool.reset_prefix_cache

        def reset_prefix_cache(*args: Any, **kwargs: Any) -> Any:
            done = orig(*args, **kwargs)
            if done and read(pool, BLOCK_POOL_ENABLE_KV_CACHE_EVENTS, False):
                self._clear_queued = True
                self.clears_total += 1
                self._checkpoint_soon()
            return done

        pool.reset_prefix_cache = reset_prefix_cache

    def _checkpoint_soon(self) -> None:
        """Ask the guard (set on the scheduler by ``attach``) for a checkpoint, and wake an
        idle engine for it (engine thread: ``reset_prefix_cache`` runs there)."""
        try:
            guard = getattr(self._scheduler, "_kvguard", None)
            if guard is None:
                return
            guard.request_checkpoint()
            waker = guard.idle_waker
            if waker is not None:
                waker.wake_after(0.0)
        except Exception:
            self.errors_total += 1

    def snapshot(self, checkpoint_id: int, taken_at: float) -> KvEventsSnapshot:
        """The pool's hashed blocks now, at batch ``batches_published - 1``. Engine thread."""
        cache = self.block_pool.cached_block_hash_to_block
        raw = read(cache, HASH_MAP_CACHE, cache)
        keys = self._keys(list(raw))
        digest = SetDigest(keys)
        if len(keys) <= self.max_keys:
            keys.sort()
        return KvEventsSnapshot(
            checkpoint_id=checkpoint_id, taken_at=taken_at,
            last_seq=self.batches_published - 1, clear_seq=self.clear_seq,
            pending_events=len(read(self.block_pool, BLOCK_POOL_KV_EVENT_QUEUE, ()) or ()),
            num_blocks=digest.count, digest=digest.hex,
            block_keys=keys if len(keys) <= self.max_keys else None)

    def _keys(self, raw: list[bytes]) -> list[str]:
        """Pool keys (``BlockHashWithGroupId``: the hash, then the group as 4 big-endian
        bytes; vLLM's ``get_block_hash``/``get_group_id``) as event keys, inlined: a pool of
        100k cached blocks is read at a drained checkpoint, on the engine thread. The
        real-server tests compare the result with vLLM's own functions."""
        if self._int_hashes:  # 64-bit truncation may merge two keys: the events carry one
            mask = (1 << 64) - 1
            return list(dict.fromkeys(block_key(int.from_bytes(k[-4:], "big"),
                                                int.from_bytes(k[:-4], "big") & mask)
                                      for k in raw))
        return [block_key(int.from_bytes(k[-4:], "big"), k[:-4]) for k in raw]

    def state(self, snapshot: KvEventsSnapshot | None) -> KvEventsState:
        return KvEventsState(
            endpoint=self.endpoint, replay_endpoint=self.replay_endpoint, topic=self.topic,
            medium=self.medium, batches_published=self.batches_published,
            clears_total=self.clears_total, errors_total=self.errors_total, snapshot=snapshot)


def maybe_tap_kv_events(scheduler: Any, *, max_keys: int) -> KvEventTap | None:
    """A tap on ``scheduler``'s KV-event stream, or None when it publishes no KV events.
    Never raises: a vLLM without the expected attributes logs one line and gets no tap."""
    publisher = read(scheduler, SCHEDULER_KV_EVENT_PUBLISHER)
    if publisher is None or type(publisher).__name__ == "NullEventPublisher":
        return None
    try:
        return KvEventTap(scheduler, max_keys=max_keys)
    except Exception as exc:
        log.warning("kvguard cannot follow this engine's KV events (%s: %s); the KV-event "
                    "mirror check is off for it", type(exc).__name__, exc)
        return None
