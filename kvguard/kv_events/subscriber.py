"""``KvEventSubscriber``: one engine's KV-event stream, received the way a router receives it.

A ZMQ SUB socket connected to the engine's PUB endpoint, on a daemon thread that owns both
its sockets (ZMQ sockets are not thread-safe). Each message is ``(topic, seq, payload)``: an
8-byte big-endian sequence number per batch and a msgpack ``KVEventBatch``, decoded without
vLLM (:func:`~kvguard.kv_events.wire.decode_batch`: the sidecar's image has neither vLLM nor
torch; pyzmq and msgspec are kvguard's own dependencies). Batches go
into a :class:`~kvguard.kv_events.mirror.Mirror` in sequence order:

* **gap** (a batch arrives after ``last_seq + 1``): ask the engine's ROUTER replay endpoint
  for everything from ``last_seq + 1`` (request ``[b"", start_seq]``; it streams buffered
  batches, then an end marker of eight 0xff bytes) and apply what closes the gap. An answer
  that stops early (vLLM 0.32's ROUTER keeps ZMQ's default send high-water mark of 1000, so
  a long replay loses its tail, end marker included, or a run in its middle) is
  **truncated** (``replays_truncated_total``) and resumed from the last applied batch + 1,
  as long as each answer brings new batches (:meth:`KvEventSubscriber._replay`). Batches
  are **lost** only when vLLM's bounded buffer no longer holds them (an answer starts past
  them), when an answer brings nothing new, or when there is no replay endpoint: the mirror
  goes on after them and records the range in ``gaps`` (``gap_open`` stays set until the
  mirror is known complete again: a clear, a restart, or a consistent comparison,
  :meth:`KvEventSubscriber.mark_in_sync`).
* **tail** (the engine says a batch was published that never arrived,
  :meth:`KvEventSubscriber.want_through`): the same replay, asked from the thread.
* **restart** (vLLM numbers batches per process, from 0, with no epoch): a SUB message whose
  sequence number goes backwards on SUB, or that reuses a number already applied with other
  content (the subscriber keeps a short hash of each of the last ``RECENT_BATCHES`` payloads),
  comes from a new publisher: the mirror is emptied and starts again, as a router should. A
  new publisher that numbered past the old run before SUB delivered any of its batches (a
  slow reconnect) looks like a gap on SUB; the replay then asks for the last batch applied
  again, and that number coming back with other content is the same restart. A late SUB
  copy of a batch already counted lost is skipped (it cannot be applied out of order).
* a batch already applied (delivered by a replay, then by SUB: same number, same payload) is
  skipped.

Nothing here holds token ids: decoding keeps each stored block's key, parent key and token
count (:class:`~kvguard.kv_events.mirror.Stored`).

``input_filter`` (tests only): called with each batch's sequence number, and whether it came
from a replay, before it is handled; False discards the batch as if it had been lost on the
way (counted in ``filtered_total``): dropping a SUB message models a ZMQ drop that replay can
repair, dropping a sequence number on both paths models one replay cannot give back.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvguard.kv_events.mirror import Cleared, Mirror
from kvguard.kv_events.wire import decode_batch

log = logging.getLogger("kvguard.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""vLLM's end-of-replay marker."""

MAX_GAPS_KEPT = 16

RECENT_BATCHES = 4096
"""Applied batches whose payload hash is kept, to tell a duplicate from a restarted engine's."""


@dataclass(frozen=True, slots=True)
class SubscriberOptions:
    """How one subscriber talks to its engine. Times in seconds."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    medium: str | None = None
    replay_timeout_seconds: float = 2.0
    """Longest wait for the first message of a replay's answer (none by then: the publisher
    does not answer, and the replay brings nothing)."""
    replay_gap_seconds: float = 0.25
    """Longest silence between two messages of one answer before it counts as ended without
    its end marker (truncated): vLLM streams a replay in one loop, and a truncated answer is
    resumed, so a short wait costs at most one more request."""
    poll_seconds: float = 0.05
    tail_retry_seconds: float = 0.5
    """How long a batch the engine says it published may stay missing before a replay."""
    tail_give_up_seconds: float = 3.0
    """After this long missing (replays included), the batch counts as lost."""
    receive_hwm: int = 0
    """ZMQ receive high-water mark of the SUB and replay sockets (0: unbounded, never drop
    on this side; the publisher's ``hwm`` and its ROUTER's then rule). A bounded one makes a
    slow subscriber lose batches, and cut its replays short, the way a slow router does."""


def connect_address(endpoint: str, host: str = "127.0.0.1") -> str:
    """The address to connect to for an endpoint the engine bound (``tcp://*:P`` and
    ``tcp://[::]:P`` name every interface: connect to ``host`` instead)."""
    for wildcard in ("tcp://*:", "tcp://[::]:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{host}:{endpoint[len(wildcard):]}"
    return endpoint


class ReplayAnswer(NamedTuple):
    """One replay request's answer: the batches it brought that the mirror lacks, by sequence
    number, whether vLLM's end marker arrived, and whether the batch asked for again as a
    check (the last one applied) came back with other content: a new publisher."""

    batches: dict[int, bytes]
    ended: bool
    restarted: bool = False

    @property
    def truncated(self) -> bool:
        """It brought batches but stopped early: no end marker, or a hole between them."""
        if not self.batches:
            return False
        return not self.ended or max(self.batches) - min(self.batches) + 1 != len(self.batches)


class KvEventSubscriber:
    """Keeps one engine's :class:`Mirror` from its KV events. ``start``/``close``; every other
    method is safe from any thread (the mirror is read under ``lock``)."""

    def __init__(self, opts: SubscriberOptions, *,
                 input_filter: Callable[[int, bool], bool] | None = None) -> None:
        self.opts = opts
        self.mirror = Mirror(opts.medium)
        self.lock = threading.Lock()
        self.input_filter = input_filter
        self.received_total = 0
        """Batches received on SUB (filtered ones included)."""
        self.filtered_total = 0
        self.duplicates_total = 0
        self.replays_total = 0
        """Replay requests sent."""
        self.replays_truncated_total = 0
        """Replay answers that stopped early (:attr:`ReplayAnswer.truncated`), each resumed."""
        self.replayed_batches_total = 0
        self.lost_batches_total = 0
        self.restarts_total = 0
        self.decode_errors_total = 0
        self.gaps: deque[tuple[int, int]] = deque(maxlen=MAX_GAPS_KEPT)
        """Ranges of lost batches (first, last), oldest first."""
        self.gap_open = False
        self.error: str | None = None
        """Why the thread stopped, if it did."""
        self._sub_last = -1
        self._recent: OrderedDict[int, bytes] = OrderedDict()
        """Sequence number -> short hash of the payload applied under it (the last ones)."""
        self._wanted = -1
        self._wanted_since = 0.0
        self._last_tail_replay = 0.0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kvguard-kv-events-{opts.endpoint[-40:]}")

    def start(self, timeout: float = 5.0) -> None:
        """Start the thread; returns once its SUB socket is connected (or ``timeout`` s)."""
        self._thread.start()
        self._ready.wait(timeout)

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def want_through(self, seq: int) -> None:
        """The engine says batch ``seq`` was published: if it has not arrived, the thread
        asks for a replay (after ``tail_retry_seconds``) and, failing that, records it lost."""
        with self.lock:
            if seq > self._wanted:
                self._wanted = seq
                self._wanted_since = time.monotonic()

    def mark_in_sync(self) -> None:
        """A comparison found the mirror equal to the pool: a gap no longer matters."""
        with self.lock:
            self.gap_open = False

    # ------------------------------------------------------------ thread
    def _run(self) -> None:
        try:
            import zmq
        except ImportError as exc:
            self.error = (f"cannot follow vLLM's KV events here ({exc}); install pyzmq (a "
                          "dependency of kvguard) in the sidecar's environment")
            self._ready.set()
            return
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, self.opts.topic.encode())
            sub.setsockopt(zmq.RCVHWM, self.opts.receive_hwm)
            sub.connect(connect_address(self.opts.endpoint))
            self._ready.set()
            poll_ms = int(self.opts.poll_seconds * 1000)
            while not self._stop.is_set():
                if sub.poll(poll_ms):
                    frames = sub.recv_multipart()
                    if len(frames) == 3:
                        self._on_sub(int.from_bytes(frames[1], "big"), frames[2], ctx)
                else:
                    self._check_tail(ctx)
        except Exception as exc:  # the sidecar goes on; the mirror is reported broken
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("kvguard KV-event subscriber for %s stopped: %s", self.opts.endpoint,
                      self.error)
        finally:
            self._ready.set()
            sub.close(linger=0)
            ctx.term()

    def _on_sub(self, seq: int, payload: bytes, ctx: Any) -> None:
        self.received_total += 1
        if self.input_filter is not None and not self.input_filter(seq, False):
            self.filtered_total += 1
            return
        # SUB delivers one publisher in order: a number going backwards, or one applied before
        # with other content, comes from a new publisher (the engine restarted).
        applied = self._recent.get(seq)  # None: never applied here (lost, or long ago)
        if seq <= self._sub_last or (applied is not None and applied != _short_hash(payload)):
            self._restart()
        self._sub_last = seq
        last = self.mirror.last_seq
        if seq <= last:
            self.duplicates_total += 1  # already applied from a replay
            return
        if seq > last + 1:
            self._replay(seq - 1, ctx)
            last = self.mirror.last_seq
            if seq <= last:
                self.duplicates_total += 1
                return
            if seq > last + 1:
                self._lose(last + 1, seq - 1)
        self._apply(seq, payload)

    def _restart(self) -> None:
        """The engine restarted (its publisher numbers from 0 again): start the mirror over."""
        with self.lock:
            self.restarts_total += 1
            self.mirror.reset(-1)
            self.gap_open = False
            self._wanted = -1
        self._recent.clear()

    def _check_tail(self, ctx: Any) -> None:
        with self.lock:
            wanted, since = self._wanted, self._wanted_since
        if wanted <= self.mirror.last_seq:
            return
        now = time.monotonic()
        if now - since < self.opts.tail_retry_seconds or \
                now - self._last_tail_replay < self.opts.tail_retry_seconds:
            return
        self._last_tail_replay = now
        self._replay(wanted, ctx)
        last = self.mirror.last_seq
        if last < wanted and now - since >= self.opts.tail_give_up_seconds:
            self._lose(last + 1, wanted)

    def _replay(self, through: int, ctx: Any) -> None:
        """Bring the mirror up to batch ``through`` from the replay endpoint, as far as vLLM's
        buffer allows. Each request asks for everything from ``last_seq + 1``:

        * an answer that stops early (truncated: its tail, end marker included, or a run in
          its middle dropped at the ROUTER's high-water mark) is applied as far as it is
          contiguous and **resumed** from there by the next request;
        * an answer that starts past ``last_seq + 1``: vLLM's buffer no longer holds the
          batches before its first one; they are lost (:meth:`_lose`) and the rest applies;
        * an answer that brings nothing new (the publisher does not answer, or its buffer has
          nothing from there on) ends the replay: the caller decides what is lost.

        Every request but the last advances ``last_seq``, so the number of requests is
        bounded by the batches still to get, never by a fixed count. Batches of an answer
        after a hole are kept for the next one (it may bring only the hole).

        Each request starts one batch early, at the last one applied, when its hash is still
        kept: if the engine sends that number back with other content, a new publisher
        (a restarted engine) has numbered past the old run before SUB saw any of its
        batches, which the SUB path alone cannot tell; the mirror starts over (one restart)
        and the replay goes on from batch 0."""
        if self.opts.replay_endpoint is None:
            return
        kept: dict[int, bytes] = {}
        while self.mirror.last_seq < through and not self._stop.is_set():
            start = self.mirror.last_seq + 1
            check = start - 1 if (start - 1) in self._recent else None
            answer = self._fetch_replay(start, ctx, check=check)
            if answer.restarted:  # numbered past the old run before SUB saw it: start over
                self._restart()
                kept = {}
                continue
            if answer.truncated:
                self.replays_truncated_total += 1
            if not answer.batches:
                return
            first = min(answer.batches)
            if first > start:  # ``kept`` never holds ``start``: it would have applied
                self._lose(start, first - 1)
            kept.update(answer.batches)
            while self.mirror.last_seq + 1 in kept:
                seq = self.mirror.last_seq + 1
                self.replayed_batches_total += 1
                self._apply(seq, kept.pop(seq))
            kept = {q: b for q, b in kept.items() if q > self.mirror.last_seq}

    def _fetch_replay(self, start: int, ctx: Any, *, check: int | None = None) -> ReplayAnswer:
        """One replay request from ``start`` (from ``check`` when given: the last batch
        applied, compared with the hash kept for it): the batches the mirror lacks, whether
        the answer ended with vLLM's end marker, and whether ``check`` came back changed
        (see :class:`SubscriberOptions` for the waits)."""
        import zmq

        assert self.opts.replay_endpoint is not None
        self.replays_total += 1
        got: dict[int, bytes] = {}
        ended = restarted = False
        sock = ctx.socket(zmq.DEALER)
        try:
            # 0 (the default): take the whole answer, whatever the reader's pace. A bounded
            # mark holds the ROUTER back while this thread does not read, and the ROUTER
            # then drops at its own mark, as it does for a router with a small queue.
            sock.setsockopt(zmq.RCVHWM, self.opts.receive_hwm)
            sock.connect(connect_address(self.opts.replay_endpoint))
            first = start if check is None else check
            sock.send_multipart([b"", first.to_bytes(8, "big")])
            timeout_ms = int(self.opts.replay_timeout_seconds * 1000)
            while sock.poll(timeout_ms):
                timeout_ms = int(self.opts.replay_gap_seconds * 1000)
                frames = sock.recv_multipart()
                if len(frames) == 4 and frames[2] == END_SEQ:
                    ended = True
                    break
                if len(frames) != 4:
                    continue
                seq = int.from_bytes(frames[2], "big")
                if check is not None and seq == check:
                    restarted = self._recent.get(check) != _short_hash(frames[3])
                    if restarted:
                        break
                    continue
                if self.input_filter is not None and not self.input_filter(seq, True):
                    self.filtered_total += 1
                    continue
                if seq > self.mirror.last_seq:
                    got[seq] = frames[3]
        finally:
            sock.close(linger=0)
        return ReplayAnswer(got, ended, restarted)

    def _lose(self, first: int, last: int) -> None:
        with self.lock:
            self.lost_batches_total += last - first + 1
            self.gaps.append((first, last))
            self.gap_open = True
            self.mirror.skip_to(last)
        log.warning("kvguard: KV-event batches %d-%d from %s are lost (replay could not give "
                    "them back); the mirror may now differ from the engine", first, last,
                    self.opts.endpoint)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            events = decode_batch(payload)
        except Exception:  # a malformed batch still takes its place in the sequence
            self.decode_errors_total += 1
            events = []
        with self.lock:
            self.mirror.apply(seq, events)
            if any(isinstance(e, Cleared) for e in events):
                self.gap_open = False
        self._recent[seq] = _short_hash(payload)
        if len(self._recent) > RECENT_BATCHES:
            self._recent.popitem(last=False)


def _short_hash(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=8).digest()
