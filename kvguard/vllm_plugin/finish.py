"""vLLM's finished request statuses in kvguard's vocabulary."""

from __future__ import annotations

from typing import Any

from kvguard.core.types import FinishReason
from kvguard.vllm_plugin.versions import (
    REQUEST_STATUS,
    read,
)

_FINISH_REASONS = {
    "FINISHED_STOPPED": FinishReason.STOPPED,
    "FINISHED_LENGTH_CAPPED": FinishReason.LENGTH,
    "FINISHED_ABORTED": FinishReason.ABORTED,
    "FINISHED_IGNORED": FinishReason.IGNORED,
    "FINISHED_ERROR": FinishReason.ERROR,
    "FINISHED_REPETITION": FinishReason.REPETITION,
}


def finish_reason_of(request: Any) -> FinishReason:
    """The finish reason of a vLLM ``Request`` (``unknown`` for a status kvguard lacks)."""
    name = getattr(read(request, REQUEST_STATUS), "name", "")  # the enum member's name
    return _FINISH_REASONS.get(name, FinishReason.UNKNOWN)
