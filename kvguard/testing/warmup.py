"""The first request every engine and server the project starts gets: a long prompt.

Why: on Intel Xeon hosts with AMX, the vLLM CPU worker has been seen to die
with SIGILL (exit -4) when the FIRST request after start has a very short
prompt (``"hello world"``), and never when the first one has about 100 tokens
(kvguard off, five times out of five). A likely cause, not proven: the tiny
model runs in bfloat16, for which vLLM's CPU attention picks its AMX kernels,
and only a long first prefill runs code that requests the process's AMX state
before those kernels use it. So every engine
(:func:`~kvguard.testing.engine.build_engine`) and every server
(:class:`~kvguard.testing.engine.ServerProcess`) runs :data:`WARMUP_PROMPT_TOKENS`
tokens through the model before the caller's first request.

What the warm-up leaves behind, for tests that count:

- an in-process engine (:func:`warm_up_engine`): nothing in the pool. The
  request runs to completion and the prefix cache is reset, so every usable
  block is free and unhashed. kvguard, when attached, saw one finished request
  (``WARMUP_REQUESTS``) and took its first drained checkpoint on it (clean);
- a server (:func:`warm_up_server`): one finished request in vLLM's and
  kvguard's counters, and :func:`warmup_cached_blocks` full prompt blocks
  cached (ref count 0, evictable: a server has no public prefix-cache reset).

The prompt is token ids, not text, so nothing depends on a tokenizer and no
test prompt shares a full block with it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Final

from kvguard.errors import KvguardError

if TYPE_CHECKING:
    from vllm.v1.engine.llm_engine import LLMEngine

WARMUP_PROMPT_TOKENS: Final = 128
"""Prompt length of the warm-up request, in tokens (about 100 are enough; 128 fill 4
blocks of 32 exactly)."""

WARMUP_MAX_TOKENS: Final = 2
"""Tokens the warm-up request generates: the decode path runs once too."""

WARMUP_REQUESTS: Final = 1
"""Requests the warm-up adds to every counter (vLLM's and kvguard's)."""

WARMUP_REQUEST_ID: Final = "kvguard-warmup"
"""Request id of the in-process warm-up (servers name their own)."""

WARMUP_TOKEN_IDS: Final = tuple(range(4, 4 + WARMUP_PROMPT_TOKENS))
"""The warm-up prompt: ids 4..131, after the tiny model's special tokens (0-3) and inside
its 512-token vocabulary; no other prompt of the project starts this way."""

_MAX_STEPS: Final = 200
"""Engine steps the in-process warm-up may take (it needs about three)."""


class WarmupError(KvguardError, RuntimeError):
    """The warm-up request did not complete: the engine or server is not usable."""


def warmup_cached_blocks(block_size: int) -> int:
    """Full blocks of the warm-up prompt, i.e. the blocks it leaves cached on a server."""
    return WARMUP_PROMPT_TOKENS // block_size


def warm_up_engine(engine: LLMEngine) -> None:
    """Run the warm-up request through an in-process engine, then empty the prefix cache.

    Raises :class:`WarmupError` if the request has not finished and freed its
    blocks (the prefix cache reset needs every block free) within a few steps.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine.add_request(WARMUP_REQUEST_ID, TokensPrompt(prompt_token_ids=list(WARMUP_TOKEN_IDS)),
                       SamplingParams(max_tokens=WARMUP_MAX_TOKENS, ignore_eos=True,
                                      temperature=0.0))
    for _ in range(_MAX_STEPS):
        # A KV connector may delay the free past the finish: step until the reset succeeds.
        if not engine.has_unfinished_requests() and engine.reset_prefix_cache():
            return
        engine.step()
    raise WarmupError(f"the warm-up request did not finish and free its blocks in {_MAX_STEPS} "
                      "engine steps (is a KV connector holding them?)")


DATA_PARALLEL_RANK_HEADER: Final = "X-data-parallel-rank"
"""vLLM's OpenAI server sends a request with this header to that data-parallel rank."""


def warm_up_server(base_url: str, model: str, *, timeout_seconds: float = 120.0,
                   data_parallel_ranks: int = 1) -> None:
    """Send the warm-up request to an OpenAI-compatible server and wait for its answer;
    to each rank of a data-parallel server (``data_parallel_ranks`` > 1: every engine core
    has its own worker, and each one's first request must be the long one).

    Raises :class:`WarmupError` when the server does not answer 200 with
    :data:`WARMUP_MAX_TOKENS` generated tokens within ``timeout_seconds``.
    """
    body = json.dumps({"model": model, "prompt": list(WARMUP_TOKEN_IDS),
                       "max_tokens": WARMUP_MAX_TOKENS, "ignore_eos": True,
                       "temperature": 0.0}).encode()
    for rank in range(data_parallel_ranks):
        headers = {"Content-Type": "application/json"}
        if data_parallel_ranks > 1:
            headers[DATA_PARALLEL_RANK_HEADER] = str(rank)
        _warm_up_one(urllib.request.Request(f"{base_url}/v1/completions", data=body,
                                            headers=headers), base_url, timeout_seconds)


def _warm_up_one(req: urllib.request.Request, base_url: str, timeout_seconds: float) -> None:
    try:
        with urllib.request.urlopen(req, timeout=timeout_seconds) as response:
            answer = json.loads(response.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as exc:
        raise WarmupError(f"the warm-up request to {base_url} failed: {exc}") from exc
    generated = answer.get("usage", {}).get("completion_tokens")
    if generated != WARMUP_MAX_TOKENS:
        raise WarmupError(f"the warm-up request to {base_url} generated {generated!r} tokens, "
                          f"expected {WARMUP_MAX_TOKENS}")
