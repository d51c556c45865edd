"""The session's KV-event hook: a snapshot at each drained checkpoint, in the published state,
and a failing source contained like any hook (the checkpoint and the engine go on)."""

from __future__ import annotations

from _pool import Harness, RefAdapter
from _sinks import ListSink

from kvguard import EngineAdapter, KvEventsSnapshot, KvEventsState
from kvguard.config import KvguardConfig
from kvguard.core.session import GuardSession
from kvguard.core.types import Verdict
from kvguard.kv_events.digest import digest_hex


class Source:
    """A KV-event source whose pool holds ``keys`` at batch ``seq`` (or that fails)."""

    def __init__(self, keys: list[str], seq: int, *, fail: bool = False) -> None:
        self.keys, self.seq, self.fail = keys, seq, fail
        self.calls: list[int] = []

    def snapshot(self, checkpoint_id: int, taken_at: float) -> KvEventsSnapshot:
        self.calls.append(checkpoint_id)
        if self.fail:
            raise RuntimeError("pool layout changed")
        return KvEventsSnapshot(checkpoint_id=checkpoint_id, taken_at=taken_at,
                                last_seq=self.seq, num_blocks=len(self.keys),
                                digest=digest_hex(self.keys), block_keys=sorted(self.keys))

    def state(self, snapshot: KvEventsSnapshot | None) -> KvEventsState:
        return KvEventsState(endpoint="ipc:///x", batches_published=self.seq + 1,
                             snapshot=snapshot)


def _drained_session(source: Source) -> tuple[GuardSession, ListSink]:
    h = Harness(64, lazy_claims=True)
    sink = ListSink()
    adapter: EngineAdapter = RefAdapter(h)
    cfg = KvguardConfig.from_env({}, publish_interval_seconds=0.0, online_audit=False)
    s = GuardSession(adapter, cfg, engine="ref0", sink=sink)
    h.ledger = s.ledger
    s.kv_events = source
    r = h.admit()
    h.allocate(r, 3, hash_mask=[True, True, False], attributed=False)
    h.drain(attributed=False)
    s.on_release_done()
    s.on_step_end()
    return s, sink


def test_a_drained_checkpoint_publishes_the_pools_snapshot_with_its_sequence_number() -> None:
    source = Source(["0:aa", "0:bb"], seq=7)
    s, sink = _drained_session(source)
    report = s.reports[-1]
    assert report.drained and source.calls == [report.checkpoint_id]
    published = sink.states[-1].kv_events
    assert published is not None and published.snapshot is not None
    assert (published.snapshot.checkpoint_id, published.snapshot.last_seq,
            published.snapshot.num_blocks) == (report.checkpoint_id, 7, 2)


def test_a_failing_kv_event_source_is_contained_and_the_checkpoint_still_judged() -> None:
    s, sink = _drained_session(Source([], seq=0, fail=True))
    report = s.reports[-1]
    assert report.drained and report.verdict in (Verdict.CLEAN, Verdict.SATURATED)
    assert s.errors.by_hook["kv_events"] == 1 and s.errors.ledger_errors == 0
    state = sink.states[-1]
    assert state.kv_events is not None and state.kv_events.snapshot is None
    assert state.hook_errors_total == 1
