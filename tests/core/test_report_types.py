"""The audit's own types are the report's: a pool split and a finding reach the JSON
report without a hand-written copy, so a field added to one cannot be lost on the way."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from kvguard.core.checkpoint import leak_report
from kvguard.core.findings import Finding
from kvguard.core.report import LeakReport, PoolReport
from kvguard.core.types import BlockState, Evidence, FinishReason, LeakCause, LeakPath, RequestId


def test_every_leak_report_field_is_a_finding_field() -> None:
    finding_fields = {f.name for f in dataclasses.fields(Finding)}
    missing = set(LeakReport.model_fields) - finding_fields
    assert not missing, f"LeakReport fields the audit never sets: {sorted(missing)}"


def test_a_finding_becomes_its_report_field_for_field() -> None:
    f = Finding(cause=LeakCause.FINISHED_REQUEST, path=LeakPath.ABORT, blocks=0,
                request_id=RequestId("r-1a2b3c4d"), client_request_id="r",
                finish_reason=FinishReason.ABORTED, held_for_seconds=2.5,
                evidence=Evidence.ONLINE, detail="ref_cnt 1, owner finished")
    for b in (7, 9, 7):
        f.add_block(b)
    f.shared_blocks = 1
    r = leak_report(f)
    for name in LeakReport.model_fields:
        assert getattr(r, name) == getattr(f, name), name
    assert r.blocks == 2 and r.block_ids == [7, 9]
    f.add_block(11)  # the report is a frozen value, not a view of the finding
    assert r.block_ids == [7, 9]


def test_pool_report_from_counts_keeps_every_state() -> None:
    counts = {BlockState.FREE: 3, BlockState.CACHED: 4, BlockState.ACTIVE: 2,
              BlockState.HELD_BY_FINISHED: 1, BlockState.ORPHANED: 5}
    p = PoolReport.from_counts(capacity=15, counts=counts, num_free_reported=7)
    assert p.by_state() == counts
    assert [p[s] for s in BlockState] == [3, 4, 2, 1, 5]
    assert p.total == p.capacity == 15
    assert p.saturation_ratio == pytest.approx(4 / 15)
    assert PoolReport.model_validate_json(p.model_dump_json()) == p
    assert set(p.model_dump()) == {s.value for s in BlockState} | {"capacity",
                                                                   "num_free_reported"}


def test_pool_report_rejects_a_negative_count() -> None:
    with pytest.raises(ValidationError):
        PoolReport.from_counts(capacity=1, counts={BlockState.FREE: -1}, num_free_reported=0)
