"""Fixtures for the observability tests: two real engines and a real Prometheus scraping them.

``leaking_engine`` and ``saturated_engine`` are the only places that decide what Prometheus
scrapes. Each is a real vLLM OpenAI server with kvguard in its EngineCore and the real
``kvguard sidecar`` in front of its run dir:

* ``dp0`` leaks: kvguard's opt-in fault injection keeps blocks referenced after the
  requests are gone;
* ``sat`` is healthy and saturated: no fault, its prefix cache filled with the full blocks
  of distinct prompts, which stay cached (ref count 0, evictable) after every request ended.

The two servers start at the same time (the saturated one in a background thread) so the
module pays for one server start, not two. Ground truth comes from vLLM itself: each
server's own ``/metrics`` (``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_hits``,
``vllm:cache_config_info``), never from kvguard's counters.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
import yaml
from _obs_contract import RULES, PrometheusServer, prometheus_binary
from _observed import (
    LEAKING,
    SATURATED,
    ObservedEngine,
    SaturatedEngine,
    vllm_capacity_blocks,
    vllm_value,
)

from kvguard.chaos.faults import SCHEDULER_CLS
from kvguard.demo.engine import EngineSpec, ServerProcess
from kvguard.demo.run import wait_for_checkpoint
from kvguard.demo.tiny_model import WORDS, make_tiny_model
from kvguard.demo.warmup import WARMUP_PROMPT_TOKENS
from kvguard.demo.workload import run_workload

PROMETHEUS_READY_TIMEOUT_S = 15.0
SIDECAR_READY_TIMEOUT_S = 30.0
SERVER_HEALTH_TIMEOUT_S = 300.0
"""Two servers start at once on two cores, next to whatever else runs: 120 s was too short
on a loaded machine."""
SATURATED_READY_TIMEOUT_S = 480.0
"""Bound on the saturated engine's start, fill and first checkpoint."""
REQUEST_TIMEOUT_S = 60.0

WARM_UP_WORDS = 120
"""The first request a server gets: vLLM's CPU worker dies with SIGILL when the first
request after start has a very short prompt."""
FILL_PROMPTS = 6
FILL_PROMPT_WORDS = 297
"""298 tokens with ``<s>``: 9 full 32-token blocks and a partial one, so 6 prompts leave
54 of the 63 usable blocks cached (86 %, above the 80 % saturation threshold)."""
FILL_MAX_TOKENS = 4
"""Output stays inside each prompt's partial last block: only prompt blocks get cached."""


def _complete(base_url: str, model: str, prompt: str, max_tokens: int) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0}
    with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as client:
        client.post("/v1/completions", json=body).raise_for_status()


def _prompt(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 37 + i * 7) % len(WORDS)] for i in range(n))


def warm_up(base_url: str, model: str) -> None:
    """One long request first (SIGILL otherwise, see ``WARM_UP_WORDS``)."""
    _complete(base_url, model, _prompt(0, WARM_UP_WORDS), 8)


@contextmanager
def _sidecar(run_dir: Path, engines: int) -> Iterator[str]:
    """The real ``kvguard sidecar`` on ``run_dir`` (its own process); yields its /metrics URL
    once it serves ``engines`` engines."""
    port = _free_port()
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "kvguard.cli.main", "sidecar", "--host", "127.0.0.1",
         "--port", str(port), "--run-dir", str(run_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SIDECAR_READY_TIMEOUT_S
        while True:
            try:
                with urllib.request.urlopen(base + "/healthz", timeout=2) as resp:
                    if f'"engines":{engines}'.encode() in resp.read():
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the sidecar did not come up"
            time.sleep(0.2)
        yield base + "/metrics"
    finally:
        _stop(sidecar)


def _bring_up_saturated(root: Path, model_dir: Path, stack: ExitStack) -> SaturatedEngine:
    run_dir = root / "run"
    spec = EngineSpec(model_dir=model_dir, max_num_seqs=8)
    env = {"VLLM_PLUGINS": "kvguard", "KVGUARD_RUN_DIR": str(run_dir),
           "KVGUARD_ENGINE_NAME": SATURATED, "KVGUARD_ONLINE_BUDGET_FRACTION": "0.05"}
    server = ServerProcess(spec, log_path=root / "server.log", env=env,
                           health_timeout_seconds=SERVER_HEALTH_TIMEOUT_S)
    stack.callback(server.stop)
    server.start()
    model = spec.served_model_name
    prompts = [_prompt(100 + i, FILL_PROMPT_WORDS) for i in range(FILL_PROMPTS)]
    # One at a time: the first request is a long one (warm-up), and no prompt's blocks
    # are evicted by another's while it runs.
    for p in prompts:
        _complete(server.base_url, model, p, FILL_MAX_TOKENS)
    hits_before = vllm_value(server.base_url, "vllm:prefix_cache_hits_total")
    again = time.time()
    for p in prompts:
        _complete(server.base_url, model, p, FILL_MAX_TOKENS)
    state = wait_for_checkpoint(run_dir, after=again, engine=SATURATED)
    assert state.latest_report is not None and state.latest_report.verdict.value == \
        "saturated", state.latest_report
    hits = vllm_value(server.base_url, "vllm:prefix_cache_hits_total") - hits_before
    block_size = spec.block_size
    assert hits > 0 and hits % block_size == 0, hits
    capacity = vllm_capacity_blocks(server.base_url)
    # vLLM keeps every full block of a finished request cached: the fill prompts' blocks
    # (served again from the cache: their hits) and the 128-token warm-up prompt's
    # (ServerProcess sends it first; never requested again, so no hit counts it).
    cached = int(hits) // block_size + WARMUP_PROMPT_TOKENS // block_size
    assert cached >= 0.8 * capacity, f"only {cached} of {capacity} blocks cached: not saturated"
    assert vllm_value(server.base_url, "vllm:kv_cache_usage_perc") == 0.0
    metrics_url = stack.enter_context(_sidecar(run_dir, engines=1))
    return SaturatedEngine(name=SATURATED, vllm_url=server.base_url,
                           sidecar_metrics_url=metrics_url, run_dir=run_dir,
                           cached_blocks_truth=cached)


@pytest.fixture(scope="session")
def saturated_start(tmp_path_factory: pytest.TempPathFactory) -> Iterator[
    Future[SaturatedEngine]
]:
    """The saturated engine, coming up in a background thread (see ``saturated_engine``)."""
    root = tmp_path_factory.mktemp("observability-saturated")
    # In this thread: importing transformers from two threads at once fails.
    model_dir = make_tiny_model(root / "model")
    with ExitStack() as stack, ThreadPoolExecutor(1, "saturated-engine") as pool:
        future = pool.submit(_bring_up_saturated, root, model_dir, stack)
        try:
            yield future
        finally:
            future.exception(timeout=SATURATED_READY_TIMEOUT_S)  # then stop what it started


@pytest.fixture(scope="session")
def saturated_engine(saturated_start: Future[SaturatedEngine]) -> SaturatedEngine:
    """A healthy engine with a saturated prefix cache, judged ``saturated`` at a drained
    checkpoint; ``cached_blocks_truth`` is vLLM's own count of its cached blocks."""
    return saturated_start.result(timeout=SATURATED_READY_TIMEOUT_S)


@pytest.fixture(scope="session")
def leaking_engine(tmp_path_factory: pytest.TempPathFactory,
                   saturated_start: Future[SaturatedEngine]) -> Iterator[ObservedEngine]:
    """The real sidecar in front of a real vLLM server that leaked KV blocks (``dp0``);
    ``saturated_start`` only makes the saturated server start beside this one.

    The server runs with the chaos scheduler's opt-in faults (in vLLM's own paths):
    ``refcount_bump=1`` (the first finishing request's last block keeps a reference nobody
    owns: deterministic) and ``skip_free_on_abort=1`` (the first request a hanging-up
    client aborts keeps its blocks).
    The sidecar is the real ``kvguard sidecar`` command, started as its own process.
    """
    root = tmp_path_factory.mktemp("observability")
    run_dir = root / "run"
    spec = EngineSpec(model_dir=make_tiny_model(root / "model"), max_num_seqs=8,
                      extra={"scheduler_cls": SCHEDULER_CLS})  # the faults' scheduler
    # The workload is short (a few hundred engine steps): the online audit gets 5 % of
    # scheduler time (default 0.5 %) so that its sweeps complete and its series exist.
    env = {"VLLM_PLUGINS": "kvguard", "KVGUARD_RUN_DIR": str(run_dir),
           "KVGUARD_ENGINE_NAME": "dp0", "KVGUARD_ALLOW_FAULTS": "1",
           "KVGUARD_FAULTS": "refcount_bump=1,skip_free_on_abort=1",
           "KVGUARD_ONLINE_BUDGET_FRACTION": "0.05"}
    with ServerProcess(spec, log_path=root / "server.log", env=env,
                       health_timeout_seconds=SERVER_HEALTH_TIMEOUT_S) as server:
        warm_up(server.base_url, spec.served_model_name)
        run_workload(server.base_url, spec.served_model_name, shared_prefix_streams=8,
                     disconnecting_streams=4)
        # One more request to its end: vLLM publishes its pool usage after each step, and
        # an abort frees outside a step; the engine drains again after this one.
        settle = time.time()
        warm_up(server.base_url, spec.served_model_name)
        state = wait_for_checkpoint(run_dir, after=settle, engine=LEAKING)
        assert state.latest_report is not None and state.latest_report.verdict.value == "leak"
        assert state.online is not None and state.online.sweeps_total >= 2, state.online
        with _sidecar(run_dir, engines=1) as metrics_url:
            yield ObservedEngine(name=LEAKING, vllm_url=server.base_url,
                                 sidecar_metrics_url=metrics_url, run_dir=run_dir)


@pytest.fixture(scope="session")
def metrics_target(leaking_engine: ObservedEngine) -> str:
    """The leaking engine's sidecar /metrics (the target whose contract is checked)."""
    return leaking_engine.sidecar_metrics_url


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if the process is still there after 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def prometheus(leaking_engine: ObservedEngine, saturated_engine: SaturatedEngine,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    """A real Prometheus (Debian 2.42) scraping both sidecars every second, with the
    kvguard alert rules loaded and evaluated every second."""
    binary = prometheus_binary()
    work = tmp_path_factory.mktemp("prometheus")
    targets = [urllib.parse.urlsplit(e.sidecar_metrics_url)
               for e in (leaking_engine, saturated_engine)]
    assert {t.path for t in targets} == {"/metrics"}, targets
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{
            "job_name": "kvguard",
            "scheme": "http",
            "metrics_path": "/metrics",
            "static_configs": [{"targets": [t.netloc for t in targets]}],
        }],
    }
    config_file = work / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = _free_port()
    log = work / "prometheus.log"
    with log.open("wb") as log_fh:
        proc = subprocess.Popen(
            [binary, f"--config.file={config_file}", f"--storage.tsdb.path={work / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=info"],
            stdout=log_fh, stderr=subprocess.STDOUT, cwd=work,
        )
    server = PrometheusServer(f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + PROMETHEUS_READY_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited with {proc.returncode}:\n{server.log_tail()}")
            try:
                with urllib.request.urlopen(f"{server.url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"prometheus not ready after {PROMETHEUS_READY_TIMEOUT_S:.0f} s:\n"
                            f"{server.log_tail()}")
            time.sleep(0.2)
        yield server
    finally:
        _stop(proc)
