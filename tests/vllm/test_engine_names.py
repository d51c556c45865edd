"""Engine labels of data-parallel ranks, on vLLM's own ``ParallelConfig``.

vLLM runs each rank of a dense model as an independent engine: in the rank's EngineCore
process, before the scheduler (and kvguard) is built, ``run_engine_core`` sets
``data_parallel_index`` to the rank and ``reconfigure_for_independent_dp_rank`` resets
``data_parallel_rank`` to 0 and the size to 1. Reading ``data_parallel_rank`` named every
rank ``dp0``, and the ranks overwrote one state file. The end-to-end check is
``tests/observability/test_data_parallel.py`` (a real ``--data-parallel-size 2`` server).
"""

from __future__ import annotations

import multiprocessing
import re
import socket
from types import SimpleNamespace

import pytest
from vllm.config import ParallelConfig

from kvguard.config import ENGINE_NAME_PATTERN
from kvguard.core.engine import EngineIdentity, host_part
from kvguard.vllm_plugin.adapter import data_parallel_rank, served_model_name


def _rank_as_vllm_configures_it(rank: int, size: int) -> SimpleNamespace:
    pc = ParallelConfig(data_parallel_size=size)
    pc.data_parallel_index = rank  # what run_engine_core does first
    pc.reconfigure_for_independent_dp_rank()  # then this, for a dense model
    assert pc.data_parallel_rank == 0 and pc.data_parallel_size == 1  # vLLM's own reset
    return SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=pc))


def test_each_independent_rank_keeps_its_own_rank() -> None:
    ranks = [data_parallel_rank(_rank_as_vllm_configures_it(r, 2))[0] for r in (0, 1)]
    assert ranks == [0, 1]


def test_rank_zero_of_a_group_is_known_by_its_process_name(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sched = _rank_as_vllm_configures_it(0, 2)
    assert data_parallel_rank(sched) == (0, False)  # alone, as far as the config says
    monkeypatch.setattr(multiprocessing.current_process(), "name", "EngineCore_DP0")
    assert data_parallel_rank(sched) == (0, True)


def test_a_single_engine_is_not_a_group() -> None:
    sched = SimpleNamespace(vllm_config=SimpleNamespace(parallel_config=ParallelConfig()))
    assert data_parallel_rank(sched) == (0, False)


def test_configured_names_get_the_rank() -> None:
    alone = EngineIdentity(kind="vllm", version=None, default_name="dp0")
    rank1 = EngineIdentity(kind="vllm", version=None, default_name="dp1", replica="dp1")
    assert (alone.name(None), alone.name("llama")) == ("dp0", "llama")
    assert (rank1.name(None), rank1.name("llama")) == ("dp1", "llama-dp1")


def test_default_names_carry_the_host_so_that_a_fleet_never_shares_one() -> None:
    assert host_part("vllm-llama-7f9c-abcde") == "vllm-llama-7f9c-abcde"  # a pod's name
    assert host_part("gpu node#3") == "gpu-node-3"  # what an engine name cannot hold
    assert host_part("") == "host"
    assert len(host_part("x" * 300)) == 100
    assert re.match(ENGINE_NAME_PATTERN, f"{host_part('a' * 300)}-dp127")


def test_the_adapter_names_the_engine_after_its_host_and_rank_and_labels_it_as_vllm_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(socket, "gethostname", lambda: "pod-a")
    sched = _rank_as_vllm_configures_it(1, 2)
    sched.vllm_config.model_config = SimpleNamespace(served_model_name="llama-8b")
    rank, in_group = data_parallel_rank(sched)
    ident = EngineIdentity(kind="vllm", version=None, default_name=f"{host_part()}-dp{rank}",
                           replica=f"dp{rank}" if in_group else None,
                           model_name=served_model_name(sched), engine_index=rank)
    assert ident.name(None) == "pod-a-dp1" and ident.name("llama") == "llama-dp1"
    assert (ident.model_name, ident.engine_index) == ("llama-8b", 1)
