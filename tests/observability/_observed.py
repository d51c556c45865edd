"""The two engines the observability tests scrape, and vLLM's own numbers about them.

Ground truth for those tests comes from here: each vLLM server's own ``/metrics``, never
kvguard's counters.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

LEAKING = "dp0"
"""kvguard's engine label of the server with injected faults."""
SATURATED = "sat"
"""kvguard's engine label of the healthy server whose prefix cache is full."""


@dataclass(frozen=True)
class ObservedEngine:
    """One real vLLM server with kvguard, and the real sidecar reading its run dir."""

    name: str
    """kvguard's ``engine`` label."""
    vllm_url: str
    """The vLLM server; its ``/metrics`` is vLLM's own view (ground truth)."""
    sidecar_metrics_url: str
    run_dir: Path


@dataclass(frozen=True)
class SaturatedEngine(ObservedEngine):
    cached_blocks_truth: int
    """Blocks vLLM served from its prefix cache when every fill prompt was sent again
    (``vllm:prefix_cache_hits`` in tokens / block size): the blocks cached at idle."""


def vllm_samples(vllm_url: str, sample_name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample called ``sample_name`` on a vLLM server's own ``/metrics``."""
    with urllib.request.urlopen(vllm_url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return [(s.labels, s.value) for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == sample_name]


def vllm_value(vllm_url: str, sample_name: str) -> float:
    """The one sample ``sample_name`` of a single-engine vLLM server."""
    samples = vllm_samples(vllm_url, sample_name)
    assert len(samples) == 1, (sample_name, samples)
    return samples[0][1]


def vllm_capacity_blocks(vllm_url: str) -> int:
    """Usable KV blocks by vLLM's own config: ``num_gpu_blocks`` minus the null block."""
    [(labels, _)] = vllm_samples(vllm_url, "vllm:cache_config_info")
    return int(labels["num_gpu_blocks"]) - 1
