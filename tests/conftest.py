"""Shared fixtures. Tests that drive vLLM import it for real: a missing engine fails loudly."""

from __future__ import annotations

import os

# Keep EngineCore in this process so tests can reach the real scheduler and pool.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_PLUGINS", "kvguard")
