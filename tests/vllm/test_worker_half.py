"""kvguard's worker half on vLLM's own NIXL worker code, without a server.

The worker here is a stand-in object that runs vLLM's real methods
(``NixlBaseConnectorWorker._reap_expired_send_leases`` and ``_handle_heartbeat``,
``NixlPullConnectorWorker._get_new_notifs``) over a scripted notification feed, so
the ground truth is vLLM's own ``NixlKVConnectorStats`` counters and the sets vLLM
returns. Two real servers exercise the whole channel in ``tests/pd``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import pytest
import vllm.distributed.kv_transfer.kv_connector.v1.nixl as nixl
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvguard.core.worker_reports import RankJoin
from kvguard.vllm_plugin import worker_half
from kvguard.vllm_plugin.worker_half import (
    KvguardWorkerMeta,
    attach_worker_half,
    reports_of,
    worker_half_of,
)


class FakeAgent:
    def __init__(self) -> None:
        self.queue: list[bytes] = []

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        out, self.queue = self.queue, []
        return {"decode-agent": out} if out else {}


class StandInWorker:
    """The state NIXL's pull worker keeps for sends, with vLLM's own methods."""

    _reap_expired_send_leases = nixl.NixlBaseConnectorWorker._reap_expired_send_leases
    _handle_heartbeat = nixl.NixlBaseConnectorWorker._handle_heartbeat
    _get_new_notifs = nixl.NixlPullConnectorWorker._get_new_notifs

    def __init__(self) -> None:
        self._reqs_to_send: dict[str, float] = {}
        self._reqs_to_process: set[str] = set()
        self.consumer_notification_counts_by_req: defaultdict[str, int] = defaultdict(int)
        self.expected_consumer_notifications_by_req: dict[str, int] = {}
        self.xfer_stats = nixl.NixlKVConnectorStats()
        self.nixl_wrapper = FakeAgent()
        self.transfer_topo = object()
        self._lease_extension = 8
        self.tp_rank = 0

    def hold(self, rid: str, lease_seconds: float) -> None:
        self._reqs_to_process.add(rid)
        self._reqs_to_send[rid] = time.perf_counter() + lease_seconds


class StandInConnector:
    """``NixlBaseConnector``'s worker-side surface, as the model runner calls it."""

    def __init__(self) -> None:
        self.connector_worker = StandInWorker()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        w = self.connector_worker
        done = w._get_new_notifs()
        w._reap_expired_send_leases(done)
        return KVConnectorTransferResults(finished_sending=done, finished_recving=set())

    def build_connector_worker_meta(self) -> Any:
        return None


class Config:
    class parallel_config:
        tensor_parallel_size = 1
        pipeline_parallel_size = 1


def _step(conn: StandInConnector) -> tuple[set[str], Any]:
    results = conn.get_transfer_results(set())
    return results.finished_sending, conn.build_connector_worker_meta()


def test_lapses_and_late_reads_equal_vllms_own_counters_and_reach_the_join() -> None:
    conn = StandInConnector()
    half = attach_worker_half(conn, Config)
    assert half is not None and attach_worker_half(conn, Config) is half  # idempotent
    w = conn.connector_worker
    join = RankJoin()
    _, hello = _step(conn)
    join.feed(reports_of(hello))
    assert join.reporting and join.world_size == 1  # the first step says who reports
    w.hold("read-1", 30.0)
    w.hold("lapse-1", -1.0)  # already lapsed: the reaper releases it this step
    w.nixl_wrapper.queue = [b"HB:read-1", b"read-1:1"]
    sent, meta = _step(conn)
    assert sent == {"read-1", "lapse-1"}  # vLLM's own result, unchanged
    events = join.feed(reports_of(meta))
    assert [(e.request_id, e.outcome and e.outcome.value) for e in events] == [
        ("lapse-1", "expired_unread")]
    w.nixl_wrapper.queue = [b"lapse-1:1"]  # the decode side reads after the lapse
    _, meta = _step(conn)
    (late,) = join.feed(reports_of(meta))
    assert late.kind.value == "late_read" and late.request_id == "lapse-1"
    (c,) = join.ranks.values()
    vllm_counts = {k: len(v) for k, v in w.xfer_stats.data.items()}
    assert c.lapses_total == vllm_counts["num_kv_expired_reqs"] == 1
    assert c.late_reads_total == vllm_counts["num_notifications_after_expiry"] == 1
    assert c.errors_total == 0 and c.dropped_total == 0


def test_a_second_notification_in_the_batch_that_released_the_request_is_a_late_read() -> None:
    """A decode that reads, then aborts, can notify twice before the prefill's worker
    looks: NIXL releases the request on the first notification and counts the second as
    after expiry (and logs "Potentially invalid KV blocks"), within one batch. So must
    kvguard (seen on two real servers: vLLM 3, kvguard 2, until every later test)."""
    conn = StandInConnector()
    attach_worker_half(conn, Config)
    w = conn.connector_worker
    join = RankJoin()
    join.feed(reports_of(_step(conn)[1]))
    w.hold("twice-1", 30.0)
    w.hold("two-readers", 30.0)
    w.nixl_wrapper.queue = [b"twice-1:1", b"two-readers:2", b"twice-1:1", b"two-readers:2"]
    sent, meta = _step(conn)
    assert sent == {"twice-1", "two-readers"}  # vLLM's own result, unchanged
    # Both holds ended by their reads: the duplicate is counted, and is no hazard.
    assert join.feed(reports_of(meta)) == []
    (c,) = join.ranks.values()
    vllm_counts = {k: len(v) for k, v in w.xfer_stats.data.items()}
    assert c.late_reads_total == vllm_counts["num_notifications_after_expiry"] == 1


def test_a_renewed_lease_is_reported_as_a_unix_deadline() -> None:
    conn = StandInConnector()
    attach_worker_half(conn, Config)
    w = conn.connector_worker
    w.hold("p-1", 12.0)
    _, meta = _step(conn)
    (rep,) = reports_of(meta)
    assert abs(rep.deadlines["p-1"] - (time.time() + 12.0)) < 1.0
    _, meta = _step(conn)
    assert meta is None  # nothing new: no report, the step's output stays empty
    w._reqs_to_send["p-1"] += 5.0  # what a heartbeat does
    _, meta = _step(conn)
    (rep,) = reports_of(meta)
    assert abs(rep.deadlines["p-1"] - (time.time() + 17.0)) < 1.0


def test_aggregated_metadata_carries_every_ranks_report() -> None:
    a, b = StandInConnector(), StandInConnector()
    b.connector_worker.tp_rank = 1
    tp2 = type("Cfg", (), {"parallel_config": type("PC", (), {
        "tensor_parallel_size": 2, "pipeline_parallel_size": 1})})
    attach_worker_half(a, tp2)
    attach_worker_half(b, tp2)
    meta = a.build_connector_worker_meta().aggregate(b.build_connector_worker_meta())
    assert isinstance(meta, KvguardWorkerMeta)
    assert sorted((r.rank, r.world_size) for r in reports_of(meta)) == [(0, 2), (1, 2)]


class Exploding(dict[str, int]):
    def __iter__(self) -> Any:
        raise RuntimeError("kvguard must contain this")

    def keys(self) -> Any:
        raise RuntimeError("kvguard must contain this")


def test_a_failure_inside_the_worker_half_is_counted_and_the_worker_runs_on() -> None:
    conn = StandInConnector()
    half = worker_half_of(conn) or attach_worker_half(conn, Config)
    assert half is not None
    w = conn.connector_worker
    w.hold("lapse-1", -1.0)
    # kvguard copies this before the reaper runs; vLLM's reaper only pops from it.
    w.consumer_notification_counts_by_req = Exploding()  # type: ignore[assignment]
    sent, meta = _step(conn)
    assert sent == {"lapse-1"}  # the engine's result, untouched
    assert half.errors_total == 1 and w.xfer_stats.data["num_kv_expired_reqs"] == [1]
    (rep,) = reports_of(meta)
    assert rep.errors_total == 1 and rep.finished_sending == ("lapse-1",)

    def broken() -> None:
        raise RuntimeError("kvguard must contain this")

    half.take_report = broken  # type: ignore[method-assign]
    w.consumer_notification_counts_by_req = defaultdict(int)
    w.hold("p-2", 30.0)
    sent, meta = _step(conn)
    assert sent == set() and meta is None  # the connector's own (empty) metadata
    assert half.errors_total == 2


def test_a_full_buffer_drops_and_counts_and_never_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_half, "MAX_BUFFERED", 2)
    conn = StandInConnector()
    half = attach_worker_half(conn, Config)
    assert half is not None
    for i in range(5):
        conn.connector_worker.hold(f"lapse-{i}", -1.0)
    sent, meta = _step(conn)
    assert len(sent) == 5
    (rep,) = reports_of(meta)
    assert rep.lapses_total == 5 and len(rep.lapses) + len(rep.finished_sending) == 2
    assert rep.dropped_total == 8  # 3 lapses and 5 finished ids found no room


def test_a_connector_without_nixls_worker_gets_no_worker_half() -> None:
    class Other:
        connector_worker = None

    assert attach_worker_half(Other(), Config) is None
