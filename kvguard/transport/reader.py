"""Reader side: load every engine's published state from a run directory.

A state file is untrusted input: anything that can write to the run directory
can put anything there (a truncated or oversized file, garbage, a FIFO, a
symlink to a device, a state written by another kvguard version). Reading one
either returns a valid ``EngineState`` or raises ``ProtocolError`` saying what
is wrong with it; it never blocks, never reads more than ``MAX_STATE_BYTES``
and never lets another exception through.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from kvguard.config import ENGINE_NAME_PATTERN
from kvguard.core.state import READABLE_SCHEMA_VERSIONS
from kvguard.errors import ProtocolError
from kvguard.transport.state import STATE_SCHEMA_VERSION, EngineState

MAX_STATE_BYTES = 16 * 1024 * 1024
"""A state file larger than this is rejected unread (a bounded engine never writes one)."""


_ENGINE_NAME = re.compile(ENGINE_NAME_PATTERN)


@dataclass(slots=True)
class ReadResult:
    states: list[EngineState] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    """File name -> why it was rejected."""


class _VersionPeek(BaseModel):
    """Only the fields that say which kvguard wrote a state (for a clear version error)."""

    model_config = ConfigDict(extra="ignore")

    schema_version: int | None = None
    kvguard_version: str | None = None


def read_state_file(path: Path) -> EngineState:
    """Parse one state file. Raises ``ProtocolError`` saying what is wrong with it.

    Checks, in order: a regular file (not a FIFO, device or directory: opening
    never blocks), at most ``MAX_STATE_BYTES``, the state schema version (a
    state from another kvguard version gets one error naming both versions),
    a valid ``EngineState``, and an engine name that matches the file name and
    ``ENGINE_NAME_PATTERN``.
    """
    raw = _read_bounded(path)
    peek = _peek_version(raw)
    if peek is not None and peek.schema_version is not None \
            and peek.schema_version not in READABLE_SCHEMA_VERSIONS:
        by = f" (kvguard {peek.kvguard_version})" if peek.kvguard_version else ""
        raise ProtocolError(
            f"{path}: written by a kvguard with state schema {peek.schema_version}{by}, this "
            f"reader understands schema {STATE_SCHEMA_VERSION}; install the same kvguard "
            "version in the engine and the reader"
        )
    try:
        state = EngineState.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "the document"
        raise ProtocolError(f"{path}: not a valid kvguard state: {where}: {first['msg']}") \
            from None
    if not _ENGINE_NAME.match(state.engine):
        raise ProtocolError(f"{path}: engine name {state.engine[:140]!r} does not match "
                            f"{ENGINE_NAME_PATTERN}")
    if path.stem != state.engine:
        raise ProtocolError(f"{path}: the file is named for engine {path.stem!r} but holds the "
                            f"state of engine {state.engine!r}")
    return state


def read_run_dir(run_dir: Path) -> ReadResult:
    """Read ``<run_dir>/*.json``; a bad file is reported in ``errors``, never raised."""
    out = ReadResult()
    if not run_dir.is_dir():
        return out
    for path in sorted(run_dir.glob("*.json")):
        try:
            out.states.append(read_state_file(path))
        except (ProtocolError, OSError) as exc:
            out.errors[path.name] = str(exc)
    return out


def _read_bounded(path: Path) -> bytes:
    """The file's bytes; a non-regular or oversized file is rejected without reading it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ProtocolError(f"{path}: not a regular file")
        if st.st_size > MAX_STATE_BYTES:
            raise ProtocolError(f"{path}: {st.st_size} bytes exceeds the "
                                f"{MAX_STATE_BYTES}-byte limit")
        chunks: list[bytes] = []
        remaining = MAX_STATE_BYTES + 1
        while remaining > 0:
            chunk = os.read(fd, min(remaining, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
        if remaining <= 0:  # grew while we read it
            raise ProtocolError(f"{path}: exceeds the {MAX_STATE_BYTES}-byte limit")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _peek_version(raw: bytes) -> _VersionPeek | None:
    """Who wrote ``raw``, if it is a JSON object at all (bounded nesting, never raises)."""
    try:
        return _VersionPeek.model_validate_json(raw)
    except ValidationError:
        return None
