"""A request's W3C trace context, read at admission and kept while kvguard tracks it.

Only the two W3C Trace Context headers are read (``traceparent`` and ``tracestate``);
baggage and every other header vLLM may carry are never looked at or kept. A context
whose ``traceparent`` is malformed, all-zero or not sampled is not kept: nothing would
be exported for it (a parent-based sampler drops the children of an unsampled parent).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

_HEX: Final = frozenset("0123456789abcdef")
MAX_TRACESTATE_CHARS: Final = 512
"""W3C's limit for ``tracestate`` a vendor must propagate; a longer one is dropped."""
SAMPLED: Final = 0x01
"""The ``sampled`` bit of ``trace-flags``."""
DEFAULT_MAX_CONTEXTS: Final = 4096
"""Contexts kept per engine at most (oldest dropped first): about 0.5 MB."""


@dataclass(frozen=True, slots=True)
class TraceContext:
    """The incoming span context of one request: its spans' parent.

    Invariants: ``trace_id`` and ``span_id`` are non-zero (128 and 64 bits);
    ``flags`` is the 8-bit ``trace-flags`` field with the sampled bit set.
    """

    trace_id: int
    span_id: int
    """The caller's span (the client's, or the router's): kvguard's spans are its children."""
    flags: int
    tracestate: str | None = None

    @property
    def trace_id_hex(self) -> str:
        """32 lowercase hex digits, as trace backends show it."""
        return f"{self.trace_id:032x}"


def parse_traceparent(traceparent: str, tracestate: str | None = None) -> TraceContext | None:
    """The context a W3C ``traceparent`` names, or None when it is malformed, has an
    all-zero id, version ``ff``, or is not sampled."""
    tp = traceparent.strip().lower()
    if len(tp) != 55 or tp[2] != "-" or tp[35] != "-" or tp[52] != "-" or tp[:2] == "ff" \
            or not _HEX.issuperset(tp.replace("-", "")):
        return None  # the W3C form: 2-32-16-2 lowercase hex digits
    trace_id, span_id, flags = int(tp[3:35], 16), int(tp[36:52], 16), int(tp[53:], 16)
    if not trace_id or not span_id or not flags & SAMPLED:
        return None
    state = tracestate.strip() if tracestate else None
    if state is not None and (not state or len(state) > MAX_TRACESTATE_CHARS):
        state = None
    return TraceContext(trace_id, span_id, flags, state)


def context_of(headers: Mapping[str, str] | None) -> TraceContext | None:
    """The context in vLLM's ``Request.trace_headers`` (None: none, or not usable)."""
    if not headers:
        return None
    parent = headers.get("traceparent")
    if not isinstance(parent, str):
        return None
    state = headers.get("tracestate")
    return parse_traceparent(parent, state if isinstance(state, str) else None)


class TraceContexts:
    """Request id -> its trace context, for the requests kvguard tracks, bounded.

    Invariant: ``len(self) <= max_contexts``; when full, the oldest admitted context is
    dropped (counted in ``evicted_total``) so the engine's memory never grows with
    requests that never end. Not thread-safe: the engine's scheduler thread only.
    """

    def __init__(self, max_contexts: int = DEFAULT_MAX_CONTEXTS) -> None:
        if max_contexts <= 0:
            raise ValueError(f"max_contexts must be positive, not {max_contexts}")
        self.max_contexts = max_contexts
        self._by_request: OrderedDict[str, TraceContext] = OrderedDict()
        self.evicted_total = 0

    def __len__(self) -> int:
        return len(self._by_request)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_request

    def put(self, request_id: str, ctx: TraceContext) -> None:
        by = self._by_request
        by[request_id] = ctx
        by.move_to_end(request_id)
        while len(by) > self.max_contexts:
            by.popitem(last=False)
            self.evicted_total += 1

    def get(self, request_id: str | None) -> TraceContext | None:
        return self._by_request.get(request_id) if request_id is not None else None

    def pop(self, request_id: str) -> TraceContext | None:
        return self._by_request.pop(request_id, None)

    def request_ids(self) -> list[str]:
        """Oldest first (a copy: safe to drop entries while iterating it)."""
        return list(self._by_request)
