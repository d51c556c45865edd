"""The hand-over from the engine thread to the one thread that exports spans.

The engine thread only calls :meth:`SpanQueue.offer`: a ``put_nowait`` of a small
:class:`~kvguard.tracing.records.SpanRecord` into a bounded queue. When the queue is full
the record is dropped and counted; the engine thread never waits, never does I/O and
never builds an OpenTelemetry object. One daemon thread takes records off the queue in
batches and hands each batch to the exporter; a batch the exporter refuses (or raises
on) counts its spans as failed. Counters only grow, and each is written by one thread.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Final

from kvguard.tracing.records import SpanRecord

log = logging.getLogger("kvguard")

DEFAULT_QUEUE_SIZE: Final = 1024
"""Spans waiting for export at most; more are dropped (counted)."""
DEFAULT_BATCH: Final = 64
"""Spans per export call at most."""

Export = Callable[[list[SpanRecord]], bool]
"""Exports one batch; True when the backend took it. Runs on the export thread only."""


class SpanQueue:
    """A bounded queue of spans and the daemon thread that exports them.

    Invariants: ``offered_total == queued_total + dropped_total``; every queued span ends
    exported, failed, or still waiting (``exported_total + failed_total <= queued_total``).
    """

    def __init__(self, export: Export, *, maxsize: int = DEFAULT_QUEUE_SIZE,
                 batch: int = DEFAULT_BATCH, name: str = "kvguard-trace-export") -> None:
        if maxsize <= 0 or batch <= 0:
            raise ValueError(f"maxsize and batch must be positive, not {maxsize}, {batch}")
        self.maxsize = maxsize
        self._export = export
        self._batch = batch
        self._queue: queue.Queue[SpanRecord | None] = queue.Queue(maxsize)
        self.queued_total = 0
        """Spans accepted by :meth:`offer` (engine thread)."""
        self.dropped_total = 0
        """Spans :meth:`offer` dropped because the queue was full (engine thread)."""
        self.exported_total = 0
        """Spans the exporter took (export thread)."""
        self.failed_total = 0
        """Spans in batches the exporter refused or raised on (export thread)."""
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def offered_total(self) -> int:
        return self.queued_total + self.dropped_total

    @property
    def waiting(self) -> int:
        """Spans queued and not yet taken by the export thread (approximate)."""
        return self._queue.qsize()

    def offer(self, record: SpanRecord) -> bool:
        """Queue ``record`` for export without blocking; False (and counted) when full or
        closed."""
        if self._closing.is_set():
            self.dropped_total += 1
            return False
        try:
            self._queue.put_nowait(record)
        except queue.Full:
            self.dropped_total += 1
            return False
        self.queued_total += 1
        return True

    def _run(self) -> None:
        q = self._queue
        while True:
            first = q.get()
            if first is None:
                return
            batch = [first]
            stop = False
            while len(batch) < self._batch:
                try:
                    item = q.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                batch.append(item)
            self._export_batch(batch)
            if stop:
                return

    def _export_batch(self, batch: list[SpanRecord]) -> None:
        try:
            ok = self._export(batch)
        except Exception as exc:
            ok = False
            if not self.failed_total:
                log.error("kvguard could not export %d span(s) (%s: %s); the engine is not "
                          "affected, failures are counted in its state", len(batch),
                          type(exc).__name__, exc)
        if ok:
            self.exported_total += len(batch)
        else:
            self.failed_total += len(batch)

    def close(self, timeout: float = 2.0) -> None:
        """Stop taking spans, let the export thread send what is queued for at most
        ``timeout`` seconds, and return (the thread is a daemon: it never holds the process)."""
        if self._closing.is_set():
            return
        self._closing.set()
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return
        self._thread.join(timeout)
