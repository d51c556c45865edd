"""Target 10: what kvguard's side of the KV-event mirror check costs the engine, end to end.

An engine that publishes KV events (``--kv-events-config``, what KV-aware routers consume)
gets kvguard's KV-event tap: a wrapper on its publisher's ``publish`` (one counter increment
per step with events) and, at each drained checkpoint, one pass over the pool's cached
blocks. This is ``bench_throughput.py``'s ``interleaved-kv-events-sync`` mode: two engines
in one process, both publishing KV events (ZMQ on ``ipc://``, no subscriber: PUB drops
unread messages) with kvguard's hooks in on both, stepped in turn; the treatment is the
tap alone, in on one engine and out on the other, roles swapped each pair, in
``KVGUARD_BENCH_THROUGHPUT_PROCESSES`` worker processes. Result:
``bench/results/throughput_kv_events.json``. Target: no measurable change, i.e. a 95 %
interval at most +-0.5 % wide that holds 1.00x. Beside it, the tap's own time on the engine
thread (its two parts timed with ``perf_counter``, whose own cost is counted in, and in the
treated engine's time too) over the treated engine's time, per process.
"""

from __future__ import annotations

import os

os.environ.setdefault("KVGUARD_BENCH_THROUGHPUT_MODES", "interleaved-kv-events-sync")
# 150 s per process: about 40 pairs each, which the +-0.5 % width needs over 3 processes
# (the 90 s default gave +-2.2 % on 2026-12-06). 8.5 minutes in all here.
os.environ.setdefault("KVGUARD_BENCH_THROUGHPUT_SECONDS", "300")
os.environ.setdefault("KVGUARD_BENCH_THROUGHPUT_RESULT", "throughput_kv_events")

import bench_throughput  # reads the two settings above when imported

if __name__ == "__main__":
    bench_throughput.main()
