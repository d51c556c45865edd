"""The chaos scorer holds kvguard's report against vLLM's pool, not against kvguard itself.

A detector that got the cause, path and request right but never read the pool (wrong
block ids, or a per-finding sum that counts shared blocks twice) must fail.
"""

from __future__ import annotations

import dataclasses

from kvguard.chaos.result import Status
from kvguard.chaos.runner import score
from kvguard.chaos.scenarios import ExpectedLeak, Scenario
from kvguard.chaos.truth import PoolTruth
from kvguard.core.report import CheckpointReport, LeakReport, PoolReport
from kvguard.core.types import Evidence, FinishReason, LeakCause, LeakPath, Verdict

SCENARIO = Scenario(
    "fault_skip_free_on_abort", "test", lambda h: "", verdicts=frozenset({Verdict.LEAK}),
    leak=ExpectedLeak(LeakCause.FINISHED_REQUEST, LeakPath.ABORT, frozenset({"victim"})))


def _truth(leaked: set[int], capacity: int = 63) -> PoolTruth:
    """A drained pool whose only referenced blocks are ``leaked`` (one reference each)."""
    return PoolTruth(capacity=capacity, referenced=frozenset(leaked), negative=frozenset(),
                     unreachable=frozenset(), in_queue_referenced=frozenset(),
                     tables={"victim-0123abcd": sorted(leaked)},
                     num_free_reported=capacity - len(leaked),
                     usage_perc=len(leaked) / capacity)


def _report(findings: list[list[int]], capacity: int = 63) -> CheckpointReport:
    """A report as kvguard builds it: ``leaked_blocks`` counts distinct blocks, each finding
    says how many of its blocks another finding names too."""
    held = len({b for ids in findings for b in ids})
    others = [{b for j, o in enumerate(findings) if j != i for b in o}
              for i in range(len(findings))]
    return CheckpointReport(
        checkpoint_id=1, engine="dp0", epoch="e", taken_at=0.0, drained=True,
        verdict=Verdict.LEAK, explanation="", leaked_blocks=held,
        pool=PoolReport(capacity=capacity, free=capacity - held, cached=0, active=0,
                        held_by_finished=held, orphaned=0,
                        num_free_reported=capacity - held),
        leaks=[LeakReport(request_id="victim-0123abcd", client_request_id="victim",
                          cause=LeakCause.FINISHED_REQUEST, finish_reason=FinishReason.ABORTED,
                          path=LeakPath.ABORT, blocks=len(ids), block_ids=ids,
                          shared_blocks=len(set(ids) & others[i]),
                          evidence=Evidence.DRAINED) for i, ids in enumerate(findings)])


def test_a_report_naming_the_pools_leaked_blocks_passes() -> None:
    assert score(SCENARIO, _report([[4, 5, 6]]), _truth({4, 5, 6})) == (Status.PASSED, "")


def test_a_report_with_the_right_cause_but_other_block_ids_fails() -> None:
    status, why = score(SCENARIO, _report([[4, 5, 7]]), _truth({4, 5, 6}))
    assert status is Status.FAILED
    assert "missing [6]" in why and "not leaked in the pool [7]" in why


def test_a_report_missing_a_leaked_block_fails() -> None:
    status, why = score(SCENARIO, _report([[4, 5]]), _truth({4, 5, 6}))
    assert status is Status.FAILED and "missing [6]" in why


def test_a_report_whose_states_disagree_with_the_pools_free_count_fails() -> None:
    truth = _truth({4, 5, 6})
    truth = dataclasses.replace(truth, num_free_reported=truth.num_free_reported - 1)
    status, why = score(SCENARIO, _report([[4, 5, 6]]), truth)
    assert status is Status.FAILED and "free count" in why


def test_vllms_usage_must_count_the_leaked_blocks() -> None:
    truth = dataclasses.replace(_truth({4, 5, 6}), usage_perc=0.0)
    status, why = score(SCENARIO, _report([[4, 5, 6]]), truth)
    assert status is Status.FAILED and "KV usage" in why


def test_shared_blocks_count_once_a_stated_total_above_the_pool_fails() -> None:
    # Two findings share block 5: the distinct count (3) is what the pool holds.
    assert score(SCENARIO, _report([[4, 5], [5, 6]]), _truth({4, 5, 6}))[0] is Status.PASSED
    bad = _report([[4, 5], [5, 6]]).model_copy(update={"leaked_blocks": 4})  # summed
    status, why = score(SCENARIO, bad, _truth({4, 5, 6}))
    assert status is Status.FAILED and "states 4" in why


def test_a_clean_report_over_a_leaking_pool_fails() -> None:
    clean = Scenario("abort_final_step", "test", lambda h: "")
    report = _report([]).model_copy(update={"verdict": Verdict.CLEAN, "leaks": []})
    status, why = score(clean, report, _truth({9}))
    assert status is Status.FAILED and "missing [9]" in why
