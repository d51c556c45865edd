"""Real engines for the reliability tests: one baseline without kvguard, guarded ones on demand."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import vllm  # a missing engine must fail here, loudly, not skip
from _reliability import EngineFactory, Outputs, ReliabilityEngine, spec_for

from kvguard.testing.tiny_model import make_tiny_model

assert vllm.__version__, "vLLM must be importable for the reliability tests"

# The engine-state factories live with the sidecar tests (no package __init__ in tests/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sidecar"))


@pytest.fixture(scope="session")
def rel_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("rel-model"))


@pytest.fixture(scope="session")
def rel_engines(rel_model_dir: Path) -> Iterator[EngineFactory]:
    """Factory of real in-process engines (same spec); all released together at the end.

    ``rel_engines(enabled=True, run_dir=..., name=..., extra_env={...})``. vLLM breaks
    the other in-process engines when one is shut down, so none is shut down early.
    """
    built: list[ReliabilityEngine] = []

    def make(*, enabled: bool = True, run_dir: Path | None = None, name: str | None = None,
             extra_env: dict[str, str] | None = None) -> ReliabilityEngine:
        e = ReliabilityEngine(spec_for(rel_model_dir), enabled=enabled, run_dir=run_dir,
                              name=name, extra_env=extra_env)
        built.append(e)
        return e

    yield make
    for e in built:
        e.close()


@pytest.fixture(scope="session")
def baseline(rel_engines: EngineFactory) -> ReliabilityEngine:
    """The same engine without kvguard (KVGUARD_ENABLED=0): the reference outputs."""
    return rel_engines(enabled=False)


@pytest.fixture(scope="session")
def baseline_outputs(baseline: ReliabilityEngine) -> Outputs:
    first = baseline.mixed_round()
    assert baseline.mixed_round() == first, "the baseline engine itself is not deterministic"
    # prefix1-3 and long0-2 finish; the two aborted requests produce no final output
    assert sorted(first) == ["long0", "long1", "long2", "prefix1", "prefix2", "prefix3"]
    return first
