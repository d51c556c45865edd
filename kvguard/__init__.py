"""kvguard: tells a KV-cache block leak from a saturated prefix cache, with evidence.

The public API is exactly ``__all__``; everything else is internal and may change.
The vLLM integration loads itself through the ``vllm.general_plugins`` entry
point (``VLLM_PLUGINS=kvguard``) and needs no import from user code.
"""

from kvguard.config import KvguardConfig
from kvguard.core.classify import BlockJudgement, Charge, HoldRule, classify_block
from kvguard.core.cost import CostMeter
from kvguard.core.engine import EngineActivity, EngineAdapter, EngineIdentity, HoldBound
from kvguard.core.findings import Finding, Reconciliation
from kvguard.core.ledger import OwnershipLedger
from kvguard.core.online import OnlineAuditor, OnlineOptions, PoolAccess, SweepResult
from kvguard.core.reconciler import ReconcileOptions, reconcile
from kvguard.core.report import CheckpointReport, LeakReport, OnlineSweepReport, PoolReport
from kvguard.core.session import (
    CheckpointRequests,
    GuardSession,
    HookErrors,
    KvEventsSource,
    MemoryAttributor,
    RequestTraces,
    StateSink,
)
from kvguard.core.snapshot import PoolSlice, PoolSnapshot
from kvguard.core.state import CostState, EngineState, OnlineState, TracingState
from kvguard.core.transfer_links import (
    JoinedTransfer,
    LinkKind,
    TransferLink,
    join_transfer_states,
    link_transfers,
)
from kvguard.core.transfers import (
    HazardKind,
    TransferEvent,
    TransferEventKind,
    TransferHazard,
    TransferOutcome,
    TransferRecord,
    TransferRole,
    TransferSource,
    TransfersState,
    WorkerRankState,
)
from kvguard.core.types import (
    BlockState,
    Evidence,
    FinishReason,
    LeakCause,
    LeakPath,
    Verdict,
)
from kvguard.core.wedge import (
    DeadOwner,
    DeadOwnerKind,
    WaitingView,
    WedgeOptions,
    WedgeVerdict,
    judge_wedge,
)
from kvguard.core.wedge_monitor import WaitingSource, WedgeMonitor, WedgeState
from kvguard.errors import (
    ConfigError,
    CorruptStateError,
    KvguardError,
    ProtocolError,
    TransportError,
)
from kvguard.kv_events.mirror import Mirror
from kvguard.kv_events.snapshot import KvEventsSnapshot, KvEventsState
from kvguard.kv_events.subscriber import KvEventSubscriber, SubscriberOptions
from kvguard.kv_events.verdict import KvEventsCheck, KvEventsVerdict, judge
from kvguard.tracing.config import TracingSettings, tracing_settings
from kvguard.tracing.context import TraceContext, parse_traceparent
from kvguard.tracing.queue import SpanQueue
from kvguard.tracing.records import SpanRecord, TraceIdentity
from kvguard.tracing.setup import start_tracing
from kvguard.tracing.tracer import RequestTracer
from kvguard.transport.reader import read_run_dir
from kvguard.version import __version__

__all__ = [
    "BlockJudgement",
    "BlockState",
    "Charge",
    "CheckpointReport",
    "CheckpointRequests",
    "ConfigError",
    "CorruptStateError",
    "CostMeter",
    "CostState",
    "DeadOwner",
    "DeadOwnerKind",
    "EngineActivity",
    "EngineAdapter",
    "EngineIdentity",
    "EngineState",
    "Evidence",
    "Finding",
    "FinishReason",
    "GuardSession",
    "HazardKind",
    "HoldBound",
    "HoldRule",
    "HookErrors",
    "JoinedTransfer",
    "KvEventSubscriber",
    "KvEventsCheck",
    "KvEventsSnapshot",
    "KvEventsSource",
    "KvEventsState",
    "KvEventsVerdict",
    "KvguardConfig",
    "KvguardError",
    "LeakCause",
    "LeakPath",
    "LeakReport",
    "LinkKind",
    "MemoryAttributor",
    "Mirror",
    "OnlineAuditor",
    "OnlineOptions",
    "OnlineState",
    "OnlineSweepReport",
    "OwnershipLedger",
    "PoolAccess",
    "PoolReport",
    "PoolSlice",
    "PoolSnapshot",
    "ProtocolError",
    "ReconcileOptions",
    "Reconciliation",
    "RequestTracer",
    "RequestTraces",
    "SpanQueue",
    "SpanRecord",
    "StateSink",
    "SubscriberOptions",
    "SweepResult",
    "TraceContext",
    "TraceIdentity",
    "TracingSettings",
    "TracingState",
    "TransferEvent",
    "TransferEventKind",
    "TransferHazard",
    "TransferLink",
    "TransferOutcome",
    "TransferRecord",
    "TransferRole",
    "TransferSource",
    "TransfersState",
    "TransportError",
    "Verdict",
    "WaitingSource",
    "WaitingView",
    "WedgeMonitor",
    "WedgeOptions",
    "WedgeState",
    "WedgeVerdict",
    "WorkerRankState",
    "__version__",
    "classify_block",
    "join_transfer_states",
    "judge",
    "judge_wedge",
    "link_transfers",
    "parse_traceparent",
    "read_run_dir",
    "reconcile",
    "start_tracing",
    "tracing_settings",
]
