"""The delayed-free bound comes from the KV connector's own timeout (vLLM's real config class)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from vllm.config.kv_transfer import KVTransferConfig

from kvguard.chaos.harness import EngineHarness
from kvguard.vllm_plugin.connector_bounds import DEFAULT_BOUND_SECONDS, connector_hold_bound


def _cfg(**kw: object) -> SimpleNamespace:
    return SimpleNamespace(kv_transfer_config=KVTransferConfig(kv_role="kv_both", **kw))


def test_no_connector_means_the_default() -> None:
    assert connector_hold_bound(SimpleNamespace(kv_transfer_config=None)).seconds == 30.0
    assert connector_hold_bound(None).seconds == DEFAULT_BOUND_SECONDS


def test_nixl_lease_doubled_for_one_heartbeat_extension() -> None:
    b = connector_hold_bound(_cfg(kv_connector="NixlConnector",
                                  kv_connector_extra_config={"kv_lease_duration": 45}))
    assert b.seconds == 90.0 and "kv_lease_duration 45" in b.source
    assert connector_hold_bound(_cfg(kv_connector="NixlConnector")).seconds == 60.0


def test_mooncake_abort_timeout_from_its_environment_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert connector_hold_bound(_cfg(kv_connector="MooncakeConnector")).seconds == 480.0
    monkeypatch.setenv("VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT", "120")
    assert connector_hold_bound(_cfg(kv_connector="MooncakeConnector")).seconds == 120.0


def test_multi_connector_takes_the_longest_part() -> None:
    b = connector_hold_bound(_cfg(kv_connector="MultiConnector", kv_connector_extra_config={
        "connectors": [{"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                       {"kv_connector": "MooncakeConnector", "kv_role": "kv_both"}]}))
    assert b.seconds == 480.0


def test_unknown_connector_and_bad_values_fall_back_to_the_default() -> None:
    assert connector_hold_bound(_cfg(kv_connector="LMCacheConnectorV1")).seconds == 30.0
    b = connector_hold_bound(_cfg(kv_connector="NixlConnector",
                                  kv_connector_extra_config={"kv_lease_duration": "soon"}))
    assert b.seconds == DEFAULT_BOUND_SECONDS


def test_the_engine_uses_the_connector_bound_unless_one_is_configured(engines) -> None:  # type: ignore[no-untyped-def]
    h: EngineHarness = engines()
    assert h.guard.hold_bound.seconds == DEFAULT_BOUND_SECONDS  # no connector
    assert h.guard.delayed_free_bound == DEFAULT_BOUND_SECONDS
    h.guard.config = dataclasses.replace(h.guard.config, delayed_free_bound_seconds=7.0)
    assert h.guard.delayed_free_bound == 7.0
    assert h.guard.online is not None
    assert h.guard.online.opts.delayed_free_bound_seconds == 7.0
