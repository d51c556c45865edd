"""Test tooling, never in kvguard's runtime: a vLLM ``Scheduler`` for the KV-event tests.

Loaded in the server's EngineCore with ``--scheduler-cls kv_truth_scheduler.KvTruthScheduler``
(this directory on ``PYTHONPATH``). It does two things, both outside kvguard:

* **Ground truth.** After every step (and every ``reset_prefix_cache``) it writes vLLM's own
  pool, read with vLLM's own functions, to ``$KVG_TEST_TRUTH_DIR/truth.json``: every key of
  ``BlockPool.cached_block_hash_to_block`` as ``[group, "b"|"i", hash]`` (hex for bytes hashes),
  and the number of batches its publisher was handed (counted here, independently of kvguard).
* **A fault below kvguard**, armed by writing ``N`` to ``$KVG_TEST_TRUTH_DIR/arm_drop_removed``
  (read and deleted at the next batch): the next ``N`` ``BlockRemoved`` events are taken out of
  their batch before the batch reaches vLLM's publisher (the batch itself still goes out, so
  sequence numbers stay contiguous): the pool really evicted those blocks and no subscriber
  can ever learn it. The dropped keys go to ``dropped.json``; ``removed`` in the truth counts
  the BlockRemoved events that did go out. ``arm_drop_stored`` does the same for the next
  ``N`` ``BlockStored`` events (keys to ``dropped_stored.json``): blocks the pool caches that
  no subscriber ever hears of.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id, maybe_convert_block_hash
from vllm.v1.core.sched.scheduler import Scheduler


def _hash_json(h: bytes | int) -> list[Any]:
    return ["b", h.hex()] if isinstance(h, bytes) else ["i", int(h)]


def _write(path: Path, payload: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, path)


class KvTruthScheduler(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._truth_dir = Path(os.environ["KVG_TEST_TRUTH_DIR"])
        self._drop_left = 0
        self._drop_stored_left = 0
        self._dropped_stored: list[list[Any]] = []
        self._removed = 0
        self._dropped: list[list[Any]] = []
        self._batches = 0
        publisher = self.kv_event_publisher
        inner = publisher.publish

        arm = self._truth_dir / "arm_drop_removed"
        arm_stored = self._truth_dir / "arm_drop_stored"

        def publish(batch: Any) -> None:
            if arm.exists():
                self._drop_left += int(arm.read_text())
                arm.unlink()
            if arm_stored.exists():
                self._drop_stored_left += int(arm_stored.read_text())
                arm_stored.unlink()
            if self._drop_stored_left > 0:
                kept_stored = []
                for ev in batch.events:
                    if self._drop_stored_left > 0 and isinstance(ev, BlockStored):
                        self._drop_stored_left -= 1
                        self._dropped_stored += [[ev.group_idx or 0, *_hash_json(h)]
                                                 for h in ev.block_hashes]
                        continue
                    kept_stored.append(ev)
                batch.events = kept_stored
                _write(self._truth_dir / "dropped_stored.json", self._dropped_stored)
            if self._drop_left > 0:
                kept = []
                for ev in batch.events:
                    if self._drop_left > 0 and isinstance(ev, BlockRemoved):
                        self._drop_left -= 1
                        self._dropped += [[ev.group_idx or 0, *_hash_json(h)]
                                          for h in ev.block_hashes]
                        continue
                    kept.append(ev)
                batch.events = kept
                _write(self._truth_dir / "dropped.json", self._dropped)
            self._removed += sum(isinstance(ev, BlockRemoved) for ev in batch.events)
            inner(batch)
            self._batches += 1

        publisher.publish = publish

    def _dump(self) -> None:
        pool = self.kv_cache_manager.block_pool
        raw = pool.cached_block_hash_to_block._cache
        keys = [[get_group_id(k), *_hash_json(maybe_convert_block_hash(get_block_hash(k)))]
                for k in raw]
        _write(self._truth_dir / "truth.json",
               {"keys": keys, "batches": self._batches, "pending": len(pool.kv_event_queue),
                "removed": self._removed,
                "requests": len(self.requests)})

    def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
        out = super().update_from_output(*args, **kwargs)
        self._dump()
        return out

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> Any:
        out = super().reset_prefix_cache(*args, **kwargs)
        self._dump()
        return out
