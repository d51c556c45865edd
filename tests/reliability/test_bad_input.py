"""Bad input: the HTTP API under schemathesis, and hostile state files under the reader.

The API: every operation of the OpenAPI schema, with schema-conforming and
schema-violating inputs (schemathesis 4, all its default checks), answers
without a 5xx, and every 4xx carries a message. The state files: malformed,
truncated, oversized, non-regular, duplicated, out-of-order and future-version
files are rejected (or deduplicated) and counted once; the reader never raises.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from factories import report, state, write
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvguard.sidecar.app import create_app
from kvguard.sidecar.store import EngineStore
from kvguard.transport.reader import MAX_STATE_BYTES, read_run_dir
from kvguard.transport.state import STATE_SCHEMA_VERSION, EngineState

TOKEN = "s3cret-control-token"

_ROOT = Path(tempfile.mkdtemp(prefix="kvguard-rel-api-"))
atexit.register(shutil.rmtree, _ROOT, ignore_errors=True)


def _api_app(name: str, token: str | None) -> Any:
    run_dir = _ROOT / name
    write(run_dir, state([report(1), report(2, holding=2)]))
    write(run_dir, state([report(7, engine="dp1", epoch="e9")], engine="dp1", epoch="e9"))
    store = EngineStore(run_dir)
    store.refresh()
    return create_app(store, control_token=token)


OPEN = schemathesis.openapi.from_asgi("/openapi.json", _api_app("open", None))
GUARDED = schemathesis.openapi.from_asgi("/openapi.json", _api_app("token", TOKEN))

TRIED: Counter[str] = Counter()
"""Inputs schemathesis sent, per operation (printed in the summary test)."""
STATUSES: Counter[int] = Counter()


def rejection_says_what_is_wrong(ctx: Any, response: Any, case: Any) -> None:
    """Every 4xx is JSON with a non-empty ``detail`` (a message, or a list of them)."""
    if response.status_code != 503 or case.operation.path != "/v1/ready":
        STATUSES[response.status_code] += 1  # /v1/ready's 503 is an answer (readiness_503...)
    if not 400 <= response.status_code < 500:
        return
    body = json.loads(response.content or b"null")
    detail = body.get("detail") if isinstance(body, dict) else None
    assert detail, f"{response.status_code} without a message: {response.content!r}"
    if isinstance(detail, list):
        assert all(isinstance(d, dict) and d.get("msg") for d in detail), detail


def readiness_503_says_why(ctx: Any, response: Any, case: Any) -> None:
    """``/v1/ready`` answers 503 on purpose (documented: an engine silent or wedged; these
    state files go stale while the module runs): only with its reason."""
    if response.status_code == 503:
        body = json.loads(response.content)
        assert body["ready"] is False and body["reason"], response.content


def _excluded(case: Any) -> list[Any]:
    """The 5xx check, for the one operation whose 503 is its answer."""
    return [schemathesis.checks.not_a_server_error] if case.operation.path == "/v1/ready" \
        else []


@OPEN.parametrize()
def test_the_api_without_a_token_answers_every_input_without_a_server_error(case: Any) -> None:
    TRIED[f"open {case.operation.label}"] += 1
    case.call_and_validate(additional_checks=[rejection_says_what_is_wrong,
                                              readiness_503_says_why],
                           excluded_checks=_excluded(case))


@GUARDED.parametrize()
def test_the_api_with_a_token_answers_every_input_without_a_server_error(case: Any) -> None:
    TRIED[f"token {case.operation.label}"] += 1
    case.call_and_validate(additional_checks=[rejection_says_what_is_wrong,
                                              readiness_503_says_why],
                           excluded_checks=_excluded(case))


def test_schemathesis_reached_every_operation_with_many_inputs() -> None:
    """Runs after the two above (same module): they fed ``TRIED``."""
    if not TRIED:
        pytest.skip("run with the schemathesis tests of this module")
    ops = {op.label for op in (r.ok() for r in OPEN.get_all_operations())}
    assert {k.split(" ", 1)[1] for k in TRIED} == ops
    # Operations without parameters have few distinct inputs; the others get many.
    assert all(n >= 100 for k, n in TRIED.items() if "/v1/checkpoints" in k), TRIED
    assert STATUSES.keys() & {200, 202} and STATUSES.keys() & {401, 403, 404, 422}
    assert not [s for s in STATUSES if s >= 500]
    print(f"[reliability] schemathesis: {sum(TRIED.values())} inputs, per operation "
          f"{dict(TRIED)}, statuses {dict(sorted(STATUSES.items()))}")


# ---------------------------------------------------------------------------- state files

def _valid(engine: str = "dp0", **kw: Any) -> EngineState:
    return state([report(1, engine=engine), report(2, engine=engine)], engine=engine, **kw)


def _store_with(run_dir: Path, name: str, raw: bytes) -> EngineStore:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / name).write_bytes(raw)
    store = EngineStore(run_dir)
    store.refresh()
    return store


def test_truncated_and_garbled_state_files_are_rejected_with_the_reason(tmp_path: Path) -> None:
    raw = _valid().model_dump_json().encode()
    cuts = [0, 1, 2, len(raw) // 3, len(raw) // 2, len(raw) - 2, len(raw) - 1]
    cases = {f"cut{n}": raw[:n] for n in cuts} | {
        "nul": raw.replace(b'"dp0"', b'"dp\x000"', 1),
        "latin1": raw.replace(b'"e1"', b'"\xe9"', 1),
        "nested": b"[" * 200_000,
        "object-bomb": b'{"a":' * 100_000,
        "not-object": b"[1, 2, 3]",
        "wrong-types": raw.replace(b'"pid":1234', b'"pid":"1234"'),
        "extra-field": raw.replace(b'{"schema_version":', b'{"x":1,"schema_version":', 1),
    }
    for label, data in cases.items():
        store = _store_with(tmp_path / label, "dp0.json", data)
        assert store.engines == {}, label
        assert store.num_read_errors == 1, label
        assert "dp0.json: not a valid kvguard state: " in store.read_errors["dp0.json"], label
        store.refresh()  # a file that stays bad is not counted again
        assert store.num_read_errors == 1, label


def test_non_regular_and_oversized_files_are_rejected_without_reading_them(
    tmp_path: Path,
) -> None:
    write(tmp_path, _valid())
    big = tmp_path / "big.json"
    with big.open("wb") as f:
        f.truncate(MAX_STATE_BYTES + 1)  # sparse: 16 MiB that are never read
    os.mkfifo(tmp_path / "fifo.json")  # opening it for reading would block a naive reader
    os.symlink("/dev/zero", tmp_path / "zero.json")  # an endless read
    (tmp_path / "dir.json").mkdir()
    os.symlink(tmp_path / "missing", tmp_path / "dangling.json")
    store = EngineStore(tmp_path)
    store.refresh()
    errors = store.read_errors
    assert list(store.engines) == ["dp0"]
    assert "exceeds the 16777216-byte limit" in errors["big.json"]
    assert all("not a regular file" in errors[n] for n in ("fifo.json", "zero.json", "dir.json"))
    assert "cannot be read" in errors["dangling.json"]
    assert store.num_read_errors == 5
    store.refresh()
    assert store.num_read_errors == 5


def test_engine_names_must_match_their_file_and_be_safe(tmp_path: Path) -> None:
    s = _valid(engine="dp1")
    (tmp_path / "dp0.json").write_text(s.model_dump_json())  # claims to be another engine
    bad = state([], engine="a b")
    (tmp_path / "a b.json").write_text(bad.model_dump_json())
    store = EngineStore(tmp_path)
    store.refresh()
    assert store.engines == {}
    assert "holds the state of engine 'dp1'" in store.read_errors["dp0.json"]
    assert "does not match" in store.read_errors["a b.json"]


def test_duplicated_states_and_reports_are_deduplicated(tmp_path: Path) -> None:
    s1 = state([report(1), report(2)], updated_at=time.time() - 5)
    p = write(tmp_path, s1)
    store = EngineStore(tmp_path)
    store.refresh()
    p.write_text(s1.model_dump_json())  # the same state again (a new mtime)
    os.utime(p, ns=(1, time.time_ns() + 10**9))
    store.refresh()
    assert store.num_duplicate_states == 1 and store.num_read_errors == 0
    # Reports overlap between rewrites (the engine keeps its last N) and come in any order.
    s2 = state([report(3), report(1), report(2)], updated_at=time.time() - 4)
    write(tmp_path, s2)
    os.utime(p, ns=(1, time.time_ns() + 2 * 10**9))
    store.refresh()
    assert [r.checkpoint_id for r in store.engines["dp0"].history] == [1, 2, 3]


def test_out_of_order_states_are_rejected_and_counted(tmp_path: Path) -> None:
    now = time.time()
    newer = state([report(1), report(2)], updated_at=now - 1)
    older = state([report(1)], updated_at=now - 60)
    p = write(tmp_path, newer)
    store = EngineStore(tmp_path)
    store.refresh()
    write(tmp_path, older)
    os.utime(p, ns=(1, time.time_ns() + 10**9))
    store.refresh()
    assert "out of order" in store.read_errors["dp0.json"] and store.num_read_errors == 1
    assert store.engines["dp0"].state.updated_at == newer.updated_at
    # A state stamped far in the future would make every real one look old: rejected.
    write(tmp_path, state([report(1), report(2)], updated_at=now + 10 * 365 * 86400))
    os.utime(p, ns=(1, time.time_ns() + 2 * 10**9))
    store.refresh()
    assert "from now" in store.read_errors["dp0.json"] and store.num_read_errors == 2
    write(tmp_path, state([report(1), report(2), report(3)], updated_at=time.time()))
    os.utime(p, ns=(1, time.time_ns() + 3 * 10**9))
    store.refresh()
    assert store.read_errors == {} and len(store.engines["dp0"].history) == 3
    inf = newer.model_dump_json().replace(f'"updated_at":{newer.updated_at}',
                                          '"updated_at":1e999')
    assert "1e999" in inf
    p.write_text(inf)
    os.utime(p, ns=(1, time.time_ns() + 4 * 10**9))
    store.refresh()
    assert "dp0.json" in store.read_errors and math.isfinite(
        store.engines["dp0"].state.updated_at)


def test_a_state_from_another_kvguard_version_gives_one_clear_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    future = _valid().model_dump(mode="json") | {"schema_version": STATE_SCHEMA_VERSION + 1,
                                                 "kvguard_version": "9.9.9",
                                                 "a_field_from_the_future": {"x": 1}}
    (tmp_path / "dp0.json").write_text(json.dumps(future))
    store = EngineStore(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvguard.sidecar"):
        for _ in range(5):
            store.refresh()
    [msg] = store.read_errors.values()
    assert (f"state schema {STATE_SCHEMA_VERSION + 1} (kvguard 9.9.9)" in msg
            and f"understands schema {STATE_SCHEMA_VERSION}" in msg
            and "install the same kvguard version" in msg)
    assert store.num_read_errors == 1
    assert len([r for r in caplog.records if "state schema" in r.getMessage()]) == 1
    # The same version number with fields that validate is still refused.
    same_shape = _valid().model_dump(mode="json") | {"schema_version": STATE_SCHEMA_VERSION + 1}
    (tmp_path / "dp1.json").write_text(json.dumps(same_shape | {"engine": "dp1"}))
    assert f"state schema {STATE_SCHEMA_VERSION + 1}" in read_run_dir(tmp_path).errors["dp1.json"]
    # The CLI says it once per file, and that no engine could be read.
    out = subprocess.run([sys.executable, "-m", "kvguard.cli.main", "report", "--run-dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if "state schema" in ln]
    assert len(lines) == 2 and all("install the same kvguard version" in ln for ln in lines)
    with TestClient(create_app(store)) as c:
        assert "state schema" in c.get("/healthz").json()["read_errors"]["dp0.json"]


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                               max_size=4),
    max_leaves=12)


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_mutation_of_a_state_file_is_either_a_valid_state_or_a_counted_rejection(
    data: st.DataObject,
) -> None:
    doc: dict[str, Any] = _valid().model_dump(mode="json")
    choice = data.draw(st.sampled_from(["bytes", "field", "drop", "report-field"]))
    if choice == "bytes":
        raw = data.draw(st.binary(max_size=2048))
    else:
        if choice == "field":
            doc[data.draw(st.sampled_from(sorted(doc)))] = data.draw(_json)
        elif choice == "drop":
            doc.pop(data.draw(st.sampled_from(sorted(doc))))
        else:
            rep = doc["reports"][0]
            rep[data.draw(st.sampled_from(sorted(rep)))] = data.draw(_json)
        raw = json.dumps(doc, allow_nan=True).encode()
    with tempfile.TemporaryDirectory() as d:
        run_dir = Path(d)
        (run_dir / "dp0.json").write_bytes(raw)
        store = EngineStore(run_dir)
        store.refresh()  # never raises
        store.refresh()
        if store.engines:
            view = store.engines["dp0"]
            assert view.state.schema_version == STATE_SCHEMA_VERSION
            assert store.num_read_errors == 0
            with TestClient(create_app(store)) as c:  # and the API still serves it
                assert c.get("/metrics").status_code == 200
                assert c.get("/v1/report").status_code == 200
        else:
            assert store.num_read_errors == 1 and store.read_errors["dp0.json"]
