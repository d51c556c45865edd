"""A bounded client workload against an OpenAI-compatible vLLM server.

Streams with a shared prefix (they fill the prefix cache), and streams the
client abandons mid-way (vLLM aborts the request when the client
disconnects). Prompts are plain words; nothing here is ever logged.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from kvguard.testing.tiny_model import WORDS
from kvguard.testing.warmup import DATA_PARALLEL_RANK_HEADER

SHARED_PREFIX_WORDS = 70
"""Words shared by every prefix-phase prompt: two full 32-token KV blocks and then some."""


@dataclass(slots=True)
class WorkloadResult:
    completed: int = 0
    disconnected: int = 0
    failed: int = 0


def rank_headers(data_parallel_rank: int | None) -> dict[str, str]:
    """The headers that pin a request to one data-parallel rank (none: vLLM balances)."""
    return {} if data_parallel_rank is None else {
        DATA_PARALLEL_RANK_HEADER: str(data_parallel_rank)}


def _words(seed: int, n: int) -> str:
    return " ".join(WORDS[(seed * 131 + i * 17) % len(WORDS)] for i in range(n))


def cancel_mid_stream(base_url: str, model: str, prompt: str, max_tokens: int,
                      *, timeout: float = 60.0, data_parallel_rank: int | None = None) -> bool:
    """Stream a long completion and cancel it: through vLLM's abort API after one chunk
    (asked again after 16), then by hanging up after 48 if the stream still goes on.

    ``POST /inference/v1/abort_requests`` (served with ``--enable-scale-out``) takes the
    engine-client request id: the completion id plus the prompt index (``cmpl-...-0``).
    vLLM 0.32 runs that abort as a fire-and-forget ``asyncio.create_task`` whose task
    nothing references, so on a loaded host the abort can be lost (garbage-collected
    before it runs); the stream then goes on. Hanging up is the second way: vLLM
    notices the disconnect at its next write and aborts the request the same way.
    Returns False when the stream ended early (cancelled).
    """
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0}
    chunks = 0
    with httpx.Client(base_url=base_url, timeout=timeout,
                      headers=rank_headers(data_parallel_rank)) as client, \
            client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunks += 1
            if chunks in _ABORT_AT_CHUNKS:
                rid = json.loads(line[5:])["id"]
                client.post("/inference/v1/abort_requests",
                            json={"request_ids": [f"{rid}-0"]}).raise_for_status()
            elif chunks >= _HANG_UP_AT_CHUNK:
                return False  # leaving the block closes the connection: a disconnect
    return chunks >= max_tokens


_ABORT_AT_CHUNKS = frozenset({1, 16})
_HANG_UP_AT_CHUNK = 48


def stream_completion(base_url: str, model: str, prompt: str, max_tokens: int,
                      *, disconnect_after_chunks: int | None, timeout: float = 60.0,
                      data_parallel_rank: int | None = None) -> bool:
    """Stream one completion; return True if it ran to the end, False if we hung up."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0.0}
    with httpx.Client(base_url=base_url, timeout=timeout,
                      headers=rank_headers(data_parallel_rank)) as client, \
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
    hangup_max_tokens: int = 460,
    cancelled_streams: int = 0,
    busy_streams: int = 0,
    progress: Callable[[str, int, int], None] | None = None,
    data_parallel_rank: int | None = None,
) -> WorkloadResult:
    """Run both phases; ``progress(phase, done, total)`` is called after each request.

    Disconnecting clients hang up after two streamed chunks of a request for
    ``hangup_max_tokens`` tokens; vLLM notices the closed connection at its next
    write and aborts the request. The tiny model generates a token in about a
    millisecond, so the request must be long enough to still be running then
    (1,900 tokens take about 2.5 s here; a few hundred may finish first).
    ``busy_streams`` long streams run to the end beside the disconnecting and the
    cancelled ones (they should be fewer than ``concurrency``), so the server stays
    busy after each abort: what the online audit is for. ``data_parallel_rank`` sends
    every request to that rank of a data-parallel server.
    """
    result = WorkloadResult()
    lock = threading.Lock()
    prefix = _words(1, SHARED_PREFIX_WORDS)

    def phase(name: str, jobs: list[tuple[str, int, int | None]]) -> None:
        done = 0

        def one(job: tuple[str, int, int | None]) -> None:
            nonlocal done
            prompt, max_tokens, cut = job
            try:
                if cut == 0:
                    finished = cancel_mid_stream(base_url, model, prompt, max_tokens,
                                                 data_parallel_rank=data_parallel_rank)
                else:
                    finished = stream_completion(base_url, model, prompt, max_tokens,
                                                 disconnect_after_chunks=cut,
                                                 data_parallel_rank=data_parallel_rank)
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
    def busy(base: int) -> list[tuple[str, int, int | None]]:
        # First in the list: they take workers first and run while the others are cut.
        return [(_words(base + i, 40), hangup_max_tokens, None) for i in range(busy_streams)]

    phase("clients disconnecting mid-stream", busy(400) + [
        (_words(200 + i, 40), hangup_max_tokens, 2) for i in range(disconnecting_streams)
    ])
    if cancelled_streams:
        phase("streams cancelled via abort API", busy(500) + [
            (_words(300 + i, 40), hangup_max_tokens, 0) for i in range(cancelled_streams)
        ])
    return result
