"""Reader side: load every engine's published state from a run directory."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from kvguard.errors import ProtocolError
from kvguard.transport.state import STATE_SCHEMA_VERSION, EngineState

MAX_STATE_BYTES = 16 * 1024 * 1024
"""A state file larger than this is rejected unread (a bounded engine never writes one)."""


@dataclass(slots=True)
class ReadResult:
    states: list[EngineState] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    """File name -> why it was rejected."""


def read_state_file(path: Path) -> EngineState:
    """Parse one state file. Raises ``ProtocolError`` saying what is wrong with it."""
    size = path.stat().st_size
    if size > MAX_STATE_BYTES:
        raise ProtocolError(f"{path}: {size} bytes exceeds the {MAX_STATE_BYTES}-byte limit")
    raw = path.read_bytes()
    try:
        state = EngineState.model_validate_json(raw)
    except ValidationError as exc:
        version = _peek_version(raw)
        if version is not None and version != STATE_SCHEMA_VERSION:
            raise ProtocolError(
                f"{path}: written by a kvguard with state schema {version}, this reader "
                f"understands {STATE_SCHEMA_VERSION}; install the same kvguard version in the "
                "engine and the reader"
            ) from None
        raise ProtocolError(f"{path}: not a valid kvguard state: {exc.errors()[0]['msg']}") \
            from None
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


def _peek_version(raw: bytes) -> int | None:
    import json

    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    v = obj.get("schema_version") if isinstance(obj, dict) else None
    return v if isinstance(v, int) else None
