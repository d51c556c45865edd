"""The subscriber against vLLM's own ``ZmqEventPublisher`` over real ZMQ (``ipc://``), in this
process: replay on a gap, restarts, and a subscriber without replay. The engine-side events
here are hand-made batches; test_kv_events_server.py runs the whole check on a real server."""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

from kvguard.kv_events.digest import block_key
from kvguard.kv_events.subscriber import KvEventSubscriber, SubscriberOptions


@pytest.fixture
def endpoints() -> Iterator[tuple[str, str]]:
    with tempfile.TemporaryDirectory(prefix="kvsub-", dir="/tmp") as d:
        yield f"ipc://{Path(d)}/pub", f"ipc://{Path(d)}/replay"


def stored(h: int) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=[h], parent_block_hash=None, token_ids=[7] * 32, block_size=32,
        lora_id=None, medium="GPU", lora_name=None)])


def removed(h: int) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=[BlockRemoved(block_hashes=[h], medium="GPU")])


def until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 20
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def subscriber(pub: ZmqEventPublisher, pub_ep: str, replay_ep: str | None,
               drop: Callable[[int, bool], bool] | None = None) -> tuple[KvEventSubscriber, int]:
    """A subscriber whose SUB connection is up (ZMQ's slow joiner: empty batches are
    published until one arrives on SUB); returns it and the next sequence number."""
    sub = KvEventSubscriber(SubscriberOptions(endpoint=pub_ep, replay_endpoint=replay_ep,
                                              medium="GPU", tail_give_up_seconds=1.0),
                            input_filter=drop)
    sub.start(timeout=30)
    return sub, connect(pub, sub, 0)


def connect(pub: ZmqEventPublisher, sub: KvEventSubscriber, seq: int) -> int:
    """Publish empty batches from ``seq`` on until SUB delivers one; the next number."""
    received = sub.received_total
    deadline = time.monotonic() + 20
    while sub.received_total == received:
        assert time.monotonic() < deadline, "the SUB connection never came up"
        pub.publish(KVEventBatch(ts=time.time(), events=[]))
        seq += 1
        time.sleep(0.05)
    until(lambda: sub.mirror.last_seq == seq - 1, "the probes applied")
    return seq


def test_a_dropped_message_is_replayed_and_never_counted_twice(
        endpoints: tuple[str, str]) -> None:
    pub_ep, rep_ep = endpoints
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=rep_ep)
    lost = [1 << 62]  # set once connected: the first workload batch but one
    sub, first = subscriber(pub, pub_ep, rep_ep,
                            drop=lambda seq, replayed: replayed or seq != lost[0])
    lost[0] = first + 1
    replays, filtered = sub.replays_total, sub.filtered_total  # the probes may need some
    try:
        for batch in (stored(1), stored(2), removed(1), stored(3)):
            pub.publish(batch)
        until(lambda: sub.mirror.last_seq == first + 3, "all four batches applied")
        assert set(sub.mirror.blocks) == {block_key(None, 2), block_key(None, 3)}
        assert (sub.filtered_total - filtered, sub.replays_total - replays) == (1, 1)
        assert sub.lost_batches_total == 0
        assert sub.restarts_total == 0
    finally:
        sub.close()
        pub.shutdown()


def test_without_replay_a_lost_batch_stays_a_gap(endpoints: tuple[str, str]) -> None:
    pub_ep, _ = endpoints
    pub = ZmqEventPublisher(0, endpoint=pub_ep)
    lost = [1 << 62]
    sub, first = subscriber(pub, pub_ep, None, drop=lambda seq, _replayed: seq != lost[0])
    lost[0] = first + 1
    gaps, lost_before = len(sub.gaps), sub.lost_batches_total  # a probe SUB missed is lost
    try:
        for batch in (stored(1), stored(2), stored(3)):
            pub.publish(batch)
        until(lambda: sub.mirror.last_seq == first + 2, "the batches after the loss applied")
        assert list(sub.gaps)[gaps:] == [(first + 1, first + 1)] and sub.gap_open
        assert sub.lost_batches_total - lost_before == 1
        assert set(sub.mirror.blocks) == {block_key(None, 1), block_key(None, 3)}
    finally:
        sub.close()
        pub.shutdown()


def test_a_restarted_publisher_on_the_same_endpoint_starts_the_mirror_over(
        endpoints: tuple[str, str]) -> None:
    pub_ep, rep_ep = endpoints
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=rep_ep)
    sub, first = subscriber(pub, pub_ep, rep_ep)
    try:
        for h in (1, 2, 3):
            pub.publish(stored(h))
        until(lambda: sub.mirror.last_seq == first + 2, "the first publisher's batches")
        pub.shutdown()
        pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=rep_ep)  # seq from 0
        seq = connect(pub, sub, 0)  # SUB reconnects; the first new batch is a restart
        pub.publish(stored(9))
        until(lambda: sub.mirror.last_seq == seq, "the new publisher's batch")
        assert sub.restarts_total == 1 and set(sub.mirror.blocks) == {block_key(None, 9)}
    finally:
        sub.close()
        pub.shutdown()


@pytest.mark.parametrize("buffer_steps", [20_000, 100], ids=["replay-repairs", "replay-too-short"])
def test_a_burst_past_the_publishers_hwm_is_dropped_by_zmq_and_every_batch_accounted_for(
        endpoints: tuple[str, str], buffer_steps: int) -> None:
    """A real ZMQ drop: the subscriber stalls (its input path waits) while vLLM's publisher
    sends 5000 batches through a high-water mark of 10 on both sockets; ZMQ discards what does
    not fit. Replay gives back what vLLM's buffer still holds; the rest is counted lost."""
    pub_ep, rep_ep = endpoints
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=rep_ep, hwm=10,
                            buffer_steps=buffer_steps)
    go, hold = threading.Event(), [False]

    def stall_once(_seq: int, replayed: bool) -> bool:
        if hold[0] and not replayed:
            go.wait(60)
            hold[0] = False
        return True

    sub = KvEventSubscriber(SubscriberOptions(endpoint=pub_ep, replay_endpoint=rep_ep,
                                              medium="GPU", receive_hwm=10,
                                              tail_give_up_seconds=1.0),
                            input_filter=stall_once)
    sub.start(timeout=30)
    try:
        first = connect(pub, sub, 0)
        received = sub.received_total
        hold[0] = True
        n = 5000
        for h in range(n):
            pub.publish(stored(h))
        until(lambda: pub._event_queue.empty(), "the publisher to send the burst")
        go.set()
        sub.want_through(first + n - 1)
        until(lambda: sub.mirror.last_seq == first + n - 1, "the burst applied or lost")
        assert sub.received_total - received < n  # ZMQ dropped part of the burst
        assert sub.replays_total >= 1
        # every batch of the burst is either applied (its block mirrored) or counted lost
        assert len(sub.mirror.blocks) == n - sub.lost_batches_total
        if buffer_steps >= n:
            assert sub.lost_batches_total == 0 and not sub.gap_open
        else:
            assert sub.lost_batches_total > n // 2 and sub.gap_open  # most of the burst
    finally:
        sub.close()
        pub.shutdown()
