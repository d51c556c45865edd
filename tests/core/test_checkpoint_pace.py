"""The pace of drained audits (``KVGUARD_CHECKPOINT_MIN_INTERVAL_SECONDS``, ``_BURST``).

First the token bucket alone, on explicit clocks; then a guard session on the reference
pool, whose truth is what the harness leaked on purpose. The real engine's twin is
``tests/vllm/test_checkpoint_pace_engine.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
from _pool import Harness, RefAdapter
from _sinks import AskOnce, ListSink
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.config import ConfigError, KvguardConfig
from kvguard.core.pacing import CheckpointPacer
from kvguard.core.session import GuardSession
from kvguard.core.types import LeakCause, LeakPath, Verdict


def test_interval_zero_audits_every_drain_and_owes_nothing() -> None:
    p = CheckpointPacer(0.0, 1)
    assert all(p.take(0.0, 100.0) for _ in range(1000))
    assert p.owed_since is None and p.drains_unaudited == 0


def test_a_burst_then_one_per_interval_and_the_first_unaudited_drain_is_remembered() -> None:
    p = CheckpointPacer(1.0, 3)
    assert [p.take(0.0, 50.0 + i) for i in range(5)] == [True, True, True, False, False]
    assert p.drains_unaudited == 2 and p.owed_since == 53.0  # the first one let go
    assert not p.ready(0.5) and p.ready(1.0)  # one token back after one interval
    assert p.take(1.0, 60.0)
    p.audited()
    assert p.owed_since is None and not p.take(1.2, 61.0) and p.owed_since == 61.0


def test_settings_are_checked_and_a_smaller_burst_drops_the_tokens_above_it() -> None:
    with pytest.raises(ValueError, match="burst >= 1"):
        CheckpointPacer(1.0, 0)
    with pytest.raises(ValueError, match="interval_seconds >= 0"):
        CheckpointPacer(-1.0, 1)
    with pytest.raises(ConfigError, match="KVGUARD_CHECKPOINT_BURST"):
        KvguardConfig.from_env({"KVGUARD_CHECKPOINT_BURST": "0"})
    p = CheckpointPacer(10.0, 8)
    p.reconfigure(10.0, 2)
    assert [p.take(0.0, 0.0) for _ in range(3)] == [True, True, False]


@settings(max_examples=300, deadline=None)
@given(interval=st.floats(0.01, 5.0), burst=st.integers(1, 6),
       gaps=st.lists(st.floats(0.0, 3.0), min_size=1, max_size=80))
def test_the_bucket_bounds_audits_per_window_and_never_lets_a_spaced_drain_go(
        interval: float, burst: int, gaps: list[float]) -> None:
    p = CheckpointPacer(interval, burst)
    t, audited_at = 0.0, []
    for i, gap in enumerate(gaps):
        t += gap
        before = p.drains_unaudited
        if p.take(t, t):
            audited_at.append(t)
            p.audited()
            assert p.owed_since is None
        else:
            assert p.drains_unaudited == before + 1 and p.owed_since is not None
        if i and gap >= interval:
            assert audited_at and audited_at[-1] == t  # a token came back in that gap
        assert 0.0 <= p.tokens <= burst
    # Any window of W seconds holds at most burst + W / interval audits.
    for i, start in enumerate(audited_at):
        for j in range(i, len(audited_at)):
            width = audited_at[j] - start
            assert j - i + 1 <= burst + width / interval + 1e-6


def _paced_session(h: Harness, **config: object) -> tuple[GuardSession, ListSink, AskOnce]:
    sink, asks = ListSink(), AskOnce()
    settings_: dict[str, object] = {"publish_interval_seconds": 0.0, "online_audit": False,
                                    "checkpoint_min_interval_seconds": 3600.0,
                                    "checkpoint_burst": 1}
    cfg = KvguardConfig.from_env({}, **(settings_ | config))
    s = GuardSession(RefAdapter(h), cfg, engine="ref0", sink=sink, requests=asks)
    h.ledger = s.ledger
    return s, sink, asks


def _drain(h: Harness, s: GuardSession) -> None:
    h.drain(attributed=False)
    s.on_release_done()  # a free happened: the next step end checks for a drain
    s.on_step_end()


def test_a_drain_the_pace_lets_go_is_owed_then_audited_with_everything_it_missed() -> None:
    h = Harness(64, lazy_claims=True)
    s, sink, _ = _paced_session(h)
    for _ in range(3):
        h.allocate(h.admit(), 2, hash_mask=[True, False], attributed=False)
    _drain(h, s)
    first = s.reports[-1]
    assert first.verdict is Verdict.CLEAN and first.drained  # the one token
    reqs = [h.admit() for _ in range(3)]
    for r in reqs:
        h.allocate(r, 3, hash_mask=[True, True, False], attributed=False)
    leak = h.skip_free_on_abort(reqs[1])
    _drain(h, s)
    assert s.reports[-1] is first  # let go: no audit, and no skipped report either
    owed = sink.states[-1]
    assert owed.unaudited_drain_at is not None and owed.drains_unaudited_total == 1
    s.on_admitting()  # still no token: the admission lets it be
    assert s.reports[-1] is first
    s.config = dataclasses.replace(s.config, checkpoint_min_interval_seconds=1e-6)
    s.on_admitting()  # the pace allows: audited before the request enters
    r = s.reports[-1]
    assert r.drained and r.verdict is Verdict.LEAK and r.checkpoint_id > first.checkpoint_id
    [f] = r.leaks
    assert (f.cause, f.path, f.request_id) == (LeakCause.FINISHED_REQUEST, LeakPath.ABORT,
                                               leak.rid)
    assert sorted(f.block_ids) == sorted(leak.blocks)  # the reference pool's truth
    s.publish()
    assert sink.states[-1].unaudited_drain_at is None
    assert sink.states[-1].drains_unaudited_total == 1


def test_a_checkpoint_asked_for_is_never_paced() -> None:
    h = Harness(64, lazy_claims=True)
    s, _, asks = _paced_session(h)
    _drain(h, s)
    n = len(s.reports)
    leak = h.skip_free_on_abort(h.admit())
    _drain(h, s)
    assert len(s.reports) == n  # no token left
    asks.asked = True  # the sidecar asks (POST /v1/checkpoints)
    s.on_step_end()  # the poll sees it; the request is served at the next step end
    s.on_step_end()
    r = s.reports[-1]
    assert len(s.reports) == n + 1 and r.drained
    assert s.pacer.owed_since is None
    assert r.leaked_blocks == len(set(leak.blocks))
