"""The subscriber against vLLM's own ``ZmqEventPublisher`` over real ZMQ (``ipc://``), in this
process: replay on a gap (answers cut short and resumed, batches that left vLLM's buffer, a
replay endpoint that never answers), restarts, and a subscriber without replay. The
engine-side events here are hand-made batches; test_kv_events_server.py runs the whole check
on a real server."""

from __future__ import annotations

import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher

from kvguard.kv_events.digest import block_key, digest_hex
from kvguard.kv_events.snapshot import KvEventsSnapshot
from kvguard.kv_events.subscriber import KvEventSubscriber, SubscriberOptions
from kvguard.kv_events.verdict import KvEventsVerdict, MirrorFacts, judge


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
               drop: Callable[[int, bool], bool] | None = None, *,
               replay_timeout_seconds: float = 2.0) -> tuple[KvEventSubscriber, int]:
    """A subscriber whose SUB connection is up (ZMQ's slow joiner: empty batches are
    published until one arrives on SUB); returns it and the next sequence number."""
    sub = KvEventSubscriber(SubscriberOptions(endpoint=pub_ep, replay_endpoint=replay_ep,
                                              medium="GPU", tail_give_up_seconds=1.0,
                                              replay_timeout_seconds=replay_timeout_seconds),
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


def test_a_restarted_publisher_numbered_past_the_old_run_is_told_by_its_replay(
        endpoints: tuple[str, str]) -> None:
    """The new publisher's first batches never reach SUB (a slow reconnect: they are
    filtered here), so the first one SUB sees is numbered past everything the old run sent.
    Only the replay can tell: the last batch applied comes back with other content."""
    pub_ep, rep_ep = endpoints
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=rep_ep)
    new_run_hidden_through = [-1]  # SUB drops the new run's batches up to this number
    sub, first = subscriber(pub, pub_ep, rep_ep,
                            drop=lambda seq, replayed: replayed or
                            seq > new_run_hidden_through[0])
    try:
        for h in (1, 2, 3):
            pub.publish(stored(h))
        until(lambda: sub.mirror.last_seq == first + 2, "the first publisher's batches")
        pub.shutdown()
        new_run_hidden_through[0] = first + 3
        pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=rep_ep)  # seq from 0
        for _ in range(first + 4):  # 0 .. first + 3: SUB never sees them
            pub.publish(KVEventBatch(ts=time.time(), events=[]))
        pub.publish(stored(9))  # first + 4
        deadline = time.monotonic() + 20
        while sub.mirror.last_seq < first + 4:  # until SUB is connected again
            assert time.monotonic() < deadline, "the new publisher's batches never arrived"
            pub.publish(KVEventBatch(ts=time.time(), events=[]))
            time.sleep(0.05)
        assert sub.restarts_total == 1 and set(sub.mirror.blocks) == {block_key(None, 9)}
        assert sub.lost_batches_total == 0 and not sub.gap_open
    finally:
        sub.close()
        pub.shutdown()


@pytest.mark.parametrize("buffer_steps", [20_000, 100], ids=["replay-repairs", "replay-too-short"])
def test_a_burst_past_the_publishers_hwm_is_dropped_by_zmq_and_every_batch_accounted_for(
        endpoints: tuple[str, str], buffer_steps: int) -> None:
    """A real ZMQ drop: the subscriber stalls (its input path waits) while vLLM's publisher
    sends 8000 batches through a high-water mark of 10 on both sockets; ZMQ discards what does
    not fit. Replay gives back what vLLM's buffer still holds; the rest is counted lost.

    The replays are cut short by real ZMQ drops too: vLLM 0.32's ROUTER keeps ZMQ's default
    send mark (1000), and the subscriber (receive mark 10) does not read an answer until
    vLLM's publisher has sent all of it, so each answer stops after about a thousand batches,
    its end marker dropped with the rest. Each is resumed from where it stopped."""
    pub_ep, rep_ep = endpoints
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=rep_ep, hwm=10,
                            buffer_steps=buffer_steps)
    go, hold = threading.Event(), [False]
    answers_sent = threading.Semaphore(0)
    serve_replay = pub._service_replay

    def serve_whole_answer_then_count() -> None:
        serve_replay()
        answers_sent.release()

    pub._service_replay = serve_whole_answer_then_count  # type: ignore[method-assign]
    answers_read = [0]

    def stall(_seq: int, replayed: bool) -> bool:
        if hold[0] and not replayed:
            go.wait(60)
            hold[0] = False
        if replayed and sub.replays_total > answers_read[0]:
            answers_read[0] = sub.replays_total  # an answer's first batch: let vLLM finish it
            assert answers_sent.acquire(timeout=60)
        return True

    sub = KvEventSubscriber(SubscriberOptions(endpoint=pub_ep, replay_endpoint=rep_ep,
                                              medium="GPU", receive_hwm=10,
                                              tail_give_up_seconds=1.0),
                            input_filter=stall)
    sub.start(timeout=30)
    try:
        first = connect(pub, sub, 0)
        received = sub.received_total
        hold[0] = True
        n = 8000
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
            # answers cut short many times in a row, each resumed: nothing lost
            assert sub.replays_truncated_total >= 3, sub.replays_truncated_total
            assert sub.lost_batches_total == 0 and not sub.gap_open
        else:
            assert sub.lost_batches_total > n // 2 and sub.gap_open  # most of the burst
    finally:
        go.set()
        sub.close()
        pub.shutdown()


def test_batches_that_left_vllms_replay_buffer_are_a_gap_naming_them(
        endpoints: tuple[str, str]) -> None:
    """The subscriber falls behind by more than vLLM's ``buffer_steps``: replay starts past
    the batches it missed, which are lost (exactly the ones vLLM's buffer no longer holds);
    the verdict on the pool is ``gap``, naming the blocks those batches stored."""
    pub_ep, rep_ep = endpoints
    pub = ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=rep_ep, buffer_steps=4)
    go, missed = threading.Event(), [1 << 62]

    def miss_one_and_fall_behind(seq: int, replayed: bool) -> bool:
        if seq == missed[0] and not replayed:
            go.wait(60)  # the publisher goes on meanwhile: the batch leaves its buffer
            return False
        return True

    sub, first = subscriber(pub, pub_ep, rep_ep, drop=miss_one_and_fall_behind)
    missed[0] = first
    try:
        for h in range(10):
            pub.publish(stored(h))
        until(lambda: pub._event_queue.empty(), "the publisher to send the batches")
        oldest_buffered = min(seq for seq, _ in pub._buffer)  # vLLM's own buffer
        assert oldest_buffered > first
        go.set()
        until(lambda: sub.mirror.last_seq == first + 9, "the batches after the loss")
        assert list(sub.gaps)[-1] == (first, oldest_buffered - 1) and sub.gap_open
        lost_blocks = {block_key(None, h) for h in range(oldest_buffered - first)}
        pool_keys = sorted(block_key(None, h) for h in range(10))
        with sub.lock:
            view = sub.mirror.view_at(first + 9)
            facts = MirrorFacts(last_seq=sub.mirror.last_seq, clear_seq=sub.mirror.clear_seq,
                                lost_since_reset=sub.gap_open)
        snap = KvEventsSnapshot(checkpoint_id=1, taken_at=0.0, last_seq=first + 9,
                                num_blocks=len(pool_keys), digest=digest_hex(pool_keys),
                                block_keys=pool_keys)
        check = judge(snap, view, facts, engine_epoch=None, now=0.0)
        assert check.verdict is KvEventsVerdict.GAP, check.explanation
        assert set(check.first_missing) == lost_blocks and check.stale_blocks == 0
    finally:
        go.set()
        sub.close()
        pub.shutdown()


def test_a_replay_endpoint_that_never_answers_gives_the_missing_batch_up_as_lost(
        endpoints: tuple[str, str]) -> None:
    """Nothing answers on the replay endpoint (a ROUTER that reads requests and never
    replies): the last batch, dropped on the way, is asked for until
    ``tail_give_up_seconds`` and then counted lost; no answer is counted truncated."""
    pub_ep, rep_ep = endpoints
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent.bind(rep_ep)
    pub = ZmqEventPublisher(0, endpoint=pub_ep)
    last = [1 << 62]
    sub, first = subscriber(pub, pub_ep, rep_ep, drop=lambda seq, _r: seq != last[0],
                            replay_timeout_seconds=0.3)
    last[0] = first + 2
    replays, lost = sub.replays_total, sub.lost_batches_total  # a probe SUB missed is lost
    try:
        for h in range(3):
            pub.publish(stored(h))
        until(lambda: sub.mirror.last_seq >= first + 1, "the batches before the lost one")
        sub.want_through(first + 2)  # the engine says it published batch first + 2
        until(lambda: sub.lost_batches_total == lost + 1, "the subscriber to give it up")
        assert list(sub.gaps)[-1] == (first + 2, first + 2) and sub.gap_open
        assert silent.poll(0)  # the replay was asked for, and never answered
        assert sub.replays_total > replays and sub.replays_truncated_total == 0
        assert set(sub.mirror.blocks) == {block_key(None, 0), block_key(None, 1)}
    finally:
        sub.close()
        pub.shutdown()
        silent.close(linger=0)
