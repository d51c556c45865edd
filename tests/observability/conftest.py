"""Fixtures for the observability tests: one data-parallel vLLM server, two engines, and a
real Prometheus scraping them.

``dp_server`` is the only place that decides what Prometheus scrapes: a real vLLM OpenAI
server with ``--data-parallel-size 2``, so two EngineCore processes, each with kvguard in
it, its own KV pool and its own state file in one run dir, and the real ``kvguard sidecar``
in front of that run dir:

* rank 1 (``obs-dp1``) leaks: the chaos scheduler's opt-in faults, armed on that rank
  only, keep blocks referenced after the requests are gone;
* rank 0 (``obs-dp0``) is healthy and saturated: no fault, its prefix cache filled with the
  full blocks of distinct prompts, which stay cached (ref count 0, evictable) after every
  request ended.

A leak on one rank must name that rank only, and the saturated rank beside it must stay
silent: what a fleet running data parallelism relies on. Ground truth comes from vLLM
itself: the server's own ``/metrics`` per rank (its ``engine`` label:
``vllm:kv_cache_usage_perc``, ``vllm:prefix_cache_hits``, ``vllm:cache_config_info``),
never from kvguard's counters.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from _fleet import (
    FLEET_NAMESPACE,
    PLUGINS_TYPO,
    SELF_RULE_FOR,
    UNWATCHED_POD,
    WATCHED_POD,
    WatchedFleet,
)
from _obs_contract import RULES, SCRAPE_CONFIG, PrometheusServer, prometheus_binary
from _observed import (
    DATA_PARALLEL_SIZE,
    ENGINE_NAME,
    LEAKING,
    LEAKING_RANK,
    SATURATED,
    SATURATED_RANK,
    ObservedEngine,
    SaturatedEngine,
    vllm_capacity_blocks,
    vllm_value,
)
from _pd_replay import NAMESPACE as PD_NAMESPACE
from _pd_replay import PODS as PD_PODS
from _pd_replay import PdReplay, publish_state, serve_vllm
from _pd_replay import phases as pd_phases

from kvguard.chaos.faults import SCHEDULER_CLS
from kvguard.demo.run import fault_fired, wait_for_checkpoint
from kvguard.testing.engine import EngineSpec, ServerProcess
from kvguard.testing.ports import free_loopback_port, free_loopback_ports
from kvguard.testing.tiny_model import WORDS, make_tiny_model
from kvguard.testing.warmup import WARMUP_PROMPT_TOKENS
from kvguard.testing.workload import rank_headers, run_workload

PROMETHEUS_READY_TIMEOUT_S = 15.0
POD = "obs-pod-0"
"""The ``pod`` label both scrape jobs carry (what a PodMonitor gives a pod's targets)."""
SIDECAR_READY_TIMEOUT_S = 30.0
SERVER_HEALTH_TIMEOUT_S = 400.0
"""Two engine cores start on two cores, next to whatever else runs: one took 132 s on a
loaded machine."""
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


def _complete(base_url: str, model: str, prompt: str, max_tokens: int, rank: int) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0}
    with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S,
                      headers=rank_headers(rank)) as client:
        client.post("/v1/completions", json=body).raise_for_status()


def _prompt(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 37 + i * 7) % len(WORDS)] for i in range(n))


@contextmanager
def _sidecar(run_dir: Path, engines: int) -> Iterator[str]:
    """The real ``kvguard sidecar`` on ``run_dir`` (its own process); yields its /metrics URL
    once it serves ``engines`` engines."""
    port = free_loopback_port()
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


@dataclass(frozen=True)
class DataParallelServer:
    """The one vLLM server both observed engines are ranks of, and its sidecar."""

    base_url: str
    run_dir: Path
    sidecar_metrics_url: str
    cached_blocks_truth: int
    """The saturated rank's cached blocks by vLLM's own count (see ``_fill_saturated``)."""


def _fill_saturated(base_url: str, model: str, run_dir: Path, block_size: int) -> int:
    """Fill rank 0's prefix cache with the full blocks of distinct prompts; return the
    blocks it keeps cached by vLLM's own numbers."""
    rank = SATURATED_RANK
    prompts = [_prompt(100 + i, FILL_PROMPT_WORDS) for i in range(FILL_PROMPTS)]
    # One at a time: no prompt's blocks are evicted by another's while it runs.
    for p in prompts:
        _complete(base_url, model, p, FILL_MAX_TOKENS, rank)
    hits_before = vllm_value(base_url, "vllm:prefix_cache_hits_total", rank)
    again = time.time()
    for p in prompts:
        _complete(base_url, model, p, FILL_MAX_TOKENS, rank)
    state = wait_for_checkpoint(run_dir, after=again, engine=SATURATED)
    assert state.latest_report is not None and state.latest_report.verdict.value == \
        "saturated", state.latest_report
    hits = vllm_value(base_url, "vllm:prefix_cache_hits_total", rank) - hits_before
    assert hits > 0 and hits % block_size == 0, hits
    capacity = vllm_capacity_blocks(base_url, rank)
    # vLLM keeps every full block of a finished request cached: the fill prompts' blocks
    # (served again from the cache: their hits) and the 128-token warm-up prompt's
    # (ServerProcess sends it to each rank first; never requested again, so no hit).
    cached = int(hits) // block_size + WARMUP_PROMPT_TOKENS // block_size
    assert cached >= 0.8 * capacity, f"only {cached} of {capacity} blocks cached: not saturated"
    assert vllm_value(base_url, "vllm:kv_cache_usage_perc", rank) == 0.0
    return cached


def _leak(base_url: str, model: str, run_dir: Path) -> None:
    """Rank 1's workload: streams sharing a prefix, then clients hanging up."""
    rank = LEAKING_RANK
    run_workload(base_url, model, shared_prefix_streams=8, disconnecting_streams=4,
                 data_parallel_rank=rank)
    # A hang-up becomes an abort only if vLLM writes to the client again before the request
    # ends, and 460 tokens (this spec's 512-token context) can all be generated first on a
    # fast host: then skip_free_on_abort never fires (seen once: rank 1 held only the
    # orphan). Hang up more, a bounded number of times, until one did.
    for _ in range(5):
        if _abort_fired(run_dir):
            break
        run_workload(base_url, model, shared_prefix_streams=0, disconnecting_streams=4,
                     data_parallel_rank=rank)
    assert _abort_fired(run_dir), "no client hang-up reached rank 1 as an abort in 6 rounds"
    # One more request to its end: vLLM publishes its pool usage after each step, and
    # an abort frees outside a step; the engine drains again after this one.
    settle = time.time()
    _complete(base_url, model, _prompt(0, WARM_UP_WORDS), 8, rank)
    state = wait_for_checkpoint(run_dir, after=settle, engine=LEAKING)
    assert state.latest_report is not None and state.latest_report.verdict.value == "leak"
    assert state.online is not None and state.online.sweeps_total >= 2, state.online


def _abort_fired(run_dir: Path) -> bool:
    """Whether rank 1's state says its skip_free_on_abort fired (it publishes every second:
    waits up to 3 s for the state that would say so)."""
    deadline = time.monotonic() + 3.0
    while not fault_fired(run_dir, LEAKING):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True


@pytest.fixture(scope="session")
def dp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DataParallelServer]:
    """One real vLLM OpenAI server with two data-parallel ranks (``--data-parallel-size 2``:
    two EngineCore processes, each with its own scheduler, KV pool and kvguard state file
    in one run dir), and one real ``kvguard sidecar`` reading both.

    Both ranks run the chaos scheduler, but only rank 1 arms its faults
    (``KVGUARD_FAULTS_DP_RANKS=1``): ``refcount_bump=1`` (the first finishing request's
    last block keeps a reference nobody owns: deterministic) and ``skip_free_on_abort=1``
    (the first request a hanging-up client aborts keeps its blocks). Rank 0 is healthy and
    its prefix cache is filled until saturated. Every request names its rank
    (``X-data-parallel-rank``). Both ranks publish KV events (``--kv-events-config``, ZMQ on
    loopback TCP), which the sidecar, started after the workload, mirrors from the replay
    endpoints.
    """
    root = tmp_path_factory.mktemp("observability")
    run_dir = root / "run"
    # KV events as a KV-aware router consumes them: ZMQ PUB and ROUTER replay on TCP (vLLM
    # refuses ipc:// for ranks above 0), each rank on the configured port plus its rank.
    pub, replay = (free_loopback_ports(DATA_PARALLEL_SIZE) for _ in range(2))
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "",
                 "endpoint": f"tcp://127.0.0.1:{pub}",
                 "replay_endpoint": f"tcp://127.0.0.1:{replay}"}
    spec = EngineSpec(model_dir=make_tiny_model(root / "model"), max_num_seqs=8,
                      extra={"scheduler_cls": SCHEDULER_CLS,
                             "data_parallel_size": DATA_PARALLEL_SIZE,
                             "kv_events_config": kv_events})
    # The workload is short (a few hundred engine steps): the online audit gets 5 % of
    # scheduler time (default 0.5 %) so that its sweeps complete and its series exist, and
    # kvguard meters its own cost in 8 of every 16 steps (default: 8 of 512).
    env = {"VLLM_PLUGINS": "kvguard", "KVGUARD_RUN_DIR": str(run_dir),
           "KVGUARD_ENGINE_NAME": ENGINE_NAME, "KVGUARD_ALLOW_FAULTS": "1",
           "KVGUARD_FAULTS": "refcount_bump=1,skip_free_on_abort=1",
           "KVGUARD_FAULTS_DP_RANKS": str(LEAKING_RANK),
           "KVGUARD_ONLINE_BUDGET_FRACTION": "0.05", "KVGUARD_COST_SAMPLE_EVERY_STEPS": "16"}
    with ServerProcess(spec, log_path=root / "server.log", env=env,
                       health_timeout_seconds=SERVER_HEALTH_TIMEOUT_S) as server:
        model = spec.served_model_name
        cached = _fill_saturated(server.base_url, model, run_dir, spec.block_size)
        _leak(server.base_url, model, run_dir)
        with _sidecar(run_dir, engines=2) as metrics_url:
            yield DataParallelServer(base_url=server.base_url, run_dir=run_dir,
                                     sidecar_metrics_url=metrics_url,
                                     cached_blocks_truth=cached)


@pytest.fixture(scope="session")
def saturated_engine(dp_server: DataParallelServer) -> SaturatedEngine:
    """Rank 0: healthy, its prefix cache saturated, judged ``saturated`` at a drained
    checkpoint; ``cached_blocks_truth`` is vLLM's own count of its cached blocks."""
    return SaturatedEngine(name=SATURATED, vllm_url=dp_server.base_url,
                           vllm_engine=str(SATURATED_RANK),
                           sidecar_metrics_url=dp_server.sidecar_metrics_url,
                           run_dir=dp_server.run_dir,
                           cached_blocks_truth=dp_server.cached_blocks_truth)


@pytest.fixture(scope="session")
def leaking_engine(dp_server: DataParallelServer) -> ObservedEngine:
    """Rank 1: the faults fired there, so it holds KV blocks nobody will free."""
    return ObservedEngine(name=LEAKING, vllm_url=dp_server.base_url,
                          vllm_engine=str(LEAKING_RANK),
                          sidecar_metrics_url=dp_server.sidecar_metrics_url,
                          run_dir=dp_server.run_dir)


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


@pytest.fixture(scope="session")
def prometheus(leaking_engine: ObservedEngine, saturated_engine: SaturatedEngine,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    """A real Prometheus (Debian 2.42) scraping the sidecar every second, with the
    kvguard alert rules loaded and evaluated every second."""
    work = tmp_path_factory.mktemp("prometheus")
    targets = [urllib.parse.urlsplit(u) for u in sorted(
        {e.sidecar_metrics_url for e in (leaking_engine, saturated_engine)})]
    assert {t.path for t in targets} == {"/metrics"}, targets
    vllm_target = urllib.parse.urlsplit(leaking_engine.vllm_url).netloc
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        # vLLM's own /metrics too, as a fleet scrapes both: in Kubernetes both targets of
        # one pod get that pod's labels; here a static ``pod`` label stands in for them.
        "scrape_configs": [{
            "job_name": "kvguard",
            "scheme": "http",
            "metrics_path": "/metrics",
            "static_configs": [{"targets": [t.netloc for t in targets],
                                "labels": {"pod": POD}}],
        }, {
            "job_name": "vllm",
            "scheme": "http",
            "metrics_path": "/metrics",
            "static_configs": [{"targets": [vllm_target], "labels": {"pod": POD}}],
        }],
    }
    with _prometheus(config, work) as server:
        yield server


@contextmanager
def _prometheus(config: dict[str, Any], work: Path) -> Iterator[PrometheusServer]:
    """A real Prometheus (Debian 2.42) with ``config``, its data and log under ``work``."""
    binary = prometheus_binary()
    work.mkdir(parents=True, exist_ok=True)
    config_file = work / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_loopback_port()
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


# ------------------------------------------------------------------ P/D replay


PD_SCRAPES_PER_PHASE_S = 3.5
"""Each phase stays up this long after every target was scraped with it (1 s scrapes,
0.5 s sidecar polls): two scrapes or more per phase, so counters rise between samples."""


def _scrape_config(job: str, targets: dict[str, str]) -> dict[str, Any]:
    return {"job_name": job, "scheme": "http", "metrics_path": "/metrics",
            "static_configs": [{"targets": [netloc],
                                "labels": {"namespace": PD_NAMESPACE, "pod": PD_PODS[engine]}}
                               for engine, netloc in sorted(targets.items())]}


def _until_scraped(prom: PrometheusServer, after: float, targets: int) -> None:
    """Wait until every target's latest scrape started after ``after``."""
    deadline = time.monotonic() + PROMETHEUS_READY_TIMEOUT_S + 10
    expr = f'count(timestamp(up{{namespace="{PD_NAMESPACE}"}} == 1) > {after:.3f})'
    while True:
        doc = prom.get("/api/v1/query", query=expr)
        result = doc["data"]["result"]
        if result and float(result[0]["value"][1]) == targets:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the P/D targets were not all scraped after {after}: "
                        f"{prom.get('/api/v1/targets')}\n{prom.log_tail()}")
        time.sleep(0.25)


@pytest.fixture(scope="session")
def pd_replay(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdReplay]:
    """Every phase of the recorded P/D run, played in order; the last stays served."""
    root = tmp_path_factory.mktemp("pd-replay")
    names = pd_phases()
    run_dirs = {engine: root / f"{engine}-run" for engine in PD_PODS}
    for engine, run_dir in run_dirs.items():
        publish_state(names[0], engine, run_dir)
    with contextlib.ExitStack() as stack:
        sidecars = {e: stack.enter_context(_sidecar(d, engines=1)) for e, d in run_dirs.items()}
        vllm = {e: stack.enter_context(serve_vllm(e, names[0])) for e in PD_PODS}
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "rule_files": [str(RULES)],
            "scrape_configs": [
                _scrape_config("kvguard", {e: urllib.parse.urlsplit(u).netloc
                                           for e, u in sidecars.items()}),
                _scrape_config("vllm", {e: v.netloc for e, v in vllm.items()}),
            ],
        }
        prom = stack.enter_context(_prometheus(config, root / "prometheus"))
        _until_scraped(prom, 0.0, 4)
        time.sleep(PD_SCRAPES_PER_PHASE_S)
        for phase in names[1:]:
            switched = time.time()
            for engine, run_dir in run_dirs.items():
                publish_state(phase, engine, run_dir)
                vllm[engine].phase = phase
            time.sleep(1.0)  # the sidecars poll their run dirs every 0.5 s
            _until_scraped(prom, switched + 1.0, 4)
            time.sleep(PD_SCRAPES_PER_PHASE_S)
        yield PdReplay(prometheus=prom, sidecar_metrics_urls=sidecars, played=tuple(names))


# ------------------------------------------------------------- self-monitoring

def _self_rule_file(work: Path) -> Path:
    """The shipped kvguard-self group, expressions, labels and annotations verbatim, with
    each alert's ``for`` shortened to SELF_RULE_FOR: Prometheus cannot be made to wait 5
    minutes faster, and promtool's unit tests check the shipped ``for`` durations."""
    doc = yaml.safe_load(RULES.read_text())
    (group,) = [g for g in doc["groups"] if g["name"] == "kvguard-self"]
    for rule in group["rules"]:
        if "alert" in rule:
            assert rule["for"] in ("5m", "15m"), rule
            rule["for"] = SELF_RULE_FOR
    path = work / "kvguard-self.yaml"
    path.write_text(yaml.safe_dump({"groups": [group]}, sort_keys=False))
    return path


def _pod_target(netloc: str, pod: str, container: str, port_name: str) -> dict[str, Any]:
    """A static target with the meta labels Kubernetes pod discovery gives a pod's port."""
    return {"targets": [netloc], "labels": {
        "__meta_kubernetes_namespace": FLEET_NAMESPACE,
        "__meta_kubernetes_pod_name": pod,
        "__meta_kubernetes_pod_container_name": container,
        "__meta_kubernetes_pod_container_port_name": port_name,
        "__meta_kubernetes_pod_phase": "Running",
        "__meta_kubernetes_pod_node_name": "node-1",
        "__meta_kubernetes_pod_label_app_kubernetes_io_name": "vllm",
        "__meta_kubernetes_pod_label_app_kubernetes_io_instance": pod,
    }}


def _fleet_config(targets: dict[str, list[dict[str, Any]]], rule_file: Path) -> dict[str, Any]:
    """deploy/prometheus/scrape-config.yaml with pod discovery replaced by ``targets`` per
    job (Debian's Prometheus has no Kubernetes discovery) and the static examples left out."""
    shipped = yaml.safe_load(SCRAPE_CONFIG.read_text())
    jobs = []
    for job in shipped["scrape_configs"]:
        if "kubernetes_sd_configs" not in job:
            continue
        job = dict(job)
        del job["kubernetes_sd_configs"]
        job["static_configs"] = targets[job["job_name"]]
        jobs.append(job)
    assert {j["job_name"] for j in jobs} == set(targets), jobs
    return {"global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                       "evaluation_interval": "1s"},
            "rule_files": [str(rule_file)], "scrape_configs": jobs}


@pytest.fixture(scope="module")
def watched_fleet(dp_server: DataParallelServer, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[WatchedFleet]:
    root = tmp_path_factory.mktemp("watched-fleet")
    port = free_loopback_port()
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "kvguard.cli.main", "sidecar", "--host", "127.0.0.1",
         "--port", str(port), "--run-dir", str(dp_server.run_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    unwatched_run_dir = root / "plain-run"
    unwatched_run_dir.mkdir()
    spec = EngineSpec(model_dir=make_tiny_model(root / "model"))
    env = {"VLLM_PLUGINS": PLUGINS_TYPO, "KVGUARD_RUN_DIR": str(unwatched_run_dir)}
    try:
        with ServerProcess(spec, log_path=root / "plain-server.log", env=env,
                           health_timeout_seconds=SERVER_HEALTH_TIMEOUT_S) as plain:
            sidecar_netloc = f"127.0.0.1:{port}"
            watched_vllm = urllib.parse.urlsplit(dp_server.base_url).netloc
            plain_vllm = urllib.parse.urlsplit(plain.base_url).netloc
            targets = {
                "kvguard": [_pod_target(sidecar_netloc, WATCHED_POD, "kvguard",
                                        "kvguard-metrics")],
                "vllm": [_pod_target(watched_vllm, WATCHED_POD, "vllm", "http"),
                         _pod_target(plain_vllm, UNWATCHED_POD, "vllm", "http")],
            }
            work = root / "prometheus"
            work.mkdir()
            config = _fleet_config(targets, _self_rule_file(work))
            with _prometheus(config, work) as prom:
                # both vLLM servers and the sidecar scraped, the sidecar serving both
                # engines of the data-parallel server
                expr = ('count(up{job="vllm"} == 1) + count(up{job="kvguard"} == 1)'
                        ' + count(kvguard_engine_up == 1)')
                deadline = time.monotonic() + PROMETHEUS_READY_TIMEOUT_S + 15
                while True:
                    result = prom.get("/api/v1/query", query=expr)["data"]["result"]
                    if result and float(result[0]["value"][1]) == 5:
                        break
                    if time.monotonic() > deadline:
                        pytest.fail(f"not every target scraped: {prom.get('/api/v1/targets')}"
                                    f"\n{prom.log_tail()}")
                    time.sleep(0.25)
                yield WatchedFleet(prometheus=prom, sidecar=sidecar,
                                   sidecar_netloc=sidecar_netloc,
                                   watched_vllm_url=dp_server.base_url,
                                   unwatched_vllm_url=plain.base_url,
                                   unwatched_run_dir=unwatched_run_dir)
    finally:
        if sidecar.poll() is None:
            _stop(sidecar)
