"""Serialize an ``EngineState`` with each checkpoint report encoded once.

A state carries the last N reports (64 by default) and is published once a second, so
``model_dump_json`` would encode the same frozen reports again every second: most of a
75 kB state, and serialization holds the GIL against the engine thread. Reports are
frozen (``CheckpointReport`` is immutable), so :class:`StateEncoder` keeps each one's
JSON from the publish that first carried it and encodes only the rest of the state.

Invariant: ``json.loads(encoder.encode(s)) == json.loads(s.model_dump_json())`` for
every state ``s``; only the position of the ``reports`` key differs (it comes last).
"""

from __future__ import annotations

from kvguard.core.report import CheckpointReport
from kvguard.core.state import EngineState

_REPORTS = "reports"


class StateEncoder:
    """``EngineState`` to UTF-8 JSON, reusing the JSON of reports it encoded before.

    Not thread-safe: one encoder per writer thread. Holds only the reports of the last
    state it encoded (identity-keyed; a report no longer published is dropped).
    """

    def __init__(self) -> None:
        self._cache: dict[int, tuple[CheckpointReport, bytes]] = {}
        self.reports_encoded = 0
        """Reports serialized so far (each once while it stays in the published history)."""

    def encode(self, state: EngineState) -> bytes:
        head = state.model_dump_json(exclude={_REPORTS}).encode()
        cache: dict[int, tuple[CheckpointReport, bytes]] = {}
        parts: list[bytes] = []
        for report in state.reports:
            key = id(report)
            hit = self._cache.get(key)
            if hit is None or hit[0] is not report:
                hit = (report, report.model_dump_json().encode())
                self.reports_encoded += 1
            cache[key] = hit
            parts.append(hit[1])
        self._cache = cache
        sep = b"," if head != b"{}" else b""
        return b"".join((head[:-1], sep, b'"reports":[', b",".join(parts), b"]}"))
