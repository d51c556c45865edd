"""What users read: client request ids, finding sentences, verdict explanations."""

from __future__ import annotations

import pytest

from kvguard.core.findings import Finding, Reconciliation
from kvguard.core.ledger import OwnershipLedger
from kvguard.core.report import PoolReport
from kvguard.core.types import (
    AcquireKind,
    BlockState,
    FinishReason,
    LeakCause,
    LeakPath,
    RequestId,
    Verdict,
)
from kvguard.core.verdict import decide, describe_finding, skipped_explanation
from kvguard.vllm_plugin.request_ids import client_request_id


# ------------------------------------------------------------ client ids
@pytest.mark.parametrize(
    ("internal", "client"),
    [
        ("r1-9eb2bd82", "r1"),  # vLLM: "<client id>-<8 hex>"
        ("cmpl-3f2a9c1e77d04b6f-0-0a1b2c3d", "cmpl-3f2a9c1e77d04b6f-0"),  # OpenAI server, n>1
        ("a-b-c-deadbeef", "a-b-c"),  # only the last suffix is vLLM's
        ("123e4567-e89b-12d3-a456-426614174000-01234567", "123e4567-e89b-12d3-a456-426614174000"),
        ("123e4567-e89b-12d3-a456-426614174000", "123e4567-e89b-12d3-a456-426614174000"),
        ("plain", "plain"),  # no suffix at all
        ("r1-9eb2bd8", "r1-9eb2bd8"),  # 7 hex digits: not vLLM's suffix
        ("r1-9eb2bd820", "r1-9eb2bd820"),  # 9 hex digits
        ("r1-9eb2bd8g", "r1-9eb2bd8g"),  # not hex
        ("r1_9eb2bd82", "r1_9eb2bd82"),  # no dash
        ("", ""),
    ],
)
def test_client_request_id_strips_only_vllms_eight_hex_suffix(internal: str, client: str) -> None:
    assert client_request_id(internal) == client


def test_the_ledger_names_each_request_by_its_client_id() -> None:
    ledger = OwnershipLedger(client_id_of=client_request_id)  # as the vLLM adapter builds it
    ledger.on_request_admitted(RequestId("chat-42-0badcafe"), 0.0)
    ledger.on_blocks_acquired(RequestId("late-1-12345678"), [1], AcquireKind.ALLOCATE)
    assert ledger.record(RequestId("chat-42-0badcafe")).client_request_id == "chat-42"
    assert ledger.record(RequestId("late-1-12345678")).client_request_id == "late-1"
    # The core knows no engine's id shapes: by default the id is the client's.
    plain = OwnershipLedger()
    plain.on_request_admitted(RequestId("chat-42-0badcafe"), 0.0)
    assert plain.record(RequestId("chat-42-0badcafe")).client_request_id == "chat-42-0badcafe"


# ------------------------------------------------------------- findings
def _finished(blocks: int = 5, held: float | None = 12.0, reason=FinishReason.ABORTED,
              path=LeakPath.ABORT) -> Finding:
    return Finding(
        cause=LeakCause.FINISHED_REQUEST, path=path, blocks=blocks,
        block_ids=list(range(1, blocks + 1)), request_id=RequestId("r1-9eb2bd82"),
        client_request_id="r1", finish_reason=reason, held_for_seconds=held,
    )


def test_a_finished_request_leak_reads_as_who_why_when_and_how_much() -> None:
    assert describe_finding(_finished()) == (
        "request r1 finished (aborted) 12.0 s ago and still holds 5 block(s) "
        "[path: abort/cancel]"
    )


@pytest.mark.parametrize(
    ("held", "blocks", "expected"),
    [
        (0.04, 1, "request r1 finished (aborted) 0.0 s ago and still holds 1 block(s)"),
        (3600.26, 700, "request r1 finished (aborted) 3600.3 s ago and still holds 700 block(s)"),
        (None, 2, "request r1 finished (aborted) and still holds 2 block(s)"),
    ],
)
def test_the_leak_sentence_shows_seconds_with_one_decimal_and_the_exact_count(
    held: float | None, blocks: int, expected: str
) -> None:
    assert describe_finding(_finished(blocks=blocks, held=held)).startswith(expected)


def test_the_leak_sentence_falls_back_to_the_internal_id_and_unknown_reason() -> None:
    f = _finished(reason=None, path=LeakPath.UNKNOWN)
    f.client_request_id = None
    assert describe_finding(f) == (
        "request r1-9eb2bd82 finished (unknown) 12.0 s ago and still holds 5 block(s) "
        "[path: unknown]"
    )


@pytest.mark.parametrize(
    ("path", "words"),
    [
        (LeakPath.DELAYED_FREE, "delayed free (KV transfer completion never arrived)"),
        (LeakPath.PREEMPTION, "preemption"),
        (LeakPath.FINISH, "normal finish"),
        (LeakPath.ERROR, "error"),
        (LeakPath.REMOTE_KV_WAIT,
         "waiting for remote KV (P/D decode side: the transfer never completed)"),
    ],
)
def test_the_leak_sentence_names_the_exit_path(path: LeakPath, words: str) -> None:
    assert describe_finding(_finished(path=path)).endswith(f"[path: {words}]")


@pytest.mark.parametrize("path", list(LeakPath))
def test_every_path_has_words_in_every_sentence(path: LeakPath) -> None:
    for cause in LeakCause:  # a path without words raised KeyError inside the engine
        f = _finished(path=path)
        f.cause = cause
        assert describe_finding(f)
    assert "[path: " in describe_finding(_finished(path=path))


def test_other_causes_read_with_their_block_count_and_evidence() -> None:
    df = Finding(cause=LeakCause.DOUBLE_FREE, path=LeakPath.ABORT, blocks=2,
                 request_id=RequestId("r7-00000000"), client_request_id="r7",
                 detail="ref_cnt -1: freed more times than acquired")
    assert describe_finding(df) == (
        "2 block(s) double-freed by request r7 [path: abort/cancel]: "
        "ref_cnt -1: freed more times than acquired"
    )
    anon = Finding(cause=LeakCause.DOUBLE_FREE, path=LeakPath.UNKNOWN, blocks=1, detail="d")
    assert describe_finding(anon) == "1 block(s) double-freed [path: unknown]: d"
    drift = Finding(cause=LeakCause.REFCOUNT_DRIFT, path=LeakPath.UNKNOWN, blocks=3,
                    detail="ref_cnt 2 but 1 known references")
    assert describe_finding(drift) == (
        "3 block(s) with ref-count drift: ref_cnt 2 but 1 known references"
    )
    orphan = Finding(cause=LeakCause.ORPHAN, path=LeakPath.PREFIX_HIT, blocks=4, detail="d")
    assert describe_finding(orphan) == "4 orphaned block(s) [path: prefix hit]: d"


# ------------------------------------------------------------ verdicts
def _rec(findings: list[Finding], *, capacity: int = 10, cached: int = 0) -> Reconciliation:
    counts = {s: 0 for s in BlockState}
    counts[BlockState.CACHED] = cached
    counts[BlockState.FREE] = capacity - cached
    return Reconciliation(states=PoolReport.from_counts(capacity=capacity, counts=counts,
                                                        num_free_reported=capacity),
                          findings=findings, finished_requests_holding=0,
                          num_free_observed=capacity)


def test_a_leak_explanation_totals_lists_and_says_what_to_do_next() -> None:
    orphan = Finding(cause=LeakCause.ORPHAN, path=LeakPath.ROLLBACK, blocks=2, detail="d")
    verdict, text = decide(_rec([_finished(), orphan]))
    lines = text.splitlines()
    assert verdict is Verdict.LEAK
    assert lines[0] == "7 block(s) leaked in 2 finding(s)."
    assert lines[1] == "- " + describe_finding(_finished())
    assert lines[2] == "- " + describe_finding(orphan)
    nexts = [x for x in lines if x.startswith("Next: ")]
    assert len(nexts) == 2
    assert "abort/cancel path" in nexts[0] and "restarting the engine only hides it" in nexts[0]
    assert "(allocation rollback)" in nexts[1]


def test_a_long_leak_explanation_lists_five_and_counts_the_rest() -> None:
    findings = [_finished(blocks=1) for _ in range(8)]
    _, text = decide(_rec(findings))
    assert text.splitlines()[0] == "8 block(s) leaked in 8 finding(s)."
    assert "- ... and 3 more (see leaks)" in text
    assert sum(1 for x in text.splitlines() if x.startswith("- request")) == 5
    assert sum(1 for x in text.splitlines() if x.startswith("Next: ")) == 1


def test_clean_and_saturated_explanations_say_there_is_nothing_to_do() -> None:
    v, text = decide(_rec([], capacity=10, cached=3))
    assert v is Verdict.CLEAN
    assert "all 10 usable blocks are free (7) or cached (3)" in text
    assert "Nothing to do" in text
    v, text = decide(_rec([], capacity=10, cached=9))
    assert v is Verdict.SATURATED
    assert "9 of 10 blocks" in text and "90%" in text and "not a leak" in text


def test_an_empty_pool_is_clean_not_saturated() -> None:
    assert decide(_rec([], capacity=0))[0] is Verdict.CLEAN


def test_a_skipped_checkpoint_explains_why_no_verdict_was_given() -> None:
    text = skipped_explanation("2 requests waiting")
    assert "not drained (2 requests waiting)" in text
    assert "not evidence" in text
