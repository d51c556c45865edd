"""vLLM's KV-event wire format decoded without vLLM (:mod:`kvguard.kv_events.wire`), against
what vLLM's own ``ZmqEventPublisher`` sends and vLLM's own types decode; and the subscriber
following that publisher in a process where ``vllm`` and ``torch`` cannot be imported (the
sidecar's image has neither)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)

from kvguard.errors import ProtocolError
from kvguard.kv_events.mirror import Cleared, Event, Removed, Stored
from kvguard.kv_events.wire import decode_batch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def h(i: int) -> bytes:
    """A 32-byte block hash, as vLLM's sha256 prefix hashes are published."""
    return bytes([i]) * 32


def key(group: int | None, block_hash: bytes | int) -> str:
    """The key format docs/kv-events.md documents (written out, not kvguard's function)."""
    g = group or 0
    return f"{g}:{block_hash.hex()}" if isinstance(block_hash, bytes) else f"{g}:#{block_hash}"


def stored(hashes: list[bytes | int], parent: bytes | int | None = None, *, n_tokens: int = 32,
           medium: str = "GPU", **extra: Any) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=[7] * n_tokens,
                       block_size=32, lora_id=None, medium=medium, lora_name=None, **extra)


BATCHES_A = [
    [stored([h(1), h(2)], n_tokens=64)],
    [stored([h(3)], h(2), group_idx=1, extra_keys=[None])],
    [BlockRemoved(block_hashes=[h(1)], medium="GPU")],
    [stored([77])],  # an int hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    [stored([h(9)], medium="CPU")],  # another medium: not the pool's
]
BATCHES_B = [
    [BlockRemoved(block_hashes=[h(3)], medium="GPU", group_idx=1)],
    [stored([h(4)], h(2)), stored([h(5)], h(4))],
]
MIRRORED = sorted([key(0, h(2)), key(0, 77), key(0, h(4)), key(0, h(5))])
"""The GPU blocks A then B leave resident."""


@pytest.fixture
def publisher() -> Iterator[tuple[ZmqEventPublisher, str, str]]:
    with tempfile.TemporaryDirectory(prefix="kvwire-", dir="/tmp") as d:
        pub_ep, rep_ep = f"ipc://{d}/pub", f"ipc://{d}/replay"
        pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=rep_ep)
        try:
            yield pub, pub_ep, rep_ep
        finally:
            pub.shutdown()


def publish(pub: ZmqEventPublisher, batches: list[list[Any]]) -> None:
    """Hand ``batches`` to vLLM's publisher and wait until its thread has sent them all."""
    before = len(pub._buffer)
    for events in batches:
        pub.publish(KVEventBatch(ts=time.time(), events=events))
    deadline = time.monotonic() + 20
    while len(pub._buffer) < before + len(batches):
        assert time.monotonic() < deadline, "vLLM's publisher did not send the batches"
        time.sleep(0.01)


def as_vllm_decodes(batch: KVEventBatch) -> list[Event]:
    """What each event means, read from vLLM's own decoding of the payload."""
    out: list[Event] = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            g = ev.group_idx
            out.append(Stored([key(g, x) for x in ev.block_hashes],
                              None if ev.parent_block_hash is None
                              else key(g, ev.parent_block_hash),
                              len(ev.token_ids), ev.medium))
        elif isinstance(ev, BlockRemoved):
            out.append(Removed([key(ev.group_idx, x) for x in ev.block_hashes], ev.medium))
        else:
            assert isinstance(ev, AllBlocksCleared)
            out.append(Cleared())
    return out


def test_every_batch_vllms_publisher_sends_decodes_to_what_vllms_own_types_read(
        publisher: tuple[ZmqEventPublisher, str, str]) -> None:
    pub, _, _ = publisher
    publish(pub, [*BATCHES_A, [AllBlocksCleared()], *BATCHES_B, []])
    vllm_decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    payloads = [payload for _, payload in pub._buffer]  # the bytes vLLM sent, as it keeps them
    assert len(payloads) == len(BATCHES_A) + 1 + len(BATCHES_B) + 1
    for payload in payloads:
        assert decode_batch(payload) == as_vllm_decodes(vllm_decoder.decode(payload))
    assert decode_batch(payloads[len(BATCHES_A)]) == [Cleared()]


def test_the_array_schema_vllms_example_subscriber_documents_decodes_too() -> None:
    """``examples/online_serving/kv_events_subscriber.py`` declares the events
    ``array_like`` (positional); vLLM 0.32 sends maps. Both decode the same."""

    class Event(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):  # type: ignore[call-arg]
        pass

    class BlockStored(Event):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class BlockRemoved(Event):
        block_hashes: list[bytes | int]
        medium: str | None

    class AllBlocksCleared(Event):
        pass

    class Batch(msgspec.Struct, array_like=True, omit_defaults=True):  # type: ignore[call-arg]
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    payload = msgspec.msgpack.encode(Batch(ts=1.0, events=[
        BlockStored([h(1), 5], None, [7] * 64, 32, None, "GPU"),
        BlockStored([h(2)], 5, [7] * 32, 32, None, None),
        BlockRemoved([h(1)], "GPU"), AllBlocksCleared()]))
    assert msgspec.msgpack.decode(payload)[1][0][0] == "BlockStored"  # positional, tagged
    assert decode_batch(payload) == [
        Stored([key(0, h(1)), key(0, 5)], None, 64, "GPU"),
        Stored([key(0, h(2))], key(0, 5), 32, None),
        Removed([key(0, h(1))], "GPU"), Cleared()]


@pytest.mark.parametrize("payload", [
    b"\xc1", msgspec.msgpack.encode({"ts": 1.0}), msgspec.msgpack.encode([1.0, [7]]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "medium": "GPU"}]]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}]]),
], ids=["not-msgpack", "a-map", "an-int-event", "no-hashes", "a-string-hash"])
def test_a_payload_that_is_not_a_kv_event_batch_is_a_protocol_error(payload: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_batch(payload)


def test_an_event_type_kvguard_does_not_know_is_skipped_not_fatal() -> None:
    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockPinned", "block_hashes": [1]},
                                            {"type": "AllBlocksCleared"}]])
    assert decode_batch(payload) == [Cleared()]


def test_the_subscriber_follows_vllms_publisher_with_vllm_and_torch_unimportable(
        publisher: tuple[ZmqEventPublisher, str, str]) -> None:
    """The sidecar's case: kvguard's sidecar and subscriber imported in a process where any
    import of vllm or torch fails; it catches up from vLLM's replay endpoint, then follows
    live batches, and its mirror holds exactly the GPU blocks vLLM's batches left."""
    pub, pub_ep, rep_ep = publisher
    publish(pub, BATCHES_A)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, str(HERE / "_blocked_subscriber.py"), pub_ep, rep_ep,
         str(len(BATCHES_A) - 1)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline()
        assert line == "caught-up\n", line + child.communicate(timeout=30)[1]
        publish(pub, BATCHES_B)
        out, err = child.communicate(f"{len(BATCHES_A) + len(BATCHES_B) - 1}\n", timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    got = json.loads(out)
    assert got["loaded"] == []
    assert got["keys"] == MIRRORED
    assert (got["lost"], got["decode_errors"], got["other_medium"]) == (0, 0, 1)
    assert got["replayed"] >= len(BATCHES_A)  # the catch-up came from vLLM's replay endpoint
