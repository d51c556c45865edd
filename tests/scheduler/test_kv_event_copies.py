"""The KV-event mirror follows vLLM's pool when a block key is cached more than once.

Two requests with the same prompt that generate the same tokens each cache their own block
under one key (vLLM's pool maps the key to both blocks); evicting one of them publishes
``BlockRemoved`` for the key while the other copy still serves hits. This drives vLLM's own
scheduler and ``BlockPool`` into that state under pool pressure, hands every batch vLLM
publishes through vLLM's msgpack encoding and kvguard's decoder into a
:class:`~kvguard.kv_events.mirror.Mirror`, and after every step compares the mirror's keys
with the keys of vLLM's ``cached_block_hash_to_block`` (the ground truth). A mirror that
treats the events as a plain set (``BlockRemoved`` final) loses such a key: that is what a
data-parallel server's rank was judged ``missing`` for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
from _sched import BLOCK_SIZE, Sched, _Vllm, build_scheduler, prompt
from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, maybe_convert_block_hash

from kvguard.kv_events.digest import block_key
from kvguard.kv_events.mirror import Mirror, Removed
from kvguard.kv_events.wire import decode_batch


def _pool_copies(pool: Any) -> dict[str, int]:
    """vLLM's hashed blocks as event keys (vLLM's own conversions), with the number of
    blocks cached under each."""
    return {block_key(get_group_id(k), maybe_convert_block_hash(get_block_hash(k))): n
            for k, n in _Vllm.cached_copies(pool).items()}


class _Tap:
    """Every batch the scheduler hands to its publisher, encoded as ``ZmqEventPublisher``
    encodes it (msgspec msgpack) and applied to a mirror through kvguard's decoder."""

    def __init__(self, scheduler: Any) -> None:
        self.mirror = Mirror("GPU")
        self.removed_keys: list[list[str]] = []
        self._encode = msgspec.msgpack.Encoder().encode
        publisher = scheduler.kv_event_publisher
        orig = publisher.publish

        def publish(batch: Any) -> None:
            orig(batch)
            events = decode_batch(self._encode(batch))
            self.removed_keys.append([k for e in events if isinstance(e, Removed)
                                      for k in e.keys])
            self.mirror.apply(self.mirror.last_seq + 1, events)

        publisher.publish = publish


def test_a_duplicate_copy_evicted_leaves_its_key_in_the_mirror_as_in_the_pool(
        tiny_model_dir: Path) -> None:
    s = Sched(build_scheduler(tiny_model_dir, num_blocks=48, max_num_seqs=8, kv_events=True))
    tap = _Tap(s.scheduler)
    most_copies = 0
    removed_while_cached = 0  # BlockRemoved for a key the pool still held after the batch
    differences: list[str] = []
    for round_ in range(12):
        # Twins: the same prompt, admitted together: they sample the same token each step
        # (the hand-made model output), so each fills its own decode blocks under one key.
        tokens = prompt(round_, 3 * BLOCK_SIZE + 5)
        s.add(tokens, 3 * BLOCK_SIZE)
        s.add(tokens, 3 * BLOCK_SIZE)
        # A stranger that needs most of the pool: it evicts cached blocks, LRU first, one
        # twin's copy before the other's when they were freed in different steps.
        s.add(prompt(1000 + round_, (10 + round_ % 4) * BLOCK_SIZE), 2)
        while s.scheduler.has_unfinished_requests():
            before = len(tap.removed_keys)
            s.step()
            pool = _pool_copies(s.pool)
            most_copies = max([most_copies, *pool.values()])
            for keys in tap.removed_keys[before:]:
                removed_while_cached += sum(1 for k in keys if k in pool)
            mirror = set(tap.mirror.blocks)
            if mirror != set(pool):
                differences.append(f"step {s.steps}: {len(set(pool) - mirror)} in the pool "
                                   f"only, {len(mirror - set(pool))} in the mirror only")
    assert most_copies >= 2, "vLLM never cached a key twice: the scenario did not happen"
    assert removed_while_cached > 0, (
        "no copy was evicted while another stayed cached: the scenario did not happen")
    assert differences == [], differences[:5]
