"""Shared fixtures. Tests that drive vLLM import it for real: a missing engine fails loudly."""

from __future__ import annotations

import os

import pytest

# Keep EngineCore in this process so tests can reach the real scheduler and pool.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_PLUGINS", "kvguard")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run tests marked ``kv_connector`` last (stable order otherwise).

    vLLM keeps one worker-side KV connector per process: once an in-process
    engine with a connector exists, a later in-process engine without one fails
    (``kv_connector_metadata is not None`` assertion in vLLM's model runner).
    """
    items.sort(key=lambda item: item.get_closest_marker("kv_connector") is not None)
