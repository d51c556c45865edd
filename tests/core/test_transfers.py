"""P/D transfers in the core: hold deadlines from the connector, the log, cross-engine links.

No engine here: a scripted ``TransferSource`` plays the connector (what vLLM's NIXL
connector does is tested on two real servers in ``tests/pd``). Ground truth is the
script: which lease was alive when.
"""

from __future__ import annotations

from _pool import Harness, RefAdapter

from kvguard.config import KvguardConfig
from kvguard.core.classify import HoldRule, classify_block, hold_is_legitimate
from kvguard.core.ledger import OwnershipLedger
from kvguard.core.session import GuardSession
from kvguard.core.state import EngineState
from kvguard.core.transfer_links import LinkKind, link_transfers
from kvguard.core.transfers import (
    TransferEvent,
    TransferEventKind,
    TransferLog,
    TransferOutcome,
    TransferRole,
    WorkerRankState,
)
from kvguard.core.types import (
    AcquireKind,
    BlockId,
    BlockState,
    FinishReason,
    LeakCause,
    LeakPath,
    RequestId,
)

R = RequestId("cmpl-r1-0-abcdef01")


def _held_ledger(at: float) -> OwnershipLedger:
    led = OwnershipLedger()
    led.on_request_admitted(R, at)
    led.on_blocks_acquired(R, [1, 2], AcquireKind.ALLOCATE)
    led.on_request_finished(R, FinishReason.LENGTH, at)
    led.on_delayed_free_started(R, at)
    return led


def test_a_live_lease_replaces_the_configured_bound() -> None:
    led = _held_ledger(0.0)
    rec = led.record(R)
    assert rec is not None
    rule = HoldRule(now=100.0, bound_seconds=24.0)
    assert not hold_is_legitimate(rec, rule)  # no lease read: 100 s > the 24 s bound
    led.on_hold_deadline(R, 105.0, "NixlConnector live leases")  # renewed by heartbeats
    assert hold_is_legitimate(rec, rule)
    led.on_hold_deadline(R, 96.0, "NixlConnector live leases")
    assert hold_is_legitimate(rec, rule)  # lapsed 4 s ago: inside the 5 s grace
    led.on_hold_deadline(R, 94.0, "NixlConnector live leases")
    assert not hold_is_legitimate(rec, rule)
    assert not hold_is_legitimate(rec, HoldRule(now=100.0, bound_seconds=1e9))  # lease wins
    j = classify_block(BlockId(1), 1, False, False, led, HoldRule(now=100.0,
                                                                     bound_seconds=1e9))
    assert j.state is BlockState.HELD_BY_FINISHED
    (charge,) = j.charges
    assert charge.cause is LeakCause.FINISHED_REQUEST and charge.path is LeakPath.DELAYED_FREE
    assert "hold ended 6 s ago" in charge.detail


def test_a_decode_aborted_while_waiting_names_its_prefill_engine() -> None:
    led = _held_ledger(0.0)
    led.on_waited_for_remote_kv(R, "prefill engine P-uuid (its request p-1)")
    j = classify_block(BlockId(2), 1, False, False, led, HoldRule(now=60.0, bound_seconds=24.0))
    (charge,) = j.charges
    assert charge.path is LeakPath.REMOTE_KV_WAIT
    assert "prefill engine P-uuid" in charge.detail


class ScriptedNixl:
    """A connector whose leases a test sets (Unix deadlines) and whose events it queues."""

    connector = "NixlConnector"
    kv_role = "kv_producer"
    kv_engine_id = "P-uuid"
    hold_source = "NixlConnector live leases"
    errors = 0

    def __init__(self) -> None:
        self.leases: dict[str, float] | None = {}
        self.events: list[TransferEvent] = []

    def hold_deadlines(self) -> dict[str, float] | None:
        return None if self.leases is None else dict(self.leases)

    def drain_events(self) -> list[TransferEvent]:
        out, self.events = self.events, []
        return out

    def worker_ranks(self) -> list[WorkerRankState]:
        return []


class NixlRefAdapter(RefAdapter):
    def __init__(self, h: Harness, source: ScriptedNixl) -> None:
        super().__init__(h)
        self.source = source

    def kv_transfers(self) -> ScriptedNixl:
        return self.source

    def offload_source(self) -> None:
        return None


class NullSink:
    drops = 0

    def offer(self, state: EngineState) -> None:
        self.state = state

    def close(self) -> None:
        pass


def _session(src: ScriptedNixl) -> GuardSession:
    cfg = KvguardConfig.from_env({}, publish_interval_seconds=0.0, online_audit=False)
    return GuardSession(NixlRefAdapter(Harness(8), src), cfg, engine="prefill", sink=NullSink())


def test_session_follows_the_connectors_leases_and_notices_when_it_lets_go() -> None:
    src = ScriptedNixl()
    s = _session(src)
    s.on_admitted(R, 0.0)
    s.ledger.on_blocks_acquired(R, [1], AcquireKind.ALLOCATE)
    s.ledger.on_request_finished(R, FinishReason.LENGTH, 0.0)
    s.on_delayed_free_started(R, 0.0)
    s.on_transfer(TransferEvent(TransferEventKind.STARTED, R, 0.0, role=TransferRole.PREFILL))
    src.leases = {R: 50.0}
    s.poll_transfers(10.0)
    rec = s.ledger.record(R)
    assert rec is not None and rec.hold_deadline == 50.0
    src.leases = {}  # the connector no longer lists it: read or lapsed
    s.poll_transfers(20.0)
    assert rec.hold_deadline == 20.0 and rec.hold_source == "NixlConnector let go of the hold"
    src.leases = None  # leases unreadable: what was read stays, nothing is invented
    s.poll_transfers(30.0)
    assert rec.hold_deadline == 20.0
    # A lapsed lease reported by the worker, then a read for it: the hazard.
    src.events = [TransferEvent(TransferEventKind.ENDED, R, 21.0,
                                outcome=TransferOutcome.EXPIRED_UNREAD, reads=0),
                  TransferEvent(TransferEventKind.LATE_READ, R, 25.0)]
    s.poll_transfers(30.0)
    assert s.transfers is not None
    st = s.transfers.state()
    assert st.outcomes_total == {"expired_unread": 1}
    (hz,) = st.hazards
    assert hz.kind.value == "freed_before_read" and hz.client_request_id == "cmpl-r1-0"
    assert st.hazards_total == {"freed_before_read": 1}
    s.on_transfer(TransferEvent(TransferEventKind.LATE_READ, R, 26.0))
    assert s.transfers.state().hazards_total == {"freed_before_read": 1}  # once per request


def test_a_hold_freed_without_a_word_from_the_connector_ends_released() -> None:
    s = _session(ScriptedNixl())
    s.on_admitted(R, 0.0)
    s.on_transfer(TransferEvent(TransferEventKind.STARTED, R, 0.0, role=TransferRole.PREFILL))
    s.on_freed(R, 3.0)
    assert s.transfers is not None
    st = s.transfers.state()
    assert st.pending == 0 and st.outcomes_total == {"released": 1}


def test_a_late_read_of_a_hold_that_ended_by_a_read_is_no_hazard() -> None:
    log = TransferLog(connector="NixlConnector", kv_role="kv_producer", kv_engine_id="P",
                      hold_source="x")
    log.started("a", "a", TransferRole.PREFILL, 0.0)
    log.ended("a", TransferOutcome.READ, 1.0)
    assert log.read_after_expiry("a", 2.0) is None
    assert log.read_after_expiry("never-seen", 2.0) is None


def _state(name: str, log: TransferLog) -> EngineState:
    return EngineState(kvguard_version="t", engine=name, epoch="1-1", pid=1, started_at=0.0,
                       updated_at=0.0, engine_kind="vllm", transfers=log.state())


def test_links_join_both_sides_on_the_prefill_engines_id_and_request_id() -> None:
    p = TransferLog(connector="NixlConnector", kv_role="kv_producer", kv_engine_id="P-uuid",
                    hold_source="x")
    d = TransferLog(connector="NixlConnector", kv_role="kv_consumer", kv_engine_id="D-uuid",
                    hold_source="x")
    # 1. held on P, aborted on D; 2. freed unread on P, received on D later; 3. read on P,
    # still waiting when D aborted; 4. a decode naming another prefill engine: no link.
    for rid in ("p1", "p2", "p3"):
        p.started(rid, rid, TransferRole.PREFILL, 0.0)
    p.ended("p2", TransferOutcome.EXPIRED_UNREAD, 12.0)
    p.ended("p3", TransferOutcome.READ, 3.0)
    for i, rid in enumerate(("p1", "p2", "p3", "p4"), 1):
        d.started(f"d{i}", f"d{i}", TransferRole.DECODE, 1.0,
                  remote_engine_id="P-uuid" if i < 4 else "other", remote_request_id=rid)
    d.ended("d1", TransferOutcome.ABORTED_WAITING, 30.0)
    d.ended("d2", TransferOutcome.RECEIVED, 14.0)
    d.ended("d3", TransferOutcome.ABORTED_WAITING, 40.0)
    d.ended("d4", TransferOutcome.ABORTED_WAITING, 40.0)
    # vLLM's blockless clean-up request after the abort of d1 names p1 too: no second link.
    d.started("cleanup", "cleanup", TransferRole.DECODE, 30.1, remote_engine_id="P-uuid",
              remote_request_id="p1")
    d.ended("cleanup", TransferOutcome.ABORTED_WAITING, 30.1)
    links = link_transfers({"prefill": _state("prefill", p), "decode": _state("decode", d)})
    by_kind = {ln.kind: ln for ln in links}
    assert len(links) == 3 and set(by_kind) == set(LinkKind)
    held = by_kind[LinkKind.PREFILL_HOLDS_FOR_ABORTED_DECODE]
    assert (held.prefill_request_id, held.decode_request_id, held.at) == ("p1", "d1", 30.0)
    assert held.sentence.startswith("prefill engine prefill holds blocks for request p1 whose "
                                    "decode on engine decode (request d1) was aborted at")
    assert by_kind[LinkKind.FREED_BEFORE_READ].prefill_request_id == "p2"
    assert by_kind[LinkKind.READ_NOT_RECEIVED].decode_request_id == "d3"
    # Received before the lease lapsed: no hazard.
    d2 = d.get("d2")
    assert d2 is not None
    d2.ended_at = 11.0
    assert all(ln.kind is not LinkKind.FREED_BEFORE_READ for ln in link_transfers(
        {"prefill": _state("prefill", p), "decode": _state("decode", d)}))
