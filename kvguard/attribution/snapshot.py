"""PyTorch memory snapshots on demand (CUDA only): stacks and sizes, never contents.

When ``KVGUARD_SNAPSHOT_DIR`` is set, memory history recording (Python
stacks of framework allocations) starts when the baseline is taken, so that
allocations made between the baseline and a later checkpoint carry the
stack that made them; a checkpoint that finds tensor growth then dumps a
snapshot file there and names it in the report. Recording costs a little
on every allocation, which is why it is opt-in. Snapshots cannot see NCCL
or direct CUDA allocations. At most ``max_files`` files per engine process.
"""

from __future__ import annotations

import re
from pathlib import Path

from kvguard.attribution.backends import MemoryHistoryBackend

DEFAULT_MAX_FILES = 8
DEFAULT_MAX_ENTRIES = 100_000


class Snapshotter:
    """One engine's snapshot files. ``history`` None: this engine has no CUDA allocator."""

    def __init__(self, directory: Path, history: MemoryHistoryBackend | None, *,
                 name: str, why_unavailable: str = "", max_files: int = DEFAULT_MAX_FILES,
                 max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.directory = directory
        self.history = history
        self.name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
        self.why_unavailable = why_unavailable or "needs a CUDA allocator"
        self.max_files = max_files
        self.max_entries = max_entries
        self.recording_since: int | None = None
        self.files: list[str] = []

    def arm(self, checkpoint_id: int) -> str | None:
        """Start recording history (at the baseline). Returns a note, or None when armed."""
        if self.history is None:
            return f"unavailable: {self.why_unavailable}"
        if self.recording_since is None:
            self.history.start(self.max_entries)
            self.recording_since = checkpoint_id
        return None

    def capture(self, checkpoint_id: int) -> tuple[str | None, str]:
        """Dump a snapshot now: ``(path or None, note)``."""
        if self.history is None:
            return None, f"unavailable: {self.why_unavailable}"
        if len(self.files) >= self.max_files:
            return None, (f"not taken: {self.max_files} snapshots already written by this "
                          f"engine process ({self.files[-1]})")
        if self.recording_since is None:
            self.arm(checkpoint_id)
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.directory / f"{self.name}-checkpoint{checkpoint_id}.pickle"
        self.history.dump(str(path))
        self.files.append(str(path))
        return str(path), (f"stacks of allocations since checkpoint #{self.recording_since}; "
                           "open with https://pytorch.org/memory_viz")
