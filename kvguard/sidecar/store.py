"""``EngineStore``: the sidecar's view of every engine, refreshed from the run directory.

Owned by the sidecar's refresh task; HTTP handlers and the metrics collector
only read it. Bounded: one ``EngineState`` per engine plus at most
``history`` checkpoint reports per engine, whatever the number of requests
ever served.

State files are untrusted input. A file is rejected, counted once per
version of it (``num_read_errors``, ``kvguard_sidecar_read_errors_total``),
named in ``read_errors`` with the reason and logged once, when it is
malformed, truncated, oversized, not a regular file, from another kvguard
version (see ``kvguard.transport.reader``), or out of order:

* older than the state already read for the same engine and epoch
  (``updated_at`` went backwards), or
* from an epoch of that engine that was already replaced by a newer one
  (a previous engine process, or a stale copy of its file), or
* stamped more than ``MAX_CLOCK_AHEAD_SECONDS`` in the future, or with a
  non-finite time (it would make every later real state look out of order).

A state identical to the one already read (same epoch and ``updated_at``) is
a duplicate: it is skipped and counted in ``num_duplicate_states``.
Checkpoint reports are deduplicated by ``(epoch, checkpoint_id)``.

**Epochs.** An engine that restarts publishes under the same name with a new
``epoch``. The store then keeps one view per engine whose ``state`` is the new
epoch's: metrics (counters, pool, leaked blocks, ``kvguard_engine_info``) come
from the current epoch only, so the old epoch's series end instead of mixing
with the new ones; the checkpoint history keeps both epochs, each report
carrying its ``epoch`` (``/v1/checkpoints?epoch=`` selects one), and the trend
uses the current epoch's checkpoints only. ``EngineView.epochs_seen`` lists
the epochs in the order they appeared.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from kvguard.core.report import CheckpointReport
from kvguard.core.trend import Trend, trend
from kvguard.errors import ProtocolError
from kvguard.sidecar.kv_events import KvEventsWatch
from kvguard.transport.reader import read_state_file
from kvguard.transport.state import EngineState

log = logging.getLogger("kvguard.sidecar")

MAX_EPOCHS_REMEMBERED = 8
"""Epochs per engine remembered to reject a stale one that reappears."""

MAX_CLOCK_AHEAD_SECONDS = 300.0
"""A state stamped further in the future is rejected: it would make every real one look old."""


@dataclass(slots=True)
class EngineView:
    state: EngineState
    history: deque[CheckpointReport]
    file_key: tuple[int, int] = (0, 0)
    """(mtime_ns, size) of the state file last parsed: unchanged files are not re-read."""
    epochs_seen: list[str] = field(default_factory=list)
    """Epochs of this engine in the order they appeared; the last is ``state.epoch``."""
    judged_trend: Trend | None = field(default=None, repr=False, compare=False)
    """``trend`` as last computed; None once ``state`` or ``history`` changed (the store
    clears it whenever it merges a state: the only writer of both)."""

    @property
    def trend(self) -> Trend:
        """The trend over this epoch's history (computed once per merged state: every
        scrape and report asks for it, and it reads the whole history)."""
        t = self.judged_trend
        if t is None:
            t = self.judged_trend = trend([r for r in self.history
                                           if r.epoch == self.state.epoch])
        return t

    @property
    def restarts(self) -> int:
        """Engine restarts this sidecar has seen (new epochs after the first)."""
        return max(0, len(self.epochs_seen) - 1)


class EngineStore:
    def __init__(self, run_dir: Path, *, history: int = 256, stale_after_seconds: float = 30.0,
                 kv_events: KvEventsWatch | None = None):
        """``kv_events``: the KV-event mirror check, updated after each refresh (None: off)."""
        self.run_dir = run_dir
        self.kv_events = kv_events
        self.history = history
        self.stale_after_seconds = stale_after_seconds
        self.engines: dict[str, EngineView] = {}
        self.read_errors: dict[str, str] = {}
        """File name -> why its current content was rejected (files present now only)."""
        self.num_read_errors = 0
        """Rejected file versions, each counted once (a file that stays bad is not recounted)."""
        self.num_duplicate_states = 0
        self.num_refreshes = 0
        self._rejected: dict[str, tuple[int, int]] = {}
        """File name -> (mtime_ns, size) of its rejected version: not re-read until it changes."""

    def refresh(self) -> None:
        """Re-read changed state files. Never raises for a bad file: it is counted."""
        self.num_refreshes += 1
        if not self.run_dir.is_dir():
            self.read_errors, self._rejected = {}, {}
            return
        errors: dict[str, str] = {}
        rejected: dict[str, tuple[int, int]] = {}
        for path in sorted(self.run_dir.glob("*.json")):
            key = (0, 0)
            try:
                st = path.stat()
                key = (st.st_mtime_ns, st.st_size)
                if self._rejected.get(path.name) == key:  # still the same bad version
                    errors[path.name] = self.read_errors.get(path.name, "rejected")
                    rejected[path.name] = key
                    continue
                view = self.engines.get(path.stem)
                if view is not None and view.file_key == key:
                    continue
                self._merge(read_state_file(path), key)
            except ProtocolError as exc:
                self._reject(path.name, key, str(exc), errors, rejected)
            except OSError as exc:  # vanished or unreadable: transient, not counted twice
                self._reject(path.name, key, f"{path}: cannot be read: {exc}", errors, rejected)
            except Exception as exc:  # never let one file stop the sidecar
                self._reject(path.name, key, f"{path}: rejected ({type(exc).__name__}: {exc})",
                             errors, rejected)
        self.read_errors = errors
        self._rejected = rejected
        if self.kv_events is not None:
            try:
                self.kv_events.update([v.state for v in self.engines.values()])
            except Exception as exc:  # never let the mirror check stop the refresh
                log.error("kvguard sidecar: KV-event mirror check failed: %s", exc,
                          exc_info=exc)

    def _reject(self, name: str, key: tuple[int, int], reason: str, errors: dict[str, str],
                rejected: dict[str, tuple[int, int]]) -> None:
        errors[name] = reason
        rejected[name] = key
        if self._rejected.get(name) != key:
            self.num_read_errors += 1
            log.warning("kvguard sidecar: ignoring %s", reason)

    def _merge(self, state: EngineState, key: tuple[int, int]) -> None:
        _check_clock(state)
        view = self.engines.get(state.engine)
        if view is None:
            view = EngineView(state=state, history=deque(maxlen=self.history))
            self.engines[state.engine] = view
        else:
            self._check_order(view, state)
        if state.epoch not in view.epochs_seen:
            view.epochs_seen.append(state.epoch)
            del view.epochs_seen[:-MAX_EPOCHS_REMEMBERED]
        seen = {(r.epoch, r.checkpoint_id) for r in view.history}
        for r in sorted(state.reports, key=lambda r: r.checkpoint_id):
            if (r.epoch, r.checkpoint_id) not in seen:
                view.history.append(r)
                seen.add((r.epoch, r.checkpoint_id))
        view.state = state
        view.file_key = key
        view.judged_trend = None

    def _check_order(self, view: EngineView, state: EngineState) -> None:
        """Raise ``ProtocolError`` for a state older than the one already read."""
        cur = view.state
        if state.epoch == cur.epoch:
            if state.updated_at < cur.updated_at:
                raise ProtocolError(
                    f"out of order: engine {state.engine!r} epoch {state.epoch!r} state from "
                    f"{state.updated_at:.3f} is older than the one already read "
                    f"({cur.updated_at:.3f})")
            if state.updated_at == cur.updated_at and state == cur:
                self.num_duplicate_states += 1
            return
        if state.epoch in view.epochs_seen or state.started_at < cur.started_at:
            raise ProtocolError(
                f"out of order: engine {state.engine!r} epoch {state.epoch!r} was already "
                f"replaced by epoch {cur.epoch!r} (a restarted engine); a stale state file?")

    def is_up(self, view: EngineView, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return now - view.state.updated_at < self.stale_after_seconds

    def checkpoints(self, engine: str | None = None, limit: int = 100,
                    epoch: str | None = None) -> list[CheckpointReport]:
        """History, oldest first; ``epoch`` selects one engine run (reports carry theirs)."""
        out: list[CheckpointReport] = []
        for name, view in sorted(self.engines.items()):
            if engine is None or name == engine:
                out.extend(r for r in view.history if epoch is None or r.epoch == epoch)
        out.sort(key=lambda r: r.taken_at)
        return out[-limit:]


def _check_clock(state: EngineState) -> None:
    limit = time.time() + MAX_CLOCK_AHEAD_SECONDS
    for name in ("started_at", "updated_at"):
        t = getattr(state, name)
        if not math.isfinite(t) or t > limit:
            raise ProtocolError(f"engine {state.engine!r}: {name}={t} is not a time up to "
                                f"{MAX_CLOCK_AHEAD_SECONDS:.0f} s from now")
