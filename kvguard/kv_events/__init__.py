"""The KV-event mirror check: does a router's mirror of an engine's cached blocks, built only
from the KV events the engine publishes, match the engine's real pool?

Three parts, one job each:

* :mod:`~kvguard.kv_events.digest`: a block's canonical key and an exact, order-free digest of
  a set of keys (both sides compute it the same way);
* :mod:`~kvguard.kv_events.snapshot`: what the engine publishes at a drained checkpoint (the
  pool's hashed blocks, the sequence number of the last event batch emitted before);
* :mod:`~kvguard.kv_events.mirror` and :mod:`~kvguard.kv_events.subscriber`: the sidecar's
  mirror, kept the way a router keeps it (ZMQ SUB, replay from the ROUTER endpoint on a gap);
* :mod:`~kvguard.kv_events.verdict`: the comparison of one snapshot with the mirror at the
  same sequence number, and its verdict.

Nothing here runs on the engine's thread except the snapshot read (at drained checkpoints).
"""
