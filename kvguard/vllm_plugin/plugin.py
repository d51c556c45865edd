"""The ``vllm.general_plugins`` entry point: ``kvguard = kvguard.vllm_plugin.plugin:register``.

vLLM calls ``register()`` in every process it starts (API server, EngineCore,
workers), in EngineCore before the scheduler is built and in each worker before the
worker is built. ``register`` patches ``Scheduler.__init__`` once so that each
scheduler built afterwards gets an ``EngineGuard`` and its hooks, and
``KVConnectorFactory.create_connector`` so that each worker-side NIXL connector gets
kvguard's worker half (:mod:`kvguard.vllm_plugin.worker_half`), wherever the worker
runs; in processes that build neither it costs nothing. Enable with
``VLLM_PLUGINS=kvguard`` (or leave ``VLLM_PLUGINS`` unset, which loads every installed
plugin); disable with ``KVGUARD_ENABLED=0``.

Nothing here may stop the engine: a bad setting or an unexpected vLLM
version logs one error and leaves the engine running without kvguard.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from kvguard.config import KvguardConfig

log = logging.getLogger("kvguard")

_PATCHED = "__kvguard_patched__"


def register() -> None:
    """Entry point. Idempotent."""
    _ensure_log_handler()
    try:
        config = KvguardConfig.from_env()
        if not config.enabled:
            log.info("kvguard disabled (KVGUARD_ENABLED=0)")
            return
        from vllm.v1.core.sched.scheduler import Scheduler
    except Exception as exc:
        log.error("kvguard is OFF for this process: %s", exc)
        return
    try:
        from kvguard.vllm_plugin.worker_half import install_worker_half
        install_worker_half()
    except Exception as exc:  # P/D holds then fall back to the configured bound
        log.error("kvguard's worker half is OFF for this process: %s", exc)
    if getattr(Scheduler, _PATCHED, False):
        return
    original_init = Scheduler.__init__

    @functools.wraps(original_init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        attach(self)  # settings are read per engine, when its scheduler is built

    Scheduler.__init__ = __init__  # type: ignore[method-assign]
    setattr(Scheduler, _PATCHED, True)


def _ensure_log_handler() -> None:
    """vLLM's processes configure only vLLM's loggers: give kvguard's one, once.

    Without it, kvguard's lines in EngineCore come out bare (warnings only, no time
    or process) and its INFO lines are dropped.
    """
    logger = logging.getLogger("kvguard")
    if logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(
        "(kvguard pid=%(process)d) %(levelname)s %(asctime)s %(message)s", "%m-%d %H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def attach(scheduler: Any, config: KvguardConfig | None = None) -> Any:
    """Attach a guard to one scheduler (also usable without the entry point). Never raises.

    Returns the guard, or None when kvguard is disabled (``config.enabled`` false) or
    could not attach; the engine then runs exactly as without kvguard.
    """
    from kvguard.vllm_plugin.guard import EngineGuard, guard_of
    from kvguard.vllm_plugin.hooks import install_hooks
    from kvguard.vllm_plugin.idle import bind_idle_wakeups
    from kvguard.vllm_plugin.kv_event_tap import maybe_tap_kv_events

    existing = guard_of(scheduler)
    if existing is not None:
        return existing
    try:
        config = config or KvguardConfig.from_env()
        if not config.enabled:
            # register() already patched Scheduler in this process; an engine built
            # later with KVGUARD_ENABLED=0 must still get nothing at all.
            log.info("kvguard disabled for this engine (KVGUARD_ENABLED=0)")
            return None
        guard = EngineGuard(scheduler, config)
        if config.faults and not hasattr(scheduler, "faults_enabled"):
            log.warning("KVGUARD_FAULTS is set but this engine's scheduler injects no faults: "
                        "faults need --scheduler-cls %s (tests and staging only)",
                        "kvguard.chaos.faults.scheduler.ChaosScheduler")
        install_hooks(guard)
        guard.kv_events = maybe_tap_kv_events(scheduler, max_keys=config.kv_events_max_keys)
        scheduler._kvguard = guard
        bind_idle_wakeups()  # multiprocess EngineCore: its busy loop starts after this
        log.info("kvguard attached to engine %s (%d hooks, %d missing); state in %s",
                 guard.engine, len(guard.hooks_installed), len(guard.hooks_missing),
                 guard.publisher.path)
        guard.publish()
        return guard
    except Exception as exc:
        log.error("kvguard could not attach to this engine and is OFF for it: %s", exc,
                  exc_info=exc)
        return None
