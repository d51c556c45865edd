"""kvguard's exceptions.

One root, two branches, so callers can tell "you asked for something wrong"
from "kvguard found its own state broken"::

    KvguardError
    ├── ConfigError          caller error: a bad setting or argument; fix the input
    ├── TransportError       the engine <-> reader channel cannot be used
    │   └── ProtocolError    a message is malformed or from an incompatible version
    └── CorruptStateError    kvguard's own bookkeeping contradicts itself (a kvguard bug)

Nothing kvguard raises inside engine hooks ever reaches the engine: hook code
catches ``Exception``, counts it and goes on (see ``kvguard.vllm_plugin.guard``).
"""

from __future__ import annotations


class KvguardError(Exception):
    """Root of every exception kvguard raises on purpose."""


class ConfigError(KvguardError, ValueError):
    """A setting or argument is invalid. The message names it and the accepted values."""

    def __init__(self, setting: str, value: object, expected: str) -> None:
        self.setting = setting
        self.value = value
        self.expected = expected
        super().__init__(f"{setting}={value!r} is invalid: expected {expected}")


class TransportError(KvguardError):
    """The local transport between the engine and a reader cannot be used."""


class ProtocolError(TransportError):
    """A transport message is malformed, truncated, or from another kvguard version."""


class CorruptStateError(KvguardError):
    """kvguard's own records contradict themselves; report it as a kvguard bug."""
