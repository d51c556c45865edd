"""vLLM's request ids: the engine suffixes the id the client gave."""

from __future__ import annotations

_HEX = frozenset("0123456789abcdef")


def client_request_id(request_id: str) -> str:
    """Map vLLM's internal id (``<client id>-<8 hex>``) back to the client's id.

    Only the last suffix is vLLM's, and only when it is exactly 8 lowercase hex digits;
    anything else is returned unchanged.
    """
    head, sep, tail = request_id.rpartition("-")
    if sep and len(tail) == 8 and all(c in _HEX for c in tail):
        return head
    return request_id
