"""The drain estimator and fluid prediction on synthetic event streams."""

from __future__ import annotations

import math

import pytest

from kvguard.core.drain_model import DrainEstimator, fluid_backlog, predict


def _feed(est: DrainEstimator, rate: float, start: float, end: float, kind: str) -> None:
    n = int((end - start) * rate)
    for i in range(n):
        t = start + i / rate
        (est.on_arrival if kind == "a" else est.on_completion)(t)


def test_fluid_model_matches_the_lab_cases() -> None:
    assert fluid_backlog(4, 2, 3, 4.0) == 0.0
    assert fluid_backlog(4, 3, 3, 4.0) == 4.0
    assert fluid_backlog(4, 2, 3, 2.0) == 2.0
    assert predict(4, 2.0, 3.0, at=0, window_seconds=30).eta_seconds == pytest.approx(4.0)
    steady = predict(4, 3.0, 3.0, at=0, window_seconds=30)
    assert not steady.drains and math.isinf(steady.eta_seconds)
    assert "not a leak" in steady.explanation


def test_draining_stream_predicts_a_finite_eta() -> None:
    est = DrainEstimator(window_seconds=20, started_at=0)
    _feed(est, 2.0, 0, 20, "a")
    _feed(est, 3.0, 0, 20, "c")
    p = est.predict(20.0, backlog=6)
    assert p.arrival_rate_per_s == pytest.approx(2.0, rel=0.05)
    assert p.completion_rate_per_s == pytest.approx(3.0, rel=0.05)
    assert p.drains and p.eta_seconds == pytest.approx(6.0, rel=0.1)


def test_steady_stream_with_backlog_does_not_drain() -> None:
    est = DrainEstimator(window_seconds=20, started_at=0)
    _feed(est, 3.0, 0, 20, "a")
    _feed(est, 3.0, 0, 20, "c")
    p = est.predict(20.0, backlog=12)
    assert not p.drains and math.isinf(p.eta_seconds)
    assert "λ=3.00/s ≥ μ=3.00/s, backlog 12" in p.explanation


def test_a_burst_ages_out_of_the_window() -> None:
    est = DrainEstimator(window_seconds=10, started_at=0)
    _feed(est, 50.0, 0, 1, "a")  # 50 arrivals in the first second
    _feed(est, 1.0, 0, 30, "c")
    assert not est.predict(1.0, backlog=40).drains  # during the burst: λ=50 ≫ μ
    later = est.predict(30.0, backlog=5)  # the burst left the window
    assert later.arrival_rate_per_s == 0.0 and later.drains
    assert later.eta_seconds == pytest.approx(5.0, rel=0.15)


def test_short_history_does_not_inflate_rates() -> None:
    est = DrainEstimator(window_seconds=30, started_at=100.0)
    for t in (100.0, 100.001, 100.002):
        est.on_arrival(t)
    assert est.predict(100.01, backlog=3).arrival_rate_per_s == pytest.approx(3.0)


def test_memory_is_bounded() -> None:
    est = DrainEstimator(window_seconds=1e9, max_events=100)
    for i in range(10_000):
        est.on_arrival(float(i))
    assert len(est._arrivals) == 100


def test_nothing_in_flight_is_drained_now() -> None:
    p = DrainEstimator().predict(5.0, backlog=0)
    assert p.drains and p.eta_seconds == 0.0
