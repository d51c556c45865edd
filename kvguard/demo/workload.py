"""A bounded client workload against an OpenAI-compatible vLLM server.

Streams with a shared prefix (they fill the prefix cache), and streams the
client abandons mid-way (vLLM aborts the request when the client
disconnects). Prompts are plain words; nothing here is ever logged.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from kvguard.demo.tiny_model import WORDS

SHARED_PREFIX_WORDS = 70
"""Words shared by every prefix-phase prompt: two full 32-token KV blocks and then some."""


@dataclass(slots=True)
class WorkloadResult:
    completed: int = 0
    disconnected: int = 0
    failed: int = 0


def _words(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 131 + i * 17) % len(WORDS)] for i in range(n))


def hang_up_completion(base_url: str, model: str, prompt: str, max_tokens: int,
                       *, after_seconds: float) -> bool:
    """Ask for a long completion and hang up after ``after_seconds``; False if we hung up.

    vLLM notices the closed connection and aborts the request (its ``with_cancellation``
    handler wrapper), which is the client-cancellation path of a real deployment.
    """
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0}
    try:
        with httpx.Client(base_url=base_url, timeout=httpx.Timeout(10.0, read=after_seconds)) \
                as client:
            client.post("/v1/completions", json=body).raise_for_status()
    except httpx.ReadTimeout:
        return False
    return True


def stream_completion(base_url: str, model: str, prompt: str, max_tokens: int,
                      *, disconnect_after_chunks: int | None, timeout: float = 60.0) -> bool:
    """Stream one completion; return True if it ran to the end, False if we hung up."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0}
    with httpx.Client(base_url=base_url, timeout=timeout) as client, \
            client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        chunks = 0
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            if line.strip() == "data: [DONE]":
                return True
            chunks += 1
            if disconnect_after_chunks is not None and chunks >= disconnect_after_chunks:
                return False  # leaving the with-block closes the connection mid-stream
    return True


def run_workload(
    base_url: str,
    model: str,
    *,
    shared_prefix_streams: int = 12,
    disconnecting_streams: int = 6,
    concurrency: int = 4,
    progress: Callable[[str, int, int], None] | None = None,
) -> WorkloadResult:
    """Run both phases; ``progress(phase, done, total)`` is called after each request."""
    result = WorkloadResult()
    lock = threading.Lock()
    prefix = _words(1, SHARED_PREFIX_WORDS)

    def phase(name: str, jobs: list[tuple[str, int, int | None]]) -> None:
        done = 0

        def one(job: tuple[str, int, int | None]) -> None:
            nonlocal done
            prompt, max_tokens, cut = job
            try:
                if cut is None:
                    finished = stream_completion(base_url, model, prompt, max_tokens,
                                                 disconnect_after_chunks=None)
                else:
                    finished = hang_up_completion(base_url, model, prompt, max_tokens,
                                                  after_seconds=cut / 10)
                with lock:
                    if finished:
                        result.completed += 1
                    else:
                        result.disconnected += 1
            except httpx.HTTPError:
                with lock:
                    result.failed += 1
            with lock:
                done += 1
                if progress is not None:
                    progress(name, done, len(jobs))

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            list(pool.map(one, jobs))

    phase("shared-prefix streams", [
        (f"{prefix} {_words(100 + i, 8)}", 16, None) for i in range(shared_prefix_streams)
    ])
    phase("clients hanging up mid-generation", [
        (_words(200 + i, 40), 460, 3) for i in range(disconnecting_streams)
    ])
    return result
