"""Shared pieces of the reliability tests: real engines, one deterministic workload, a sidecar.

``ReliabilityEngine`` is a real in-process vLLM engine (with or without kvguard)
on a 12-block pool, so that one round of ``mixed_round`` goes through every exit
path kvguard hooks: normal finish, prefix-cache hits, preemption, aborts while
waiting and mid-decode. Sampling is greedy, so two engines built from the same
spec give the same token ids for the same round: that is how a test proves
that kvguard (and every fault injected into it) leaves the engine's outputs
unchanged.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvguard.chaos.harness import prompt
from kvguard.testing.engine import EngineSpec, build_engine, scheduler_of
from kvguard.testing.ports import free_loopback_port
from kvguard.vllm_plugin.guard import EngineGuard, guard_of

Outputs = dict[str, list[int]]
"""Request name (without the round tag) -> generated token ids, for finished requests."""


EngineFactory = Callable[..., "ReliabilityEngine"]
"""``rel_engines(enabled=True, run_dir=None, name=None, extra_env=None)`` (conftest)."""


def spec_for(model_dir: Path) -> EngineSpec:
    """11 usable blocks of 32 tokens: four 60+120-token requests must preempt each other."""
    return EngineSpec(model_dir=model_dir, num_gpu_blocks_override=12, max_model_len=256,
                      max_num_seqs=8)


@contextlib.contextmanager
def environ(**values: str | None) -> Iterator[None]:
    """Set (or, with None, unset) environment variables for the duration of the block."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class ReliabilityEngine:
    """A real in-process engine; ``guard`` is None when it was built with KVGUARD_ENABLED=0."""

    def __init__(self, spec: EngineSpec, *, enabled: bool, run_dir: Path | None = None,
                 name: str | None = None, extra_env: dict[str, str] | None = None) -> None:
        from kvguard.vllm_plugin.plugin import register

        register()  # idempotent: Scheduler is patched even if vLLM loaded plugins earlier
        env: dict[str, str | None] = {"KVGUARD_ENABLED": "1" if enabled else "0"}
        if run_dir is not None:
            env["KVGUARD_RUN_DIR"] = str(run_dir)
        if name is not None:
            env["KVGUARD_ENGINE_NAME"] = name
        env.update(extra_env or {})
        with environ(**env):
            self.engine: Any = build_engine(spec)
        self.scheduler: Any = scheduler_of(self.engine)
        self.guard: EngineGuard | None = guard_of(self.scheduler)
        if enabled and self.guard is None:
            raise AssertionError("kvguard did not attach to the engine")
        if not enabled and self.guard is not None:
            raise AssertionError("KVGUARD_ENABLED=0 must leave the engine without kvguard")
        self.rounds = 0

    @property
    def g(self) -> EngineGuard:
        assert self.guard is not None
        return self.guard

    def mixed_round(self, on_step: Callable[[int], None] | None = None, *, seed: int = 0,
                    reset_prefix_cache: bool = True, extra_sharers: int = 0,
                    max_steps: int = 3000) -> Outputs:
        """One deterministic round through every exit path; returns the finished outputs.

        Step 0: a request with a 64-token prefix, three long requests (60 + 120
        tokens, they preempt each other in the 11-block pool) and two to abort.
        Step 2: one of those is aborted (still waiting or just scheduled).
        Step 3: two requests sharing the prefix (prefix-cache hits).
        Step 10: the other is aborted mid-decode. ``on_step(i)`` runs after step i.
        ``extra_sharers`` more prefix sharers join at step 3. ``seed`` changes every
        prompt. The round ends drained: nothing waiting or running.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.rounds += 1
        tag = f"r{self.rounds}"
        if reset_prefix_cache:
            assert self.engine.reset_prefix_cache()  # the same start for every engine
        shared = prompt(1 + seed * 10, 64)

        def add(name: str, tokens: list[int], max_tokens: int) -> None:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=7,
                                    ignore_eos=True)
            self.engine.add_request(f"{tag}-{name}", TokensPrompt(prompt_token_ids=tokens),
                                    params)

        add("prefix1", shared + prompt(2 + seed * 10, 8), 16)
        for i in range(3):
            add(f"long{i}", prompt(10 + i + seed * 10, 60), 120)
        add("abort-waiting", prompt(20 + seed * 10, 40), 100)
        add("abort-decoding", prompt(21 + seed * 10, 40), 100)
        out: Outputs = {}
        step = 0
        while self.engine.has_unfinished_requests():
            for o in self.engine.step():
                if o.finished:
                    out[o.request_id.split("-", 1)[1]] = list(o.outputs[0].token_ids)
            if step == 2:
                self.engine.abort_request([f"{tag}-abort-waiting"])
            if step == 3:
                add("prefix2", shared + prompt(3 + seed * 10, 8), 16)
                add("prefix3", shared + prompt(4 + seed * 10, 8), 16)
                for k in range(extra_sharers):
                    add(f"sharer{k}", shared + prompt(1000 + k + seed * 10, 8), 8)
            if step == 10:
                self.engine.abort_request([f"{tag}-abort-decoding"])
            if on_step is not None:
                on_step(step)
            step += 1
            if step > max_steps:
                raise AssertionError(f"round did not finish in {max_steps} steps")
        return out

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()


WAIT_SECONDS = 120.0
"""Deadline for anything awaited (a sidecar starting, a state written, a reader catching
up). Generous: on a loaded 2-core host a Python process can take tens of seconds to start;
the condition decides, the deadline only bounds a failure."""


def wait_for(cond: Callable[[], Any], seconds: float = WAIT_SECONDS,
             what: str = "condition") -> Any:
    deadline = time.monotonic() + seconds
    while True:
        try:
            value = cond()
        except (httpx.HTTPError, OSError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached in {seconds:.0f} s")
        time.sleep(0.05)


def metric_samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def by_label(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, engine: str,
             label: str) -> dict[str, float]:
    return {lbl[label]: v for lbl, v in samples.get(name, []) if lbl.get("engine_name") == engine}


def summed_by_label(samples: dict[str, list[tuple[dict[str, str], float]]], name: str,
                    engine: str, label: str) -> dict[str, float]:
    """Like ``by_label``, summing over the other labels (e.g. ``evidence``)."""
    out: dict[str, float] = {}
    for lbl, v in samples.get(name, []):
        if lbl.get("engine_name") == engine:
            out[lbl[label]] = out.get(lbl[label], 0.0) + v
    return out


def one_value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str,
              engine: str) -> float | None:
    vals = [v for lbl, v in samples.get(name, []) if lbl.get("engine_name") == engine]
    assert len(vals) <= 1, (name, vals)
    return vals[0] if vals else None


class Sidecar:
    """``kvguard sidecar`` as a real subprocess on 127.0.0.1 (or a Unix socket)."""

    def __init__(self, run_dir: Path, log_path: Path, *, uds: Path | None = None,
                 port: int | None = None, env: dict[str, str] | None = None,
                 extra_args: list[str] | None = None) -> None:
        self.run_dir = run_dir
        self.log_path = log_path
        self.uds = uds
        self.port = port if port is not None or uds is not None else free_loopback_port()
        self.env = env or {}
        self.extra_args = extra_args or []
        self.process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "kvguard.cli.main", "sidecar", "--run-dir",
               str(self.run_dir)]
        if self.uds is not None:
            cmd += ["--uds", str(self.uds)]
        elif self.port is not None:
            cmd += ["--port", str(self.port)]
        return cmd + self.extra_args

    def start(self) -> Sidecar:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVGUARD_SIDECAR")}
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT,
                                            env={**env, **self.env})
        return self

    def client(self, timeout: float = 2.0) -> httpx.Client:
        if self.uds is not None:
            return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.uds)),
                                base_url="http://sidecar", timeout=timeout)
        return httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=timeout)

    def get(self, path: str, **params: Any) -> httpx.Response:
        with self.client() as c:
            return c.get(path, params=params)

    def wait_healthy(self, seconds: float = WAIT_SECONDS) -> None:
        def ok() -> bool:
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"sidecar exited with {self.process.returncode}: "
                                     f"{self.log_path.read_text(errors='replace')[-2000:]}")
            return self.get("/healthz").status_code == 200

        wait_for(ok, seconds, "sidecar healthy")

    def wait_engine_up(self, g: EngineGuard, seconds: float = WAIT_SECONDS) -> None:
        """Wait until the sidecar counts ``g``'s engine as up (``/healthz`` engines_up).

        The engine publishes a fresh state before every look: an idle in-process engine
        sends no heartbeat, and while a loaded host starts the sidecar its last state can
        go stale (30 s), which the sidecar rightly reports as down.
        """
        def up() -> bool:
            g.publish()
            return g.publisher.flush(seconds) and \
                self.get("/healthz").json()["engines_up"] >= 1

        wait_for(up, seconds, f"engine {g.engine} seen up by the sidecar")

    def signal(self, signum: signal.Signals) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signum)

    def kill(self) -> None:
        """SIGKILL: the sidecar is gone at once, nothing flushed, nothing cleaned up."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()
            self.process = None

    def stop(self) -> None:
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.process.pid, signal.SIGCONT)
            os.kill(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
        self.process = None
