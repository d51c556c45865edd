"""Engine side: hand the latest state to a writer thread; never wait.

The engine thread calls ``offer(state)``, which swaps one reference under a
lock held for a few instructions and, when the writer has nothing pending, wakes it
with one C-level queue put (``queue.SimpleQueue``: cheaper on the engine thread than
``threading.Event.set``, which takes a Python-level condition and notifies its waiters).
A daemon thread writes the newest state atomically (temp file + ``os.replace``; each
checkpoint report is serialized once, :mod:`kvguard.transport.encoding`) to
``<run_dir>/<engine>.json`` with mode 0600 in a 0700 directory. If the writer
is slower than the engine, intermediate states are dropped (counted in
``drops``): only the newest state matters because each one is complete.

An idle engine calls no hook, so the writer itself rewrites the last state
with a fresh ``updated_at`` every ``heartbeat_seconds``: readers tell an idle
engine (fresh heartbeat) from a dead one (stale file).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from pathlib import Path

from kvguard.transport.encoding import StateEncoder
from kvguard.transport.state import EngineState

log = logging.getLogger("kvguard.transport")


def state_path(run_dir: Path, engine: str) -> Path:
    return run_dir / f"{engine}.json"


class StatePublisher:
    """Writes the newest ``EngineState`` for one engine. Thread-safe ``offer``; never blocks."""

    def __init__(self, run_dir: Path, engine: str, *, heartbeat_seconds: float = 5.0) -> None:
        self.path = state_path(run_dir, engine)
        self.heartbeat_seconds = heartbeat_seconds
        self._last: EngineState | None = None
        self._run_dir = run_dir
        self._lock = threading.Lock()
        self._pending: EngineState | None = None
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        """One token per wake-up: put when a state becomes pending (or at close)."""
        self._stop = False
        self._writing = False
        self.drops = 0
        self.writes = 0
        self.errors = 0
        self._warned = False
        self._encoder = StateEncoder()  # used by the writer thread only
        self._thread = threading.Thread(target=self._run, name=f"kvguard-publish-{engine}",
                                        daemon=True)
        self._thread.start()

    def offer(self, state: EngineState) -> None:
        with self._lock:
            replaced = self._pending is not None
            if replaced:
                self.drops += 1  # the writer is already woken for the state it replaced
            self._pending = state
        if not replaced:
            self._wake.put(None)

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the newest offered state is on disk (tests and shutdown only)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self._pending is None and not self._writing:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self._stop = True
        self._wake.put(None)

    def _run(self) -> None:
        while not self._stop:
            try:
                self._wake.get(timeout=self.heartbeat_seconds)
                woke = True
            except queue.Empty:
                woke = False
            with self._lock:
                state, self._pending = self._pending, None
                if state is None and not woke and self._last is not None:
                    state = self._last.model_copy(update={"updated_at": time.time()})
                self._writing = state is not None
            if state is None:
                continue
            self._last = state
            try:
                self._write(state)
                self.writes += 1
            except OSError as exc:
                self.errors += 1
                if not self._warned:
                    self._warned = True
                    log.warning("kvguard cannot write its state to %s (%s); the engine is not "
                                "affected, readers will see stale data. Check KVGUARD_RUN_DIR.",
                                self.path, exc)
            finally:
                with self._lock:
                    self._writing = False

    def _write(self, state: EngineState) -> None:
        self._run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        data = self._encoder.encode(state)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
