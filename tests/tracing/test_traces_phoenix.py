"""kvguard's leak finding in the request's own trace, in a real trace store.

One real vLLM OpenAI server started with ``--otlp-traces-endpoint`` pointing at a real
Arize Phoenix on loopback (OTLP/HTTP), the chaos scheduler making exactly one request leak
(``deferred_free_never_released`` on ids with ``leak``: its free is parked and never drained),
kvguard in its EngineCore. Each request carries a ``traceparent`` the test made.

Ground truth is vLLM's: its own ``llm_request`` span in the same trace says the trace
context reached the engine, and its ``vllm:kv_cache_usage_perc`` x capacity says how many
blocks the leak holds. Phoenix is queried through its REST API only.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _phoenix import Phoenix, phoenix_server
from prometheus_client.parser import text_string_to_metric_families

from kvguard.chaos.faults import SCHEDULER_CLS
from kvguard.core.types import LeakCause, LeakPath, Verdict
from kvguard.demo.run import fault_fired, wait_for_checkpoint
from kvguard.testing.engine import EngineSpec, ServerProcess
from kvguard.testing.ports import LOOPBACK, free_loopback_port
from kvguard.testing.tiny_model import WORDS, make_tiny_model
from kvguard.transport.reader import read_run_dir
from kvguard.transport.state import EngineState

pytestmark = [pytest.mark.server, pytest.mark.timeout(900)]

ENGINE = "trace-0"
SERVICE = "kvguard-trace-test"
BLOCKS = 64
"""The pool, null block included: 63 usable blocks."""
BOUND_S = 3.0
"""kvguard's delayed-free bound: the parked free is judged a leak after this."""
VLLM_SPAN = "llm_request"
"""vLLM's own span of one request (``vllm/v1/engine/output_processor.py``)."""
RECIPE = Path(__file__).resolve().parents[2] / "docs" / "tracing.md"
READ_BACK = re.compile(r"^<!-- read-back: [^\n]*-->\n```python\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class TracedServer:
    server: ServerProcess
    run_dir: Path
    phoenix: Phoenix

    @property
    def model(self) -> str:
        return self.server.spec.served_model_name


def _traceparent() -> tuple[str, str, str]:
    """A fresh sampled W3C traceparent: (header, trace id, parent span id), lowercase hex."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _complete(s: TracedServer, request_id: str, traceparent: str, seed: int) -> None:
    prompt = " ".join(WORDS[(seed * 37 + i * 7) % len(WORDS)] for i in range(100))
    body = {"model": s.model, "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
            "ignore_eos": True}
    req = urllib.request.Request(
        s.server.base_url + "/v1/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json", "X-Request-Id": request_id,
         "traceparent": traceparent})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200


def _vllm(s: TracedServer, name: str) -> float:
    with urllib.request.urlopen(s.server.base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    [value] = [smp.value for fam in text_string_to_metric_families(text)
               for smp in fam.samples if smp.name == name]
    return float(value)


def _vllm_model_name(s: TracedServer) -> str:
    """The ``model_name`` label of vLLM's own metrics."""
    with urllib.request.urlopen(s.server.base_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    names = {smp.labels["model_name"] for fam in text_string_to_metric_families(text)
             for smp in fam.samples if smp.name == "vllm:kv_cache_usage_perc"}
    assert len(names) == 1, names
    return names.pop()


def _vllm_blocks_held(s: TracedServer) -> int:
    """vLLM's own count of referenced blocks: usage x usable capacity."""
    used = _vllm(s, "vllm:kv_cache_usage_perc") * (BLOCKS - 1)
    assert abs(used - round(used)) < 1e-6, used
    return round(used)


def _read_back(px: Phoenix, trace_id: str) -> list[list[str]]:
    """The read-back block of docs/tracing.md, as the page has it, run against ``px`` the
    way a user pastes it (``TRACE_ID`` and ``PHOENIX_URL`` in its environment): its lines,
    split on blanks."""
    [code] = READ_BACK.findall(RECIPE.read_text())
    env = {**os.environ, "TRACE_ID": trace_id, "PHOENIX_URL": px.base_url}
    out = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True,
                         env=env, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    return [line.split() for line in out.stdout.splitlines()]


def _state(s: TracedServer) -> EngineState:
    [st] = [x for x in read_run_dir(s.run_dir).states if x.engine == ENGINE]
    return st


def _one(spans: list[dict[str, Any]], name: str) -> dict[str, Any]:
    found = [x for x in spans if x["name"] == name]
    assert len(found) == 1, (name, spans)
    return found[0]


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TracedServer]:
    root = tmp_path_factory.mktemp("traced")
    run_dir = root / "run"
    with phoenix_server(LOOPBACK, free_loopback_port(), root / "phoenix",
                        grpc_port=free_loopback_port()) as px:
        spec = EngineSpec(model_dir=make_tiny_model(root / "model"),
                          num_gpu_blocks_override=BLOCKS,
                          extra={"scheduler_cls": SCHEDULER_CLS,
                                 "otlp_traces_endpoint": px.otlp_traces_endpoint})
        env = {"VLLM_PLUGINS": "kvguard", "KVGUARD_RUN_DIR": str(run_dir),
               "KVGUARD_ENGINE_NAME": ENGINE, "KVGUARD_ALLOW_FAULTS": "1",
               "KVGUARD_FAULTS": "deferred_free_never_released=1@leak",
               "KVGUARD_DELAYED_FREE_BOUND_SECONDS": str(BOUND_S),
               # vLLM's exporter defaults to gRPC; Phoenix is read over HTTP here.
               "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
               "OTEL_SERVICE_NAME": SERVICE}
        with ServerProcess(spec, log_path=root / "server.log", env=env,
                           health_timeout_seconds=400.0) as server:
            yield TracedServer(server, run_dir, px)


def test_a_leak_is_a_span_in_the_leaking_request_s_trace_and_a_clean_request_has_none(
        traced: TracedServer) -> None:
    t0 = time.monotonic()
    # A healthy request first: its trace gets vLLM's span and nothing from kvguard.
    clean_header, clean_trace, clean_parent = _traceparent()
    _complete(traced, "clean-1", clean_header, seed=1)
    assert _vllm_blocks_held(traced) == 0
    # Then the leaking one: its free is parked for good.
    leak_header, leak_trace, leak_parent = _traceparent()
    done = time.time()
    _complete(traced, "leak-1", leak_header, seed=2)
    held = _vllm_blocks_held(traced)
    assert held > 0
    st = wait_for_checkpoint(traced.run_dir, after=done + BOUND_S - 0.5, engine=ENGINE,
                             timeout=60.0)
    report = st.latest_report
    assert report is not None and report.verdict is Verdict.LEAK, report
    assert fault_fired(traced.run_dir, ENGINE, "deferred_free_never_released")
    assert report.leaked_blocks == held

    spans = traced.phoenix.wait_for_spans(leak_trace, [VLLM_SPAN, "kvguard.leak"])
    vllm_span = _one(spans, VLLM_SPAN)
    leak = _one(spans, "kvguard.leak")
    # Both are children of the caller's span in the caller's trace: the context crossed
    # the API server, EngineCore and both exporters.
    assert vllm_span["parent_id"] == leak["parent_id"] == leak_parent
    assert vllm_span["context"]["trace_id"] == leak["context"]["trace_id"] == leak_trace
    a = leak["attributes"]
    assert a["kvguard.leak.blocks"] == held, (a, held)  # vLLM's own count of what it holds
    assert "leak-1" in a["kvguard.request.client_id"]
    assert "leak-1" in a["kvguard.request.id"]
    # The GenAI attributes a trace store joins and groups by: the request id under vLLM's
    # own name and value (its span's), and the model vLLM serves (its metrics' model_name).
    assert "leak-1" in vllm_span["attributes"]["gen_ai.request.id"]
    assert a["gen_ai.request.id"] == vllm_span["attributes"]["gen_ai.request.id"], (a, vllm_span)
    assert a["gen_ai.response.model"] == traced.model == _vllm_model_name(traced)
    assert (a["kvguard.leak.cause"], a["kvguard.leak.path"]) == (
        LeakCause.FINISHED_REQUEST.value, LeakPath.DEFERRED_FREE.value)
    assert a["kvguard.verdict"] == "leak" and a["kvguard.evidence"] == "drained"
    assert a["service.name"] == SERVICE and a["kvguard.engine.name"] == ENGINE
    assert a["kvguard.engine.model_name"] == traced.model and a["kvguard.engine.index"] == 0
    assert a["kvguard.pool.capacity"] == BLOCKS - 1
    assert leak["status_code"] == "ERROR"
    assert not any("prompt" in k for k in a), a  # ids and counts only, never the text
    # The docs' recipe reads the same trace back: vLLM's span, then kvguard's, one request.
    lines = _read_back(traced.phoenix, leak_trace)
    assert [ln[1] for ln in lines] == [VLLM_SPAN, "kvguard.leak"], lines
    rid = vllm_span["attributes"]["gen_ai.request.id"]
    assert lines[0][2:] == ["-", rid, vllm_span["status_code"]], lines
    assert lines[1][2:] == [ENGINE, rid, LeakCause.FINISHED_REQUEST.value, "ERROR"], lines

    # The healthy request's trace: vLLM's span, nothing of kvguard's (its spans were sent
    # after any the clean request could have had: the export queue is first in, first out).
    clean = traced.phoenix.wait_for_spans(clean_trace, [VLLM_SPAN])
    assert _one(clean, VLLM_SPAN)["parent_id"] == clean_parent
    assert [x["name"] for x in clean if x["name"].startswith("kvguard.")] == []

    # Later drained checkpoints see the same leak again: still one span for it.
    again = time.time()
    _complete(traced, "clean-2", _traceparent()[0], seed=3)
    wait_for_checkpoint(traced.run_dir, after=again, engine=ENGINE, timeout=60.0)
    tr = _state(traced).tracing
    assert tr is not None, "the engine's state says nothing of tracing"
    assert tr.leak_spans_total == 1 and tr.spans_dropped_total == 0, tr
    assert tr.export_failures_total == 0 and tr.errors_total == 0, tr
    assert tr.protocol == "http/protobuf" and tr.endpoint == traced.phoenix.otlp_traces_endpoint
    assert _state(traced).hook_errors_total == 0
    assert len([x for x in traced.phoenix.spans(leak_trace) if x["name"] == "kvguard.leak"]) == 1
    print(f"\nleak span in the request's trace, {held} blocks by vLLM's count; "
          f"test {time.monotonic() - t0:.1f} s after the servers were up")
