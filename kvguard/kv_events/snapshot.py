"""What the engine publishes for the KV-event check: its pool's hashed blocks at one point of
its own event stream.

Written by the engine side (:mod:`kvguard.vllm_plugin.kv_event_tap`) at each drained
checkpoint, inside the engine's state file (``EngineState.kv_events``); read by the sidecar's
mirror check (:mod:`kvguard.kv_events.verdict`).

Invariant: ``num_blocks``, ``digest`` and ``block_keys`` describe the pool exactly as it was
when the batch numbered ``last_seq`` had been handed to the engine's event publisher and no
later one had (the snapshot is read on the engine thread, the only thread that hands batches
over). ``pending_events`` > 0 breaks this (events queued in the pool, not yet in a batch):
such a snapshot is published but never compared.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class KvEventsSnapshot(BaseModel):
    """The pool's hashed blocks at one sequence number of the engine's KV-event stream."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    checkpoint_id: int = Field(description="The drained checkpoint this snapshot was read at.")
    taken_at: float = Field(description="Unix time, s.")
    last_seq: int = Field(ge=-1, description="Sequence number of the last batch handed to the "
                                             "publisher before the snapshot; -1: none yet.")
    clear_seq: int | None = Field(default=None, description="Sequence number of the batch that "
                                  "carried the engine's last AllBlocksCleared (None: no clear "
                                  "since the engine started).")
    pending_events: int = Field(default=0, ge=0, description="Events queued in the pool, not "
                                "yet in a batch; > 0: not comparable.")
    num_blocks: int = Field(ge=0, description="Distinct block keys the pool holds.")
    digest: str = Field(description="Order-free digest of those keys (kvguard.kv_events.digest).")
    block_keys: list[str] | None = Field(default=None, description="The keys themselves, sorted, "
                                         "when at most KVGUARD_KV_EVENTS_MAX_KEYS (names the "
                                         "first differing blocks); None above that.")

    @property
    def comparable(self) -> bool:
        return self.pending_events == 0


class KvEventsState(BaseModel):
    """The engine's KV-event stream as kvguard sees it from inside the engine (published from
    attach on, so that a reader can subscribe before the first drained checkpoint)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    endpoint: str = Field(description="The engine's KV-event PUB endpoint as it bound it (the "
                                      "data-parallel offset applied).")
    replay_endpoint: str | None = Field(default=None, description="Its ROUTER replay endpoint.")
    topic: str = ""
    medium: str | None = Field(default=None, description="The medium the pool's events carry "
                                                         "(vLLM: GPU); others are not compared.")
    batches_published: int = Field(default=0, ge=0, description="Batches handed to the "
                                   "publisher since the engine started (at the last publish).")
    clears_total: int = Field(default=0, ge=0, description="Prefix-cache resets that queued "
                                                           "AllBlocksCleared.")
    errors_total: int = Field(default=0, ge=0, description="Failures in kvguard's tap, contained.")
    snapshot: KvEventsSnapshot | None = Field(default=None, description="At the last drained "
                                              "checkpoint; None before the first.")
