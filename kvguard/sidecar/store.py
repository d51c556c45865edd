"""``EngineStore``: the sidecar's view of every engine, refreshed from the run directory.

Owned by the sidecar's refresh task; HTTP handlers and the metrics collector
only read it. Bounded: one ``EngineState`` per engine plus at most
``history`` checkpoint reports per engine, whatever the number of requests
ever served.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from kvguard.core.report import CheckpointReport
from kvguard.core.trend import Trend, trend
from kvguard.errors import ProtocolError
from kvguard.transport.reader import read_state_file
from kvguard.transport.state import EngineState


@dataclass(slots=True)
class EngineView:
    state: EngineState
    history: deque[CheckpointReport]
    file_key: tuple[int, int] = (0, 0)
    """(mtime_ns, size) of the state file last parsed: unchanged files are not re-read."""
    epochs_seen: list[str] = field(default_factory=list)

    @property
    def trend(self) -> Trend:
        return trend([r for r in self.history if r.epoch == self.state.epoch])


class EngineStore:
    def __init__(self, run_dir: Path, *, history: int = 256, stale_after_seconds: float = 30.0):
        self.run_dir = run_dir
        self.history = history
        self.stale_after_seconds = stale_after_seconds
        self.engines: dict[str, EngineView] = {}
        self.read_errors: dict[str, str] = {}
        self.num_read_errors = 0
        self.num_refreshes = 0

    def refresh(self) -> None:
        """Re-read changed state files. Never raises for a bad file: it is counted."""
        self.num_refreshes += 1
        if not self.run_dir.is_dir():
            return
        errors: dict[str, str] = {}
        for path in sorted(self.run_dir.glob("*.json")):
            try:
                st = path.stat()
                key = (st.st_mtime_ns, st.st_size)
                view = next((v for v in self.engines.values() if v.state.engine == path.stem),
                            None)
                if view is not None and view.file_key == key:
                    continue
                state = read_state_file(path)
            except (ProtocolError, OSError) as exc:
                errors[path.name] = str(exc)
                if path.name not in self.read_errors:
                    self.num_read_errors += 1
                continue
            self._merge(state, key)
        self.read_errors = errors

    def _merge(self, state: EngineState, key: tuple[int, int]) -> None:
        view = self.engines.get(state.engine)
        if view is None:
            view = EngineView(state=state, history=deque(maxlen=self.history))
            self.engines[state.engine] = view
        if state.epoch not in view.epochs_seen:
            view.epochs_seen.append(state.epoch)
            del view.epochs_seen[:-8]
        seen = {(r.epoch, r.checkpoint_id) for r in view.history}
        for r in state.reports:
            if (r.epoch, r.checkpoint_id) not in seen:
                view.history.append(r)
        view.state = state
        view.file_key = key

    def is_up(self, view: EngineView, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return now - view.state.updated_at < self.stale_after_seconds

    def checkpoints(self, engine: str | None = None, limit: int = 100) -> list[CheckpointReport]:
        out: list[CheckpointReport] = []
        for name, view in sorted(self.engines.items()):
            if engine is None or name == engine:
                out.extend(view.history)
        out.sort(key=lambda r: r.taken_at)
        return out[-limit:]
