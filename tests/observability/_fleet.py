"""The watched fleet of the self-monitoring tests (``conftest.watched_fleet``): its pods, and
the handle the tests get."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from _obs_contract import PrometheusServer

FLEET_NAMESPACE = "llm"
WATCHED_POD = "vllm-kvguard-a"
"""The data-parallel server's pod: vLLM with kvguard, and a sidecar of its own."""
UNWATCHED_POD = "vllm-plain-b"
"""A vLLM server started with a VLLM_PLUGINS typo: kvguard is installed but not loaded."""
PLUGINS_TYPO = "kvgaurd"
SELF_RULE_FOR = "2s"
"""The ``for`` of the kvguard-self alerts in the test rule file (shipped: 5m and 15m)."""


@dataclass
class WatchedFleet:
    """Prometheus configured by the shipped scrape config (its relabel rules unchanged),
    scraping two pods: the data-parallel server with a sidecar of its own, and a vLLM
    server with no kvguard loaded."""

    prometheus: PrometheusServer
    sidecar: subprocess.Popen[bytes]
    sidecar_netloc: str
    watched_vllm_url: str
    unwatched_vllm_url: str
    unwatched_run_dir: Path

    def kill_sidecar(self) -> None:
        """SIGKILL: the way a sidecar dies of an OOM kill, with no goodbye."""
        self.sidecar.kill()
        self.sidecar.wait(timeout=10)
