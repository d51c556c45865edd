"""The demo fixtures drive a real vLLM: the tiny model dir, the in-process engine, the server.

These tests need vLLM (``pip install -e .[engine]``); without it they fail, on purpose.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.v1.engine.llm_engine import LLMEngine

from kvguard.demo.engine import (
    EngineSpec,
    ServerProcess,
    ServerStartError,
    build_engine,
    scheduler_of,
    shutdown_engine,
)
from kvguard.demo.tiny_model import VOCAB_SIZE, make_draft_model, make_tiny_model
from kvguard.errors import ConfigError

MAX_TOKENS = 8
MAX_STEPS = 200


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def engine(model_root: Path) -> Iterator[LLMEngine]:
    built = build_engine(EngineSpec(make_tiny_model(model_root)))
    yield built
    shutdown_engine(built)


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


@pytest.mark.server
@pytest.mark.timeout(300)
def test_server_process_answers_a_completion_and_stops_its_process_group(
    model_root: Path, tmp_path: Path
) -> None:
    spec = EngineSpec(make_tiny_model(model_root))
    with ServerProcess(spec, log_path=tmp_path / "server.log") as server:
        group = server.pid
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
