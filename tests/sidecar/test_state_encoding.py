"""The published state file: every report serialized once, the same JSON either way."""

from __future__ import annotations

import json
from pathlib import Path

from factories import report, state

from kvguard.kv_events.digest import digest_hex
from kvguard.kv_events.snapshot import KvEventsSnapshot, KvEventsState
from kvguard.transport.encoding import StateEncoder
from kvguard.transport.publisher import StatePublisher
from kvguard.transport.reader import read_state_file
from kvguard.transport.state import EngineState


def test_the_encoding_is_pydantics_own_json_with_reports_serialized_once() -> None:
    history = [report(i, holding=i % 3) for i in range(1, 6)]
    enc = StateEncoder()
    for n in range(1, 6):  # the history grows by one report per publish
        s = state(history[:n])
        got = enc.encode(s)
        assert json.loads(got) == json.loads(s.model_dump_json())
        assert EngineState.model_validate_json(got) == s
    assert enc.reports_encoded == 5, "a report already published was serialized again"
    # Reports that leave the history are forgotten; a copy of the same values is new.
    enc.encode(state(history[3:]))
    assert enc.reports_encoded == 5
    copy = history[4].model_copy()
    enc.encode(state([copy]))
    assert enc.reports_encoded == 6
    empty = state([])
    assert json.loads(enc.encode(empty)) == json.loads(empty.model_dump_json())


def test_the_kv_event_snapshot_is_serialized_once_per_checkpoint() -> None:
    keys = sorted(f"0:{i:064x}" for i in range(100))
    snap = KvEventsSnapshot(checkpoint_id=3, taken_at=1.0, last_seq=41, num_blocks=len(keys),
                            digest=digest_hex(keys), block_keys=keys)
    enc = StateEncoder()
    for published in (5, 6):  # the counters move between publishes; the snapshot does not
        kv = KvEventsState(endpoint="ipc:///tmp/x", batches_published=published,
                           snapshot=snap)
        s = state([report(1)]).model_copy(update={"kv_events": kv})
        got = enc.encode(s)
        assert json.loads(got) == json.loads(s.model_dump_json())
        assert EngineState.model_validate_json(got) == s
    assert enc.snapshots_encoded == 1
    bare = state([]).model_copy(update={"kv_events": KvEventsState(endpoint="ipc:///tmp/x")})
    assert json.loads(enc.encode(bare)) == json.loads(bare.model_dump_json())


def test_the_publisher_writes_what_the_sidecar_reads(tmp_path: Path) -> None:
    pub = StatePublisher(tmp_path, "dp0")
    try:
        s = state([report(1, holding=1), report(2)])
        pub.offer(s)
        assert pub.flush()
        assert read_state_file(tmp_path / "dp0.json") == s
    finally:
        pub.close()
