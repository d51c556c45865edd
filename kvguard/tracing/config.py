"""Where kvguard's spans go, decided the way vLLM decides for its own.

The endpoint is vLLM's ``--otlp-traces-endpoint`` (``ObservabilityConfig.otlp_traces_endpoint``)
when set, else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``, else ``OTEL_EXPORTER_OTLP_ENDPOINT``
(to which the HTTP exporter appends ``/v1/traces``, per the OpenTelemetry spec). None of
them set: tracing is off and costs nothing. The protocol is
``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (or ``OTEL_EXPORTER_OTLP_PROTOCOL``), by default
``grpc`` as in vLLM, so that one endpoint serves vLLM's spans and kvguard's;
``http/protobuf`` uses OTLP over HTTP. ``OTEL_SDK_DISABLED=true`` turns it off.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from kvguard.errors import ConfigError

TRACES_ENDPOINT: Final = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENDPOINT: Final = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES_PROTOCOL: Final = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
PROTOCOL: Final = "OTEL_EXPORTER_OTLP_PROTOCOL"
SERVICE_NAME: Final = "OTEL_SERVICE_NAME"
SDK_DISABLED: Final = "OTEL_SDK_DISABLED"
PROTOCOLS: Final = ("grpc", "http/protobuf")
DEFAULT_PROTOCOL: Final = "grpc"
"""vLLM's default (``vllm/tracing/otel.py``)."""


@dataclass(frozen=True, slots=True)
class TracingSettings:
    """How to export. ``endpoint`` None: the exporter reads ``OTEL_EXPORTER_OTLP_ENDPOINT``
    itself (and appends the signal path for HTTP)."""

    endpoint: str | None
    protocol: str
    service_name: str

    @property
    def where(self) -> str:
        """The endpoint in words, for the state and the log."""
        return self.endpoint or f"{os.environ.get(ENDPOINT, '?')} ({ENDPOINT})"


def tracing_settings(vllm_endpoint: str | None, env: Mapping[str, str] | None = None,
                     *, default_service_name: str = "kvguard") -> TracingSettings | None:
    """The settings for an engine whose own tracing endpoint is ``vllm_endpoint``, or None
    when tracing is off. Raises :class:`ConfigError` for a protocol neither exporter speaks."""
    env = os.environ if env is None else env
    if env.get(SDK_DISABLED, "").strip().lower() == "true":
        return None
    endpoint = (vllm_endpoint or env.get(TRACES_ENDPOINT) or "").strip() or None
    if endpoint is None and not env.get(ENDPOINT, "").strip():
        return None
    protocol = (env.get(TRACES_PROTOCOL) or env.get(PROTOCOL) or DEFAULT_PROTOCOL).strip()
    if protocol not in PROTOCOLS:
        raise ConfigError(TRACES_PROTOCOL, protocol, " or ".join(PROTOCOLS))
    service = (env.get(SERVICE_NAME) or "").strip() or default_service_name
    return TracingSettings(endpoint, protocol, service)
