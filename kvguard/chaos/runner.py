"""Run the matrix: each scenario in its own process, on a fresh real engine.

A process per scenario because engines share process-wide vLLM state (one
worker-side KV connector per process; a double free leaves a corrupt pool) and
because shutting one in-process engine down breaks the others.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

from kvguard.chaos.harness import EngineHarness
from kvguard.chaos.result import ScenarioResult, Status, summarize
from kvguard.chaos.scenarios import ExpectedOffload, NotExercised, Scenario, matrix
from kvguard.chaos.truth import PoolTruth, disagreement
from kvguard.core.offload import OffloadState, OffloadVerdict
from kvguard.core.report import CheckpointReport
from kvguard.core.types import Evidence, LeakCause
from kvguard.testing.scheduling import Scheduling
from kvguard.vllm_plugin.request_ids import client_request_id

SCENARIO_TIMEOUT_SECONDS = 240.0
RESULT_PREFIX = "KVGUARD-CHAOS-RESULT "


def expected_text(s: Scenario) -> str:
    text = _expected_pool_text(s)
    o = s.offload
    if o is not None and o.verdict is not OffloadVerdict.OK:
        kind = o.stuck_kind.value if o.stuck_kind else "a"
        text += f"; offload {o.verdict.value}: {kind} job of {','.join(sorted(o.owner_ids))}"
        if o.waiting_ids:
            text += f", {','.join(sorted(o.waiting_ids))} waiting"
    return text


def _expected_pool_text(s: Scenario) -> str:
    if s.leak is None:
        return "/".join(sorted(v.value for v in s.verdicts)) + ", no leak"
    who = ",".join(sorted(s.leak.client_ids)) or (
        "the fault's victim" if s.leak.named_by_fault else "no request")
    path = s.leak.path.value if s.leak.path else "any path"
    return f"leak: {s.leak.cause.value}/{path} {who}"


def score(s: Scenario, report: CheckpointReport, truth: PoolTruth | None = None,
          victims: frozenset[str] = frozenset()) -> tuple[Status, str]:
    """``passed`` only when the verdict, cause, path and named requests are all right and
    the leaked block ids and their distinct count are the pool's own (``truth``, read from
    vLLM after the drain); ``victims``: client ids the fault fired on."""
    if truth is not None:
        why = disagreement(report, truth)
        if why:
            return Status.FAILED, "contradicts vLLM's pool: " + why
    if report.verdict not in s.verdicts:
        return Status.FAILED, f"verdict {report.verdict.value}, expected " \
                              f"{'/'.join(v.value for v in s.verdicts)}"
    if s.leak is None:
        if report.leaks:
            return Status.FAILED, "false alarm: " + summarize(report)[0]
        return Status.PASSED, ""
    exp = s.leak
    allowed = {exp.cause} | ({LeakCause.REFCOUNT_DRIFT} if exp.cause is LeakCause.ORPHAN else set())
    wrong = [lk for lk in report.leaks if lk.cause not in allowed]
    if wrong:
        return Status.FAILED, f"unexpected cause {wrong[0].cause.value}"
    hits = [lk for lk in report.leaks if lk.cause is exp.cause
            and (exp.path is None or lk.path is exp.path)]
    if not hits:
        return Status.FAILED, f"no {exp.cause.value} finding on path " \
                              f"{exp.path.value if exp.path else 'any'}"
    named = {lk.client_request_id for lk in report.leaks if lk.client_request_id}
    expected = exp.client_ids | (victims if exp.named_by_fault else frozenset())
    if exp.named_by_fault and not victims:
        return Status.FAILED, "the fault never fired"
    if expected and not expected <= named:
        return Status.FAILED, f"requests named {sorted(named)}, expected {sorted(expected)}"
    if expected and named - expected:
        return Status.FAILED, f"innocent requests accused: {sorted(named - expected)}"
    return Status.PASSED, ""


def score_offload(exp: ExpectedOffload, state: OffloadState | None) -> tuple[Status, str]:
    """kvguard's offload audit against what the scenario expects (after the drive)."""
    if state is None:
        return Status.FAILED, "kvguard has no offload audit on this engine"
    if state.verdict is not exp.verdict:
        return Status.FAILED, f"offload verdict {state.verdict.value}, expected " \
                              f"{exp.verdict.value}: {state.explanation[:200]}"
    stuck = [j for j in state.stuck if exp.stuck_kind is None or j.kind is exp.stuck_kind]
    if exp.stuck_kind is not None and not stuck:
        return Status.FAILED, f"no stuck {exp.stuck_kind.value} job named"
    owners = {j.client_request_id for j in stuck}
    if not exp.owner_ids <= owners:
        return Status.FAILED, f"stuck jobs of {sorted(map(str, owners))}, expected " \
                              f"{sorted(exp.owner_ids)}"
    waiting = {w.client_request_id for w in state.waiting}
    if not exp.waiting_ids <= waiting:
        return Status.FAILED, f"waiting requests {sorted(map(str, waiting))}, expected " \
                              f"{sorted(exp.waiting_ids)}"
    return Status.PASSED, ""


def scenarios_for(workdir: Path) -> tuple[Path, dict[str, Scenario]]:
    """The main model's directory and every scenario, with the draft and hybrid models
    they need created under ``workdir``."""
    from kvguard.testing.tiny_model import make_draft_model, make_hybrid_model, make_tiny_model

    model = make_tiny_model(workdir / "model")
    found = matrix(make_draft_model(workdir / "model"), make_hybrid_model(workdir / "model"))
    return model, {s.name: s for s in found}


def build_for(s: Scenario, model: Path,
              scheduling: Scheduling = Scheduling.SYNC) -> EngineHarness:
    """A fresh real engine for ``s``: on the chaos scheduler (it records what vLLM did and
    injects the scenario's faults in vLLM's own paths; its ``AsyncScheduler`` twin for
    async scheduling), with the scenario's settings."""
    from kvguard.chaos.faults import FaultPlan, scheduler_cls_for
    from kvguard.testing.engine import EngineSpec

    overrides: dict[str, object] = {"model_dir": model, "scheduling": scheduling, **s.engine}
    overrides["extra"] = {**dict(s.engine.get("extra", {})),  # type: ignore[call-overload]
                          "scheduler_cls": scheduler_cls_for(scheduling)}
    h = EngineHarness(EngineSpec(**overrides))  # type: ignore[arg-type]
    h.guard.config = dataclasses.replace(
        h.guard.config, delayed_free_bound_seconds=s.delayed_free_bound_seconds,
        **s.kvguard)  # type: ignore[arg-type]
    if s.faults:
        h.chaos.arm(FaultPlan(dict(s.faults)))
    return h


def scored_report(s: Scenario, h: EngineHarness) -> CheckpointReport:
    """The report a scenario is judged on (after ``s.drive(h)``)."""
    return h.latest() if s.evidence is Evidence.DRAINED else _latest_online(h)


def fault_victims(h: EngineHarness) -> frozenset[str]:
    """Client ids of the requests the armed faults fired on."""
    return frozenset(client_request_id(rid) for _, rid in h.chaos.faults.fired)


def run_in_this_process(name: str, workdir: Path,
                        scheduling: Scheduling = Scheduling.SYNC) -> ScenarioResult:
    """Build the engine, drive the scenario, score kvguard's report against vLLM's pool."""
    model, scenarios = scenarios_for(workdir)
    s = scenarios[name]
    base = ScenarioResult(name=s.name, scheduling=scheduling, injected=s.injected,
                          reproduces=s.reproduces, expected=expected_text(s), concluded="",
                          status=Status.ERROR)
    t0 = time.monotonic()
    try:
        h = build_for(s, model, scheduling)
    except Exception as exc:
        status = Status.UNSUPPORTED if s.may_be_unsupported else Status.ERROR
        msg = " ".join(str(exc).split())[:300] or type(exc).__name__
        return base.model_copy(update={"status": status, "concluded": "-",
                                       "why": f"engine could not be built: {msg}",
                                       "seconds": time.monotonic() - t0})
    base = base.model_copy(update={"scheduling": h.scheduling})  # what vLLM really ran
    try:
        evidence = s.drive(h)
        report = h.latest_drained() if s.never_drains else scored_report(s, h)
        truth = h.pool_truth()
    except NotExercised as exc:
        return base.model_copy(update={"status": Status.ERROR, "concluded": "-",
                                       "why": f"path not exercised: {exc}",
                                       "seconds": time.monotonic() - t0})
    except Exception as exc:
        return base.model_copy(update={"status": Status.ERROR, "concluded": "-",
                                       "why": f"{type(exc).__name__}: {exc}"[:300],
                                       "seconds": time.monotonic() - t0})
    offload = h.guard.poll_offload()
    if report is None:  # never_drains, and it did not: no drained verdict to score
        alarms = [r for r in h.reports() if r.leaks]
        status, why = (Status.FAILED, "false alarm: " + summarize(alarms[-1])[0]) if alarms \
            else (Status.PASSED, "")
        if status is Status.PASSED and s.offload is not None:
            status, why = score_offload(s.offload, offload)
        concluded = f"no drained checkpoint; offload {offload.verdict.value}" \
            if offload is not None else "no drained checkpoint"
        return base.model_copy(update={"status": status, "why": why, "concluded": concluded,
                                       "evidence": evidence,
                                       "seconds": time.monotonic() - t0})
    status, why = score(s, report, truth, fault_victims(h))
    if status is Status.PASSED and s.offload is not None:
        status, why = score_offload(s.offload, offload)
    concluded, leaks = summarize(report)
    if offload is not None and offload.verdict is not OffloadVerdict.OK:
        concluded += f"; offload {offload.verdict.value}"
    return base.model_copy(update={"status": status, "why": why, "concluded": concluded,
                                   "evidence": evidence, "verdict": report.verdict,
                                   "leaks": leaks, "seconds": time.monotonic() - t0})


def _latest_online(h: EngineHarness) -> CheckpointReport:
    reports = h.online_reports()
    if not reports:
        raise NotExercised("the online audit made no report")
    return reports[-1]


def run_matrix(
    names: Sequence[str] | None,
    workdir: Path,
    progress: Callable[[int, int, ScenarioResult | None, str], None] | None = None,
    schedulings: Sequence[Scheduling] = (Scheduling.SYNC,),
    jobs: int = 1,
) -> list[ScenarioResult]:
    """Each scenario in a child process (``python -m kvguard.chaos.worker``), once per
    scheduling mode; results in the order given (a scenario's runs adjacent).

    ``jobs``: children running at once. Each child has its own engine, pool and run
    directory, so they do not interact; a child spends most of its life importing vLLM
    and building the engine on one core, so ``jobs=2`` on 2 cores took 16 s for two
    scenarios that took 27 s one after the other (measured). ``progress`` is called as
    runs start and end, from the calling thread only."""
    all_names = [s.name for s in matrix()]
    chosen = list(names) if names else all_names
    unknown = sorted(set(chosen) - set(all_names))
    if unknown:
        from kvguard.errors import ConfigError

        raise ConfigError("--only", ",".join(unknown), "scenario names from `kvguard chaos "
                                                        "--list`")
    if jobs < 1:
        from kvguard.errors import ConfigError

        raise ConfigError("--jobs", jobs, "a whole number of scenarios at once, at least 1")
    runs = [(name, mode) for name in chosen for mode in schedulings]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": "kvguard"}

    def label(i: int) -> str:
        return f"{runs[i][0]} [{runs[i][1].value}]"

    results: dict[int, ScenarioResult] = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        pending: dict[Future[ScenarioResult], int] = {}
        next_run = 0
        while next_run < len(runs) or pending:
            while next_run < len(runs) and len(pending) < jobs:
                if progress is not None:
                    progress(next_run, len(runs), None, label(next_run))
                name, mode = runs[next_run]
                pending[pool.submit(_run_child, name, mode, workdir, env)] = next_run
                next_run += 1
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                i = pending.pop(fut)
                results[i] = fut.result()
                if progress is not None:
                    progress(i + 1, len(runs), results[i], label(i))
    return [results[i] for i in range(len(runs))]


def _run_child(name: str, mode: Scheduling, workdir: Path,
               env: dict[str, str]) -> ScenarioResult:
    t0 = time.monotonic()
    stem = name if mode is Scheduling.SYNC else f"{name}.{mode.value}"
    log = workdir / f"{stem}.log"
    # A run dir per run: engines of runs at once must not publish into one another's.
    env = {**env, "KVGUARD_RUN_DIR": str(workdir / "run" / stem)}
    try:
        with log.open("wb") as out:
            proc = subprocess.run(
                [sys.executable, "-m", "kvguard.chaos.worker", name, str(workdir), mode.value],
                stdout=subprocess.PIPE, stderr=out, env=env,
                timeout=SCENARIO_TIMEOUT_SECONDS, check=False)
        line = next((ln for ln in proc.stdout.decode().splitlines()[::-1]
                     if ln.startswith(RESULT_PREFIX)), None)
        if line is None:
            raise RuntimeError(f"worker exited {proc.returncode} without a result; see {log}")
        return ScenarioResult.model_validate(json.loads(line[len(RESULT_PREFIX):]))
    except (subprocess.TimeoutExpired, RuntimeError) as exc:
        s = next(s for s in matrix() if s.name == name)
        return ScenarioResult(name=name, scheduling=mode, injected=s.injected,
                              reproduces=s.reproduces, expected=expected_text(s),
                              concluded="-", status=Status.ERROR, why=str(exc)[:300],
                              seconds=time.monotonic() - t0)
