"""kvguard settings: one object, read from ``KVGUARD_*`` environment variables.

Settings are read once, when the plugin installs itself in an engine process
(or when a CLI command starts), never at import time. Every field below has an
environment variable of the same name, upper-cased, with the ``KVGUARD_``
prefix; docs/operator-guide.md lists them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from kvguard.errors import ConfigError

ENV_PREFIX = "KVGUARD_"

ENGINE_NAME_PATTERN = r"^[A-Za-z0-9_.-]{1,128}$"
"""Engine names: the state file is ``<engine>.json`` and the name is a metric label."""


def default_run_dir() -> Path:
    """Where engines publish their state for readers (a shared volume in Kubernetes)."""
    base = os.environ.get("XDG_RUNTIME_DIR") or "/tmp"
    return Path(base) / "kvguard"


@dataclass(frozen=True, slots=True)
class KvguardConfig:
    """Everything kvguard can be told. Times in seconds, ratios in [0, 1]."""

    enabled: bool = True
    """Master switch inside the engine; ``KVGUARD_ENABLED=0`` installs nothing."""
    run_dir: Path = field(default_factory=default_run_dir)
    """Directory for the engine's state file (created owner-only, mode 0700)."""
    engine_name: str | None = None
    """The ``engine`` label. Default: ``dp<data-parallel rank>`` (``dp0``). A data-parallel
    rank adds ``-dp<rank>`` to a configured name (``llama-dp0``, ``llama-dp1``)."""
    delayed_free_bound_seconds: float | None = None
    """How long a finished request may hold blocks while its KV transfer completes.
    Unset: the KV connector's own timeout when vLLM exposes one (NIXL's lease,
    Mooncake's abort timeout), else 30 s."""
    offload_job_bound_seconds: float | None = None
    """How long a job of an offloading KV connector (a store to, or load from, its offload
    tier) may stay in flight before kvguard calls it stuck (``kvguard_offload_stuck_jobs``).
    Unset: the delayed-free bound."""
    wedge_after_seconds: float = 30.0
    """Requests waiting with none admitted for this long (and ``wedge_after_steps`` engine
    steps) while dead owners hold the blocks they need: the engine is named wedged
    (``kvguard_engine_wedged``, the sidecar's ``/v1/ready`` answers 503; docs/wedge.md)."""
    wedge_after_steps: int = 20
    """Engine steps with none admitted, with ``wedge_after_seconds``, before a wedge."""
    reclaim: bool = False
    """Opt-in safety valve, not a fix: free the blocks of a dead owner (a finished request
    whose free never came, a deferred free past its bound) through vLLM's own free path,
    on the engine thread between steps, once ``reclaim_after_verdicts`` consecutive wedge
    verdicts named it. Orphans and ref-count drift (owner unknown) are never reclaimed
    (docs/wedge.md)."""
    reclaim_after_verdicts: int = 3
    """Consecutive wedge verdicts (at least 0.5 s apart) that must name the same dead
    owner before it is reclaimed: 3 spans at least 1 s and several engine steps beyond the
    first verdict, so one reading taken mid-transition (a completion arriving in the same
    step, a hook error the next rebuild repairs) never frees anything, while recovery
    comes about 1 s after the wedge is named."""
    saturation_ratio: float = 0.8
    """Cached share of capacity at which a clean pool is reported ``saturated``."""
    checkpoint_min_interval_seconds: float = 0.0
    """0 (the default): every drain is audited. Above 0, drained audits are paced: after
    ``checkpoint_burst`` in a row, at most one per this interval; a drain in between is
    audited at the next drain or admission the pace allows (:mod:`kvguard.core.pacing`)."""
    checkpoint_burst: int = 4
    """Drained audits allowed in a row before the interval applies (token bucket size)."""
    idle_recheck_seconds: float = 3600.0
    """An engine that stays idle is audited again this long after its last drained
    checkpoint (then again after as long), so its verdict stays current with no traffic
    (0: never; an idle engine is then judged only at the drain that made it idle)."""
    publish_interval_seconds: float = 1.0
    """Live counters are handed to the publisher at most this often."""
    history: int = 64
    """Checkpoint reports kept in the engine's state file."""
    faults: str = ""
    """Fault injection for tests and staging only, e.g. ``skip_free_on_abort=1``; takes
    effect only in an engine run with ``--scheduler-cls
    kvguard.chaos.faults.scheduler.ChaosScheduler`` (read there, never by kvguard's hooks)."""
    allow_faults: bool = False
    """Second key for ``faults``: both must be set, or faults stay off."""
    control_token: str | None = None
    """Token the sidecar requires on control endpoints (``KVGUARD_CONTROL_TOKEN``)."""
    sidecar_host: str = "127.0.0.1"
    """Sidecar bind address. Loopback by default; a pod sets its own on purpose."""
    sidecar_port: int = 9400
    sidecar_uds: str | None = None
    """Serve on this Unix socket (mode 0600) instead of TCP."""
    attribution: bool = True
    """Memory attribution (allocator, device, host) at drained checkpoints."""
    attribution_warmup_checkpoints: int = 1
    """Drained checkpoints treated as warm-up; the next one is the attribution baseline."""
    attribution_min_bytes: int = 32 << 20
    """Smallest growth since the baseline, in bytes, that attribution reports as movement."""
    empty_cache_at_checkpoint: bool = False
    """Return allocator cache (``gc.collect`` + ``empty_cache``) at drained checkpoints only."""
    settle_seconds: float = 0.5
    """Wait after that cache return before reading process-level numbers (no return: no wait)."""
    online_audit: bool = True
    """Audit ownership between engine steps under load, without waiting for a drain."""
    online_budget_fraction: float = 0.005
    """Audit time per second of scheduler time (0.005: 0.5 %); sets how fast a sweep covers
    the pool."""
    online_max_pause_seconds: float = 0.002
    """Most audit time at one step boundary (an idle gap never buys a longer pause)."""
    cost_sample_every_steps: int = 512
    """kvguard meters its own time on the engine thread in one window of 8 steps per this
    many steps (``kvguard_cost_*`` metrics; 0: off). The other steps run hooks with no
    clock in them."""
    kv_events_watch: bool = True
    """The sidecar follows the KV events of every engine that publishes them
    (``--kv-events-config``) and checks its mirror against the pool (``kvguard_kv_events_*``)."""
    kv_events_max_keys: int = 4096
    """The KV-event mirror check: an engine whose pool holds at most this many hashed blocks
    publishes their keys (hashes) at drained checkpoints, so the first differing blocks can be
    named; above it, only their count and digest (differences are then counted, not named)."""
    snapshot_dir: Path | None = None
    """Where a checkpoint that finds tensor growth writes a PyTorch memory snapshot (CUDA)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> KvguardConfig:
        """Read ``KVGUARD_*`` variables; ``overrides`` win. Raises ``ConfigError`` on bad values."""
        env = os.environ if env is None else env
        values: dict[str, object] = {}
        for f in fields(cls):
            key = ENV_PREFIX + f.name.upper()
            if key in env:
                values[f.name] = _parse(key, env[key], f.type)
        values.update(overrides)
        cfg = cls(**values)  # type: ignore[arg-type]
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        if not 0.0 < self.saturation_ratio <= 1.0:
            raise ConfigError("KVGUARD_SATURATION_RATIO", self.saturation_ratio,
                              "a ratio in (0, 1]")
        for name in ("delayed_free_bound_seconds", "offload_job_bound_seconds",
                     "checkpoint_min_interval_seconds",
                     "publish_interval_seconds", "online_max_pause_seconds",
                     "idle_recheck_seconds", "wedge_after_seconds"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(ENV_PREFIX + name.upper(), getattr(self, name), "seconds >= 0")
        if not 0.0 < self.online_budget_fraction <= 0.5:
            raise ConfigError("KVGUARD_ONLINE_BUDGET_FRACTION", self.online_budget_fraction,
                              "a fraction of scheduler time in (0, 0.5], e.g. 0.005")
        if self.wedge_after_steps < 1:
            raise ConfigError("KVGUARD_WEDGE_AFTER_STEPS", self.wedge_after_steps,
                              "an integer >= 1")
        if self.reclaim_after_verdicts < 1:
            raise ConfigError("KVGUARD_RECLAIM_AFTER_VERDICTS", self.reclaim_after_verdicts,
                              "an integer >= 1 (consecutive wedge verdicts, e.g. 3)")
        if self.checkpoint_burst < 1:
            raise ConfigError("KVGUARD_CHECKPOINT_BURST", self.checkpoint_burst,
                              "an integer >= 1")
        if self.cost_sample_every_steps < 0:
            raise ConfigError("KVGUARD_COST_SAMPLE_EVERY_STEPS", self.cost_sample_every_steps,
                              "a number of engine steps >= 0 (0 turns the meter off)")
        if self.kv_events_max_keys < 0:
            raise ConfigError("KVGUARD_KV_EVENTS_MAX_KEYS", self.kv_events_max_keys,
                              "a number of block keys >= 0 (0: publish only count and digest)")
        if self.history < 1:
            raise ConfigError("KVGUARD_HISTORY", self.history, "an integer >= 1")
        if self.engine_name is not None and not re.match(ENGINE_NAME_PATTERN, self.engine_name):
            raise ConfigError("KVGUARD_ENGINE_NAME", self.engine_name,
                              "1-128 characters from A-Z a-z 0-9 _ . -")
        for name in ("attribution_warmup_checkpoints", "attribution_min_bytes",
                     "settle_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(ENV_PREFIX + name.upper(), getattr(self, name), "a value >= 0")


def _parse(key: str, raw: str, typ: object) -> object:
    t = str(typ)
    try:
        if "bool" in t:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if "float" in t:
            return float(raw)
        if "int" in t:
            return int(raw)
        if "Path" in t:
            return Path(raw)
    except ValueError:
        raise ConfigError(key, raw, f"a value of type {t}") from None
    return raw if raw or "None" not in t else None
