"""Serialize an ``EngineState`` with each checkpoint report encoded once.

A state carries the last N reports (64 by default) and is published once a second, so
``model_dump_json`` would encode the same frozen reports again every second: most of a
75 kB state, and serialization holds the GIL against the engine thread. Reports are
frozen (``CheckpointReport`` is immutable), so :class:`StateEncoder` keeps each one's
JSON from the publish that first carried it and encodes only the rest of the state.

The KV-event snapshot (``kv_events.snapshot``: up to ``KVGUARD_KV_EVENTS_MAX_KEYS`` block keys,
hundreds of kB) is frozen too and changes only at drained checkpoints: it is encoded once as
well.

Invariant: ``json.loads(encoder.encode(s)) == json.loads(s.model_dump_json())`` for
every state ``s``; only the position of the ``kv_events`` and ``reports`` keys differs (they
come last).
"""

from __future__ import annotations

from kvguard.core.report import CheckpointReport
from kvguard.core.state import EngineState
from kvguard.kv_events.snapshot import KvEventsSnapshot, KvEventsState

_REPORTS = "reports"
_KV_EVENTS = "kv_events"


class StateEncoder:
    """``EngineState`` to UTF-8 JSON, reusing the JSON of reports it encoded before.

    Not thread-safe: one encoder per writer thread. Holds only the reports of the last
    state it encoded (identity-keyed; a report no longer published is dropped).
    """

    def __init__(self) -> None:
        self._cache: dict[int, tuple[CheckpointReport, bytes]] = {}
        self._snapshot: tuple[KvEventsSnapshot, bytes] | None = None
        self.snapshots_encoded = 0
        self.reports_encoded = 0
        """Reports serialized so far (each once while it stays in the published history)."""

    def encode(self, state: EngineState) -> bytes:
        head = state.model_dump_json(exclude={_REPORTS, _KV_EVENTS}).encode()
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
        return b"".join((head[:-1], sep, b'"kv_events":', self._kv_events(state.kv_events),
                         b',"reports":[', b",".join(parts), b"]}"))

    def _kv_events(self, kv: KvEventsState | None) -> bytes:
        if kv is None:
            return b"null"
        head = kv.model_dump_json(exclude={"snapshot"}).encode()
        snap = kv.snapshot
        if snap is None:
            body = b"null"
        else:
            if self._snapshot is None or self._snapshot[0] is not snap:
                self._snapshot = (snap, snap.model_dump_json().encode())
                self.snapshots_encoded += 1
            body = self._snapshot[1]
        return b"".join((head[:-1], b',"snapshot":', body, b"}"))
