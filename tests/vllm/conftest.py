"""Real in-process vLLM engines with kvguard attached, built from a tiny dummy model."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import vllm  # a missing engine must fail here, loudly, not skip

from kvguard.chaos.harness import EngineHarness, prompt
from kvguard.testing.engine import EngineSpec
from kvguard.testing.tiny_model import make_tiny_model

assert vllm.__version__, "vLLM must be importable for the engine tests"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("kvguard-run")
    os.environ["KVGUARD_RUN_DIR"] = str(d)
    return d


Harness = EngineHarness


def build(model_dir: Path, **overrides: Any) -> Harness:
    """A real engine; ``overrides`` are EngineSpec fields, anything else goes to vLLM."""
    names = {f.name for f in dataclasses.fields(EngineSpec)}
    spec_kw = {k: v for k, v in overrides.items() if k in names}
    extra = {k: v for k, v in overrides.items() if k not in names}
    return EngineHarness(EngineSpec(model_dir=model_dir, extra=extra, **spec_kw))


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


__all__ = ["Harness", "build", "prompt"]
