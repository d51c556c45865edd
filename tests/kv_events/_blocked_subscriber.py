"""Test tooling (run as a script by test_wire.py): kvguard's KV-event subscriber in a process
where ``vllm`` and ``torch`` cannot be imported, as in the sidecar's image.

Usage: ``python _blocked_subscriber.py PUB_ENDPOINT REPLAY_ENDPOINT THROUGH``. Catches up to
batch ``THROUGH`` (replay), prints ``caught-up``, reads the last batch number to wait for
from stdin (live SUB, replay on a gap), then prints one JSON line: the mirror's keys, its
counters, and the vllm/torch modules loaded (none, or the import failed first).
"""

from __future__ import annotations

import importlib.abc
import json
import sys
import time


class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.split(".")[0] in ("vllm", "torch"):
            raise ModuleNotFoundError(f"{name} is blocked in this process", name=name)


sys.meta_path.insert(0, _Blocked())
try:
    import torch  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("the blocker let torch through")

import kvguard.sidecar.app  # noqa: E402, F401  (the sidecar, as its image imports it)
from kvguard.kv_events.subscriber import KvEventSubscriber, SubscriberOptions  # noqa: E402


def _wait_for(sub: KvEventSubscriber, seq: int) -> None:
    deadline = time.monotonic() + 30
    while sub.mirror.last_seq < seq:
        if time.monotonic() > deadline or sub.error:
            raise SystemExit(f"stuck at {sub.mirror.last_seq} (wanted {seq}): {sub.error}")
        time.sleep(0.02)


def main() -> None:
    pub_ep, replay_ep, through = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sub = KvEventSubscriber(SubscriberOptions(endpoint=pub_ep, replay_endpoint=replay_ep,
                                              medium="GPU", tail_retry_seconds=0.1))
    sub.start(timeout=10)
    sub.want_through(through)
    _wait_for(sub, through)
    print("caught-up", flush=True)
    last = int(sys.stdin.readline())
    _wait_for(sub, last)
    with sub.lock:
        out = {"keys": sorted(sub.mirror.blocks), "last_seq": sub.mirror.last_seq,
               "received": sub.received_total, "replayed": sub.replayed_batches_total,
               "lost": sub.lost_batches_total, "decode_errors": sub.decode_errors_total,
               "other_medium": sub.mirror.other_medium_events,
               "loaded": sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "torch"))}
    sub.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
