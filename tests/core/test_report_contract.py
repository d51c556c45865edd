"""The checkpoint report (design.md section 7): JSON round trip, strictness, privacy.

Reports are built from real reconciliations of the reference pool, the way
the checkpoint code does: pool counts, one leak entry per finding, the
verdict and its explanation.
"""

from __future__ import annotations

import json
from typing import Any

import pydantic
import pytest
from _pool import PROMPT_SENTINEL, TOKEN_SENTINEL, Harness, build_report, random_clean_ops
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvguard.core.report import REPORT_SCHEMA_VERSION, CheckpointReport, LeakReport
from kvguard.core.types import FinishReason, Verdict
from kvguard.core.verdict import skipped_explanation

CONTRACT_TOP = {
    "checkpoint_id", "engine", "taken_at", "drained", "verdict", "pool", "leaks",
    "allocator", "device", "host", "explanation",
}
CONTRACT_POOL = {"capacity", "free", "cached", "active", "held_by_finished", "orphaned"}
CONTRACT_LEAK = {
    "request_id", "cause", "finish_reason", "path", "blocks", "held_for_seconds", "evidence",
}
FORBIDDEN_KEY_PARTS = ("prompt", "token_id", "output_text", "completion")
"""Request content: a report carries ids, counts and times only."""


def _keys(obj: Any) -> set[str]:
    out: set[str] = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.add(str(k))
            out |= _keys(v)
    elif isinstance(obj, list):
        for v in obj:
            out |= _keys(v)
    return out


def _leaky_run() -> tuple[Harness, Any]:
    h = Harness(17)
    ok = h.admit()
    h.allocate(ok, 3, hash_mask=[True, True, False], attributed=True)
    bad = h.admit()
    h.prefix_hit(bad, ok.blocks[:2], attributed=True)
    h.allocate(bad, 2, hash_mask=[True, False], attributed=True)
    h.skip_free_on_abort(bad)
    h.bump_ref(h.pool.queue[-1])
    h.drain()
    return h, h.reconcile()


def _assert_private_and_round_trips(report: CheckpointReport) -> dict[str, Any]:
    raw = report.model_dump_json()
    assert PROMPT_SENTINEL not in raw
    assert str(TOKEN_SENTINEL) not in raw
    data = json.loads(raw)
    for key in _keys(data):
        assert not any(p in key.lower() for p in FORBIDDEN_KEY_PARTS), key
    again = CheckpointReport.model_validate_json(raw)
    assert again == report
    assert again.model_dump_json() == raw
    return data


def test_a_leak_report_round_trips_through_json_with_the_contract_fields() -> None:
    h, rec = _leaky_run()
    report = build_report(rec, checkpoint_id=3, taken_at=h.t)
    data = _assert_private_and_round_trips(report)

    assert set(data) >= CONTRACT_TOP
    assert set(data["pool"]) >= CONTRACT_POOL
    assert data["schema_version"] == REPORT_SCHEMA_VERSION
    assert data["verdict"] == "leak"
    assert data["drained"] is True
    pool = data["pool"]
    assert sum(pool[k] for k in CONTRACT_POOL - {"capacity"}) == pool["capacity"] == 16
    assert pool["held_by_finished"] == 4 and pool["orphaned"] == 1

    leaks = {(x["cause"], x["request_id"]): x for x in data["leaks"]}
    assert set(leaks) == {("finished_request", "req1-9e3779b1"), ("orphan", None)}
    for x in data["leaks"]:
        assert set(x) >= CONTRACT_LEAK
    lk = leaks[("finished_request", "req1-9e3779b1")]
    assert lk["client_request_id"] == "req1"
    assert lk["finish_reason"] == "aborted"
    assert lk["path"] == "abort"
    assert lk["blocks"] == 4
    assert lk["evidence"] == "drained"
    assert isinstance(lk["held_for_seconds"], float)
    assert data["leaked_blocks_by_cause"] == {
        "finished_request": 4, "orphan": 1, "refcount_drift": 0, "double_free": 0,
    }
    assert data["finished_requests_holding_blocks"] == 1
    assert "req1 finished (aborted)" in data["explanation"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=tuple(p for p in Phase if p is not Phase.explain))
@given(num_blocks=st.integers(9, 65), data=st.data())
def test_any_checkpoint_report_round_trips_and_carries_no_prompt_or_tokens(
    num_blocks: int, data: st.DataObject
) -> None:
    h = Harness(num_blocks)
    random_clean_ops(h, data, data.draw(st.integers(0, 30)), style="attributed")
    live = h.live()
    if live and data.draw(st.booleans(), label="leak one"):
        h.skip_free_on_abort(data.draw(st.sampled_from(live)))
    if h.bump_candidates() and data.draw(st.booleans(), label="stray reference"):
        h.bump_ref(data.draw(st.sampled_from(h.bump_candidates())))
    h.drain()
    rec = h.reconcile(walk_free_queue=data.draw(st.booleans()))
    report = build_report(rec, checkpoint_id=data.draw(st.integers(0, 10**6)), taken_at=h.t)
    d = _assert_private_and_round_trips(report)
    assert sum(d["pool"][k] for k in CONTRACT_POOL - {"capacity"}) == d["pool"]["capacity"]
    assert (d["verdict"] == "leak") == bool(rec.findings)
    assert d["verdict"] in {"leak", "clean", "saturated"}
    assert len(d["leaks"]) == len(rec.findings)
    assert 0.0 <= d["saturation_ratio"] <= 1.0


def test_a_skipped_checkpoint_round_trips_without_a_pool() -> None:
    report = CheckpointReport(
        checkpoint_id=0, engine="engine-0", epoch="e1", taken_at=1.0, drained=False,
        verdict=Verdict.SKIPPED, skip_reason="3 requests running",
        explanation=skipped_explanation("3 requests running"),
    )
    data = _assert_private_and_round_trips(report)
    assert data["pool"] is None and data["leaks"] == [] and data["verdict"] == "skipped"
    assert "3 requests running" in data["explanation"]


def _valid_report_dict() -> dict[str, Any]:
    h, rec = _leaky_run()
    return json.loads(build_report(rec, checkpoint_id=1, taken_at=h.t).model_dump_json())


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("unexpected",), 1),  # unknown field
        (("pool", "prompt"), "hi"),  # unknown nested field
        (("checkpoint_id",), "1"),  # no str -> int coercion
        (("drained",), "true"),  # no str -> bool coercion
        (("verdict",), "leaked"),  # closed vocabulary
        (("leaks", 0, "cause"), "oops"),
        (("pool", "free"), -1),  # counts are >= 0
        (("saturation_ratio",), 1.5),
    ],
)
def test_the_report_model_rejects_unknown_fields_and_lax_values(
    path: tuple, value: Any
) -> None:
    data = _valid_report_dict()
    target = data
    for p in path[:-1]:
        target = target[p]
    target[path[-1]] = value
    with pytest.raises(pydantic.ValidationError):
        CheckpointReport.model_validate_json(json.dumps(data))


def test_reports_are_immutable() -> None:
    h, rec = _leaky_run()
    report = build_report(rec, checkpoint_id=1, taken_at=h.t)
    with pytest.raises(pydantic.ValidationError):
        report.verdict = Verdict.CLEAN  # type: ignore[misc]


def test_a_leak_entry_has_no_field_for_request_content() -> None:
    fields = set(LeakReport.model_fields) | set(CheckpointReport.model_fields)
    assert not [f for f in fields if any(p in f for p in FORBIDDEN_KEY_PARTS)]
    assert FinishReason.ABORTED.value == "aborted"
