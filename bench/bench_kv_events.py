"""Target 10: what kvguard's side of the KV-event mirror check costs the engine, end to end.

The throughput benchmark's pairing on two engines that both publish KV events with
kvguard's hooks in: the treatment is kvguard's KV-event tap alone (its publish wrapper and
its drained-checkpoint read of the cached blocks), in 3 processes.

This is ``bench_throughput.py``'s ``interleaved-kv-events-sync`` mode (ZMQ on ``ipc://``,
no subscriber: PUB drops unread messages), into ``bench/results/throughput_kv_events.json``.
Target: no measurable change, a 95 % interval at most +-0.5 % wide that holds 1.00x.
Beside it, the tap's own engine-thread time (its two parts clocked) over its engine's.
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
