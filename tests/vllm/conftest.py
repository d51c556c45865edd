"""Real in-process vLLM engines with kvguard attached, built from a tiny dummy model."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import vllm
from vllm import EngineArgs, LLMEngine, SamplingParams
from vllm.inputs import TokensPrompt

from kvguard.demo.tiny_model import make_tiny_model
from kvguard.vllm_plugin.guard import EngineGuard, guard_of

assert vllm.__version__, "vLLM must be importable for the engine tests"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("kvguard-run")
    os.environ["KVGUARD_RUN_DIR"] = str(d)
    return d


class Harness:
    """One real engine, its scheduler and the kvguard guard on it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.scheduler: Any = engine.engine_core.engine_core.scheduler
        guard = guard_of(self.scheduler)
        assert guard is not None, "kvguard did not attach: is the entry point installed?"
        self.guard: EngineGuard = guard
        self.pool: Any = self.scheduler.kv_cache_manager.block_pool
        self._n = 0

    def add(self, tokens: list[int], max_tokens: int, rid: str | None = None) -> str:
        self._n += 1
        rid = rid or f"req{self._n}"
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=tokens),
                                SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return rid

    def internal_id(self, client_id: str) -> str:
        for rid in self.scheduler.requests:
            if rid == client_id or rid.rsplit("-", 1)[0] == client_id:
                return str(rid)
        raise KeyError(client_id)

    def step_until(self, cond: Callable[[], bool], max_steps: int = 2000) -> int:
        for i in range(max_steps):
            if cond():
                return i
            self.engine.step()
        raise AssertionError(f"condition not reached in {max_steps} steps")

    def run_to_completion(self, max_steps: int = 2000) -> int:
        return self.step_until(lambda: not self.engine.has_unfinished_requests(), max_steps)

    def latest(self) -> Any:
        assert self.guard.reports, "no checkpoint was taken"
        return self.guard.reports[-1]

    def num_usable(self) -> int:
        return int(self.pool.num_gpu_blocks) - 1


def build(model_dir: Path, **overrides: Any) -> Harness:
    kwargs: dict[str, Any] = dict(
        model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, block_size=32,
        num_gpu_blocks_override=64, max_model_len=512, kv_cache_memory_bytes=16 << 20,
        distributed_executor_backend="uni", enable_prefix_caching=True,
        disable_log_stats=False, enforce_eager=True, seed=0,
    )
    kwargs.update(overrides)
    return Harness(LLMEngine.from_engine_args(EngineArgs(**kwargs)))


@pytest.fixture(scope="session")
def engines(tiny_model_dir: Path, run_dir: Path) -> Iterator[Callable[..., Harness]]:
    """Factory of real engines; all are shut down together at the end (vLLM needs that)."""
    built: list[Harness] = []

    def make(**overrides: Any) -> Harness:
        h = build(tiny_model_dir, **overrides)
        built.append(h)
        return h

    yield make
    for h in built:
        h.guard.close()
    time.sleep(0)


def prompt(seed: int, n: int) -> list[int]:
    """A deterministic token-id prompt of ``n`` tokens, distinct per ``seed``."""
    return [3 + (seed * 7919 + i * 31) % 500 for i in range(n)]
