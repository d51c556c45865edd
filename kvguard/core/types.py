"""Identifiers and closed vocabularies shared by every kvguard layer.

Every state, cause, path and verdict is an ``enum.StrEnum`` so that the JSON
report, the Prometheus label values and the code use one spelling. The string
values are part of the public contract (design.md section 7): renaming one is
a breaking change.
"""

from __future__ import annotations

import enum
from typing import NewType

RequestId = NewType("RequestId", str)
"""The engine's internal request id (vLLM suffixes the client's id)."""

BlockId = NewType("BlockId", int)
"""Index of a KV block in its engine's pool. Block 0 is vLLM's null block."""


class RequestPhase(enum.StrEnum):
    """Where a request is in its life, as last reported by the engine hooks."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"

    @property
    def is_live(self) -> bool:
        return self is not RequestPhase.FINISHED


class FinishReason(enum.StrEnum):
    """Why a request finished (vLLM's ``RequestStatus.FINISHED_*``)."""

    STOPPED = "stopped"
    LENGTH = "length"
    ABORTED = "aborted"
    IGNORED = "ignored"
    ERROR = "error"
    REPETITION = "repetition"
    UNKNOWN = "unknown"


class BlockState(enum.StrEnum):
    """The one state every usable block is in at an audit.

    ``free`` and ``cached`` have ref count 0 (``cached`` still carries a
    prefix-cache hash and is evictable); the other three have ref count > 0 and
    differ by who owns the block.
    """

    FREE = "free"
    CACHED = "cached"
    ACTIVE = "active"
    HELD_BY_FINISHED = "held_by_finished"
    ORPHANED = "orphaned"


class LeakCause(enum.StrEnum):
    """What kind of broken block-reference transition a finding is."""

    FINISHED_REQUEST = "finished_request"
    ORPHAN = "orphan"
    REFCOUNT_DRIFT = "refcount_drift"
    DOUBLE_FREE = "double_free"


class LeakPath(enum.StrEnum):
    """The engine path the leaking request took, i.e. where to look for the bug."""

    ABORT = "abort"
    DELAYED_FREE = "delayed_free"
    DEFERRED_FREE = "deferred_free"
    PREEMPTION = "preemption"
    ERROR = "error"
    FINISH = "finish"
    ROLLBACK = "rollback"
    PREFIX_HIT = "prefix_hit"
    REMOTE_KV_WAIT = "remote_kv_wait"
    """A decode request that finished (usually aborted) while waiting for its KV from a
    remote prefill engine (P/D disaggregation): the engine keeps its blocks until that
    transfer ends (vllm #46283)."""
    UNKNOWN = "unknown"


class Verdict(enum.StrEnum):
    """The outcome of one checkpoint."""

    CLEAN = "clean"
    SATURATED = "saturated"
    LEAK = "leak"
    SKIPPED = "skipped"


class Evidence(enum.StrEnum):
    """What a finding rests on: a drained checkpoint, or a live (online) audit."""

    DRAINED = "drained"
    ONLINE = "online"


class AcquireKind(enum.StrEnum):
    """How a request came to hold a block reference."""

    ALLOCATE = "allocate"
    PREFIX_HIT = "prefix_hit"


def finish_reason_path(reason: FinishReason) -> LeakPath:
    """The leak path implied by a finish reason alone (before transfers are considered)."""
    if reason is FinishReason.ABORTED:
        return LeakPath.ABORT
    if reason is FinishReason.ERROR:
        return LeakPath.ERROR
    if reason is FinishReason.UNKNOWN:
        return LeakPath.UNKNOWN
    return LeakPath.FINISH
