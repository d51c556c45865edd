"""The two engines the observability tests scrape, and vLLM's own numbers about them.

Both are data-parallel ranks of one vLLM server. Ground truth for those tests comes from
here: that server's own ``/metrics``, per rank (vLLM's ``engine`` label), never kvguard's
counters.
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ENGINE_NAME = "obs"
"""``KVGUARD_ENGINE_NAME`` of the server; each rank adds ``-dp<rank>``."""
DATA_PARALLEL_SIZE = 2
SATURATED_RANK = 0
LEAKING_RANK = 1
LEAKING = f"{ENGINE_NAME}-dp{LEAKING_RANK}"
"""kvguard's engine label of the rank with injected faults."""
SATURATED = f"{ENGINE_NAME}-dp{SATURATED_RANK}"
"""kvguard's engine label of the healthy rank whose prefix cache is full."""


@dataclass(frozen=True)
class ObservedEngine:
    """One real vLLM server with kvguard, and the real sidecar reading its run dir."""

    name: str
    """kvguard's ``engine`` label."""
    vllm_url: str
    """The vLLM server; its ``/metrics`` is vLLM's own view (ground truth)."""
    vllm_engine: str
    """vLLM's ``engine`` label of this rank on that ``/metrics`` (``"0"``, ``"1"``)."""
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


def _of_rank(vllm_url: str, sample_name: str,
             rank: int | str) -> list[tuple[dict[str, str], float]]:
    samples = vllm_samples(vllm_url, sample_name)
    return [(labels, v) for labels, v in samples if labels.get("engine") == str(rank)]


def vllm_value(vllm_url: str, sample_name: str, rank: int | str) -> float:
    """The one sample ``sample_name`` of data-parallel rank ``rank`` (vLLM's ``engine``
    label)."""
    samples = _of_rank(vllm_url, sample_name, rank)
    assert len(samples) == 1, (sample_name, rank, vllm_samples(vllm_url, sample_name))
    return samples[0][1]


def vllm_capacity_blocks(vllm_url: str, rank: int | str) -> int:
    """Usable KV blocks of rank ``rank`` by vLLM's own config: its ``num_gpu_blocks`` minus
    the null block.

    vLLM's API server sums ``num_gpu_blocks`` over the ranks' start-up handshakes (its
    ``core_client``) and reports that sum under every rank's ``engine`` label. The ranks
    here are alike (one ``num_gpu_blocks_override``), so each has an equal share.
    """
    [(labels, _)] = _of_rank(vllm_url, "vllm:cache_config_info", rank)
    total = int(labels["num_gpu_blocks"])
    assert total % DATA_PARALLEL_SIZE == 0, total
    return total // DATA_PARALLEL_SIZE - 1


def vllm_blocks_in_use(engine: ObservedEngine) -> int:
    """Blocks with a reference by vLLM's own numbers for this rank:
    ``kv_cache_usage_perc`` x capacity. At idle no request runs, so every one of them is
    lost to the pool (a leak)."""
    used = vllm_value(engine.vllm_url, "vllm:kv_cache_usage_perc", engine.vllm_engine) \
        * vllm_capacity_blocks(engine.vllm_url, engine.vllm_engine)
    assert abs(used - round(used)) < 1e-6, used
    return round(used)
