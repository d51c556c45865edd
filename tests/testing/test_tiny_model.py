"""The demo fixtures drive a real vLLM: the tiny model dir, the in-process engine, the server.

These tests need vLLM (``pip install -e .[engine]``); without it they fail, on purpose.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.v1.engine.llm_engine import LLMEngine

from kvguard.errors import ConfigError
from kvguard.testing.engine import (
    EngineSpec,
    ServerProcess,
    ServerStartError,
    build_engine,
    scheduler_of,
    shutdown_engine,
)
from kvguard.testing.tiny_model import VOCAB_SIZE, make_draft_model, make_tiny_model
from kvguard.testing.warmup import (
    WARMUP_MAX_TOKENS,
    WARMUP_PROMPT_TOKENS,
    WARMUP_REQUESTS,
    warmup_cached_blocks,
)

MAX_TOKENS = 8
MAX_STEPS = 200


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@dataclass(frozen=True)
class Built:
    """The module's engine and what its warm-up left, read right after build_engine()."""

    engine: LLMEngine
    counters: dict[str, float]
    """vLLM's own counters right after build_engine(): this engine's alone, since vLLM's
    stat logger unregisters every earlier ``vllm:`` collector of the process when the
    engine is built (``unregister_vllm_metrics``), so a difference against the counters
    of an engine built earlier in the session would go negative."""
    free_blocks: int
    hashed_blocks: int


@pytest.fixture(scope="module")
def built(model_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    with pytest.MonkeyPatch.context() as mp:  # kvguard reads it once, at engine start
        mp.setenv("KVGUARD_RUN_DIR", str(tmp_path_factory.mktemp("run")))
        engine = build_engine(EngineSpec(make_tiny_model(model_root)))
    pool = scheduler_of(engine).kv_cache_manager.block_pool
    yield Built(engine, _vllm_counters(),
                pool.get_num_free_blocks(),
                sum(b.block_hash is not None for b in pool.blocks))
    shutdown_engine(engine)


@pytest.fixture(scope="module")
def engine(built: Built) -> LLMEngine:
    return built.engine


def _vllm_counters() -> dict[str, float]:
    """vLLM's own in-process counters (one registry per process), summed over their labels."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    totals: dict[str, float] = {}
    for m in get_metrics_snapshot():
        if m.name in ("vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success"):
            totals[m.name] = totals.get(m.name, 0.0) + float(getattr(m, "value", 0))
    return totals


def _snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in directory.iterdir()}


def test_tiny_model_is_written_once_and_left_alone_on_the_second_call(tmp_path: Path) -> None:
    model_dir = make_tiny_model(tmp_path)
    first = _snapshot(model_dir)

    assert make_tiny_model(tmp_path) == model_dir == tmp_path / "kvguard-tiny"
    assert _snapshot(model_dir) == first
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= first.keys()
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["head_dim"], config["num_hidden_layers"]) == (128, 32, 2)


def test_tiny_model_is_deterministic_across_directories(tmp_path: Path) -> None:
    one = _snapshot(make_tiny_model(tmp_path / "one"))
    two = _snapshot(make_tiny_model(tmp_path / "two"))
    assert {name: content for name, (content, _) in one.items()} == {
        name: content for name, (content, _) in two.items()
    }


def test_tiny_tokenizer_maps_text_into_the_model_vocab(tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(make_tiny_model(tmp_path))
    ids = tokenizer("hello world, the quick brown fox unheardofword").input_ids
    assert len(ids) == 8
    assert all(0 <= i < VOCAB_SIZE for i in ids)
    assert ids[-1] == tokenizer.unk_token_id
    assert len(tokenizer) <= VOCAB_SIZE


def test_draft_model_is_one_layer_with_the_same_tokenizer(tmp_path: Path) -> None:
    main, draft = make_tiny_model(tmp_path), make_draft_model(tmp_path)
    assert main != draft
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    assert (draft / "tokenizer.json").read_bytes() == (main / "tokenizer.json").read_bytes()


def test_engine_spec_rejects_block_sizes_cpu_attention_cannot_run(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="block_size"):
        EngineSpec(tmp_path, block_size=16)


def test_engine_spec_rejects_a_pool_too_small_for_one_full_request(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="num_gpu_blocks_override"):
        EngineSpec(tmp_path, num_gpu_blocks_override=16, max_model_len=512)


def test_server_args_spell_the_spec_as_vllm_flags(tmp_path: Path) -> None:
    spec = EngineSpec(tmp_path / "m", extra={"speculative_config": {"method": "ngram"}})
    args = spec.server_args()
    assert args[args.index("--num-gpu-blocks-override") + 1] == "64"
    assert args[args.index("--speculative-config") + 1] == '{"method": "ngram"}'
    assert "--enable-prefix-caching" in args and "--enforce-eager" in args


def test_async_scheduling_is_asked_for_on_the_command_line_and_in_the_servers_env(
    tmp_path: Path,
) -> None:
    from kvguard.testing.scheduling import ASYNC_ENV, SITE_DIR, Scheduling, server_env

    sync = EngineSpec(tmp_path / "m")
    asynchronous = EngineSpec(tmp_path / "m", scheduling="async")  # type: ignore[arg-type]
    assert asynchronous.scheduling is Scheduling.ASYNC
    assert "--async-scheduling" in asynchronous.server_args()
    assert not any("async-scheduling" in a for a in sync.server_args())
    env = server_env(Scheduling.ASYNC, {"PYTHONPATH": "/src"})
    assert env == {ASYNC_ENV: "1", "PYTHONPATH": f"{SITE_DIR}:/src"}
    assert (SITE_DIR / "sitecustomize.py").is_file() and server_env(Scheduling.SYNC, {}) == {}
    with pytest.raises(ConfigError, match="scheduling"):
        EngineSpec(tmp_path, scheduling="overlap")  # type: ignore[arg-type]


@pytest.mark.engine
def test_a_built_engine_has_served_a_long_warm_up_prompt_and_its_pool_is_free_again(
    built: Built,
) -> None:
    """build_engine() sends one long request first (vLLM's CPU worker can die with SIGILL on
    a short first prompt on AMX hosts); it leaves no block used or cached behind."""
    assert built.counters == {
        "vllm:prompt_tokens": WARMUP_PROMPT_TOKENS,
        "vllm:generation_tokens": WARMUP_REQUESTS * WARMUP_MAX_TOKENS,
        "vllm:request_success": WARMUP_REQUESTS,
    }
    assert WARMUP_PROMPT_TOKENS >= 100
    assert built.free_blocks == 64 - 1  # all but the null block
    assert built.hashed_blocks == 0  # the prefix cache was emptied


def _run_to_completion(engine: LLMEngine) -> dict[str, list[int]]:
    finished: dict[str, list[int]] = {}
    for _ in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            return finished
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
    pytest.fail(f"engine still busy after {MAX_STEPS} steps")


@pytest.mark.engine
def test_in_process_engine_generates_for_text_and_token_id_prompts(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    engine.add_request("text", "hello world the quick brown fox", params)
    engine.add_request("ids", TokensPrompt(prompt_token_ids=[5, 6, 7, 8, 9]), params)

    finished = _run_to_completion(engine)

    assert finished.keys() == {"text", "ids"}
    assert all(len(ids) == MAX_TOKENS for ids in finished.values())
    pool = scheduler_of(engine).kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == len(pool.blocks) - 1  # all but the null block


@pytest.mark.engine
def test_scheduler_of_reaches_the_engines_own_pool(engine: LLMEngine) -> None:
    assert len(scheduler_of(engine).kv_cache_manager.block_pool.blocks) == 64


def _server_counters(base_url: str) -> dict[str, float]:
    """A few of vLLM's own counters from the server's /metrics, summed over their labels."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {"vllm:prompt_tokens_total", "vllm:request_success_total",
              "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"}
    totals = dict.fromkeys(wanted, 0.0)
    text = httpx.get(f"{base_url}/metrics", timeout=30.0).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                totals[sample.name] += sample.value
    return totals


@pytest.mark.server
@pytest.mark.timeout(300)
def test_server_process_answers_a_completion_and_stops_its_process_group(
    model_root: Path, tmp_path: Path
) -> None:
    spec = EngineSpec(make_tiny_model(model_root))
    with ServerProcess(spec, log_path=tmp_path / "server.log",
                       env={"KVGUARD_RUN_DIR": str(tmp_path / "run")}) as server:
        group = server.pid
        # vLLM's own counters: the long warm-up was the server's first request, and its
        # full prompt blocks are cached (what tests that count cached blocks account for).
        before = _server_counters(server.base_url)
        assert before == {"vllm:prompt_tokens_total": WARMUP_PROMPT_TOKENS,
                          "vllm:request_success_total": WARMUP_REQUESTS,
                          "vllm:prefix_cache_queries_total": WARMUP_PROMPT_TOKENS,
                          "vllm:prefix_cache_hits_total": 0}
        assert warmup_cached_blocks(spec.block_size) == WARMUP_PROMPT_TOKENS // 32 == 4
        response = httpx.post(
            f"{server.base_url}/v1/completions",
            json={
                "model": spec.served_model_name,
                "prompt": "hello world",
                "max_tokens": 8,
                "ignore_eos": True,
            },
            timeout=60.0,
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS
        after = _server_counters(server.base_url)
        assert after["vllm:request_success_total"] == WARMUP_REQUESTS + 1

    assert group is not None and server.pid is None
    with pytest.raises(ProcessLookupError):
        os.killpg(group, 0)


@pytest.mark.server
@pytest.mark.timeout(120)
def test_server_that_cannot_start_raises_with_its_log_tail(tmp_path: Path) -> None:
    server = ServerProcess(EngineSpec(tmp_path / "no-such-model"), log_path=tmp_path / "s.log")
    with pytest.raises(ServerStartError, match="exited with code") as caught:
        server.start()
    assert "no-such-model" in caught.value.log_tail
    assert server.pid is None
