"""Wrap the vLLM methods where blocks move and where requests change phase.

Hook points (vLLM v1, 0.32-0.34; per release in :mod:`kvguard.vllm_plugin.versions`), all
installed per instance (the class is left alone):

===============================================  =============================================
``BlockPool.get_new_blocks``                     blocks allocated (unattributed until claimed)
``BlockPool.touch``                              prefix-cache hit: a reference on a cached block
``BlockPool.free_blocks`` / ``unpin_blocks``     references released
``Scheduler.add_request``                        admit (first: a drained audit still due)
``Scheduler._preempt_request``                   preempt (the request's blocks are freed)
``Scheduler._free_request``                      finish with reason; connector may delay the free
``Scheduler._free_request_blocks``               the free itself, possibly deferred
``Scheduler._free_blocks``                       the request is done (delayed free ends here)
``Scheduler.finish_requests``                    abort/cancel from outside: a drain may follow
``Scheduler.update_from_output``                 end of a step: a drain may follow; online audit
``Scheduler.schedule``                           timed (the online audit's budget basis); the
                                                 batch is in flight until its update
``<Coordinator>.remove_skipped_blocks``          sliding-window frees, charged to their request
===============================================  =============================================

Only ``schedule`` and ``update_from_output`` run on every step; the pool hooks run when blocks
actually move (about once per ``block_size`` tokens per request). Request ids
for acquisitions are not known at the pool level; the ledger records them as
unattributed and claims them from the engine's own block tables at the next
lifecycle transition or audit. Each hook body is wrapped in ``try``/``except``:
a failure is counted and the engine's call proceeds unchanged. A method that
this vLLM version lacks is listed in ``hooks_missing`` as ``<label> (off: <feature>)``
(the feature from :mod:`kvguard.vllm_plugin.versions`) with one warning, and the engine
runs on with its own method. Its feature is switched off, not only named: without one
pool hook none is installed, and the session is told which events it will not get
(``events_seen``; :mod:`kvguard.core.fail_soft` says what it does instead).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from time import perf_counter, perf_counter_ns
from typing import Any, Final

from kvguard.core.cost import CostMeter, Switch
from kvguard.core.session import HookErrors
from kvguard.core.types import AcquireKind, RequestId
from kvguard.vllm_plugin.finish import finish_reason_of
from kvguard.vllm_plugin.guard import EngineGuard, InstalledHook
from kvguard.vllm_plugin.pool_reader import block_ids_in
from kvguard.vllm_plugin.versions import (
    COORDINATOR_SINGLE_TYPE_MANAGERS,
    KVM_COORDINATOR,
    OUTPUT_FINISHED_RECVING,
    OUTPUT_FINISHED_SENDING,
    SCHEDULER_DEFERRED_FREES,
    missing_message,
    pool_tag,
    read,
)

log = logging.getLogger("kvguard")

_MARK = "__kvguard_hook__"
_ALLOCATE: Final = AcquireKind.ALLOCATE
_PREFIX_HIT: Final = AcquireKind.PREFIX_HIT

POOL_HOOKS: Final = ("get_new_blocks", "touch", "free_blocks", "unpin_blocks")
"""``BlockPool`` methods kvguard wraps (the table above), in install order."""
SCHEDULER_HOOKS: Final = ("add_request", "_preempt_request", "_free_request",
                          "_free_request_blocks", "_free_blocks", "finish_requests", "schedule",
                          "update_from_output")
"""``Scheduler`` methods kvguard wraps, in install order. A label in ``hooks_installed`` is
``<class name>.<method>``; every method of the three tuples is expected on each supported
vLLM."""
CONNECTOR_HOOKS: Final = ("_update_from_kv_xfer_finished",)
"""``Scheduler`` methods kvguard wraps only when the engine has a KV connector: where
vLLM applies the connector's finished and failed transfers (P/D)."""
COORDINATOR_HOOKS: Final = ("remove_skipped_blocks",)
"""KV cache coordinator methods kvguard wraps: where blocks that slid out of a sliding
window are freed (a no-op for full attention)."""


ENTRY_HOOKS: Final = frozenset({"add_request", "schedule", "update_from_output",
                                "finish_requests"})
"""The engine's entry points among the hooked methods: the cost meter's scheduler time is
their wall time (every other hook runs inside one of them)."""


_NEVER_SKIPS: Final = "FullAttentionManager"
"""vLLM's full-attention KV group manager: it never frees a block before the request
ends (its subclasses, e.g. ring-buffer or R-SWA managers, may)."""


def skips_blocks(coordinator: Any) -> bool:
    """Whether some KV cache group of ``coordinator`` frees blocks while a request runs
    (sliding window, chunked local attention, Mamba...): only then is
    ``remove_skipped_blocks`` worth hooking. Unknown shapes count as yes."""
    managers = read(coordinator, COORDINATOR_SINGLE_TYPE_MANAGERS)
    if coordinator is None or not managers:
        return coordinator is not None
    return any(type(m).__name__ != _NEVER_SKIPS for m in managers)


def _missing(g: EngineGuard, obj: Any, name: str) -> bool:
    """Whether ``obj`` lacks the hook point ``name``; if so, say so once (log and
    ``hooks_missing``, with the feature that is off for it)."""
    if callable(getattr(obj, name, None)):
        return False
    # Fail soft (a vLLM nobody tested): the engine keeps its method as it is, the feature
    # that needs it is off, and the state's hooks_missing says which and why.
    label = f"{type(obj).__name__}.{name}"
    message = missing_message(label)
    g.hooks_missing.append(message)
    log.warning("kvguard: %s is not in this vLLM (%s): that hook is not installed, "
                "the rest of kvguard runs", label, message.partition("(")[2].rstrip(")"))
    return True


def _wrap(g: EngineGuard, obj: Any, name: str, make: Callable[[Any], Any]) -> None:
    if _missing(g, obj, name):
        return
    orig = getattr(obj, name)
    label = f"{type(obj).__name__}.{name}"
    if getattr(orig, _MARK, False):
        return  # already installed: idempotent
    wrapper = make(orig)
    metered = _metered(g.meter, g.errors, make, orig, entry=name in ENTRY_HOOKS)
    for f in (wrapper, metered):
        setattr(f, _MARK, True)
    setattr(obj, name, wrapper)
    g.hooks_installed.append(label)
    g.installed_hooks.append(InstalledHook(obj, name, wrapper, metered))


def _metered(meter: CostMeter, errors: HookErrors, make: Callable[[Any], Any],
             orig: Callable[..., Any], *, entry: bool) -> Callable[..., Any]:
    """The hook ``make`` builds, with a clock at each boundary between it and the engine:
    its wall time minus the time in ``orig`` (the engine's method, with any hook nested in
    it) goes to the meter's window as kvguard's own time; an entry point's wall time, once
    per outermost call, as scheduler time. The hook body is the plain one's: only the
    clocks differ, and closing a window (hooks switched back) is contained like any
    hook's failure."""
    pc = perf_counter_ns
    inner_ns = [0]
    """Time in ``orig`` during the last call (a nested call of the same hook finishes
    inside it, so the outer call's assignment comes last)."""

    def inner(*args: Any, **kwargs: Any) -> Any:
        t = pc()
        try:
            return orig(*args, **kwargs)
        finally:
            inner_ns[0] = pc() - t

    hook = make(inner)

    def metered(*args: Any, **kwargs: Any) -> Any:
        inner_ns[0] = 0
        top = entry and meter.depth == 0
        if entry:
            meter.depth += 1
        t = pc()
        try:
            return hook(*args, **kwargs)
        finally:
            total = pc() - t
            meter.window_self_ns += total - inner_ns[0]
            if entry:
                meter.depth -= 1
                if top:
                    meter.window_scheduler_ns += total
                    if meter.closing:  # this call ended the window's last step
                        try:
                            meter.close()
                        except Exception as exc:
                            errors.record("cost_meter", exc)
    return metered


def _switch_for(hooks: list[InstalledHook]) -> Switch:
    """The cost meter's switch over ``hooks``: it meters only when every hook is kvguard's
    plain one where it was put (a wrapper someone set over one since would hide that hook
    from the meter, and replacing it would drop that wrapper), and it puts back only the
    metered hooks still in place."""
    def switch(metered: bool) -> bool:
        if metered:
            if any(vars(h.obj).get(h.name) is not h.plain for h in hooks):
                return False
            for h in hooks:
                setattr(h.obj, h.name, h.metered)
            return True
        for h in hooks:
            if vars(h.obj).get(h.name) is h.metered:
                setattr(h.obj, h.name, h.plain)
        return True
    return switch


def drop_reclaimed(output: Any, reclaimed: set[str]) -> None:
    """Take the requests reclaim freed out of a connector output's completions (each once:
    its late completion is the last vLLM would ever report for it)."""
    for row in (OUTPUT_FINISHED_SENDING, OUTPUT_FINISHED_RECVING):
        attr = row.name
        ids: Any = read(output, row)
        late = reclaimed.intersection(ids) if ids else ()
        if late:
            setattr(output, attr, set(ids) - set(late))
            reclaimed.difference_update(late)
            log.warning("kvguard: dropped the late %s of %d reclaimed request(s) %s (vLLM "
                        "forgot them when their blocks were reclaimed)", attr, len(late),
                        sorted(late)[:8])


def install_hooks(g: EngineGuard) -> None:
    """Install every hook on ``g.scheduler`` and its block pool.

    The hooks only forward events to the session ``g`` (pool events to its ledger). Pool
    calls carry no request; the lifecycle hook that causes them names the request in
    ``owner`` (a cell local to these hooks, set for the duration of the engine's call), so
    a free inside ``_free_request_blocks`` is charged to that request.
    """
    pool = g.block_pool
    tag = pool_tag(pool)
    """What the pool's own blocks hold in their ``pool`` slot (the version layer's)."""
    sched = g.scheduler
    vllm = g.vllm
    errors = g.errors
    transfers = vllm.transfers
    tracer = g.request_tracer
    """The request's trace context is read at admission (None: tracing off)."""
    owner = g.owner_cell
    """The request whose lifecycle call is running (pool calls inside it are its)."""
    claimed: list[RequestId | None] = [None]
    """The request inside ``_free_request`` or ``_preempt_request``, claimed just before
    (by ``on_finished``, or the preemption hook): its table cannot change until the
    ``_free_request_blocks`` inside, which need not claim it again."""
    schedule_seconds = [0.0]
    """Time the last ``Scheduler.schedule`` call took (the online audit's budget basis)."""
    track_in_flight = [False]
    """Count scheduled batches as in flight: only when EngineCore may keep more than one
    (``vllm.batches_overlap``: async scheduling, pipeline parallel; a synchronous engine
    processes each batch in the step that scheduled it, so none is ever in flight between
    steps, and two calls per step are saved), and only when ``update_from_output`` is
    hooked too (else no batch would ever be seen processed, and no moment would count as
    drained)."""
    # Pool events go to the ledger itself (the session's ``on_blocks_*`` only forward
    # there; its ledger lives as long as it, ``reset`` works in place; its methods are
    # looked up per call, so a replaced one takes effect). kvguard makes about 100 Python
    # calls per engine step on a busy mix, each paid cold (the model step in between
    # evicts kvguard's code from the CPU caches): the hooks below make no call that only
    # forwards or counts (the owner cell is swapped inline, ``len`` is read inline), and
    # a failed claim still lets a deferred free be seen (the queue is read first).
    ledger = g.ledger

    # --- pool: where blocks move -------------------------------------------
    def make_get_new_blocks(orig: Callable[..., Any]) -> Callable[..., Any]:
        def get_new_blocks(*args: Any, **kwargs: Any) -> Any:
            ret = orig(*args, **kwargs)
            try:
                # Blocks this pool just handed out: its own, never the null block (no
                # per-block pool check, unlike blocks a caller passes in).
                ledger.on_blocks_acquired(owner[0], [b.block_id for b in ret], _ALLOCATE)
            except Exception as exc:
                errors.record("get_new_blocks", exc)
            return ret
        return get_new_blocks

    def make_touch(orig: Callable[..., Any]) -> Callable[..., Any]:
        def touch(blocks: Any, *args: Any, **kwargs: Any) -> Any:
            blocks = blocks if isinstance(blocks, (list, tuple)) else list(blocks)
            ret = orig(blocks, *args, **kwargs)
            try:
                ledger.on_blocks_acquired(owner[0], block_ids_in(blocks, tag), _PREFIX_HIT)
            except Exception as exc:
                errors.record("touch", exc)
            return ret
        return touch

    def make_release(hook: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(orig: Callable[..., Any]) -> Callable[..., Any]:
            def release(blocks: Any, *args: Any, **kwargs: Any) -> Any:
                blocks = blocks if isinstance(blocks, list) else list(blocks)
                ret = orig(blocks, *args, **kwargs)
                try:
                    ledger.on_blocks_released(owner[0], block_ids_in(blocks, tag))
                except Exception as exc:
                    errors.record(hook, exc)
                return ret
            return release
        return make

    pool_makers = (make_get_new_blocks, make_touch, make_release("free_blocks"),
                   make_release("unpin_blocks"))
    if [name for name in POOL_HOOKS if _missing(g, pool, name)]:
        # All or none: a release never seen would read as a double free, an acquisition
        # never seen as a block nobody holds. The session goes by the engine's tables.
        g.events_seen.pool_events = False
        log.warning("kvguard: pool events are off (no block pool hook is installed); leaks "
                    "are still found from vLLM's tables and ref counts, double frees are "
                    "not, and a leaked block is not charged to the request that held it")
    else:
        for name, make in zip(POOL_HOOKS, pool_makers, strict=True):
            _wrap(g, pool, name, make)

    # --- scheduler: lifecycle ----------------------------------------------
    pacer = g.pacer  # reconfigured in place: the same object for the session's life

    def make_add_request(orig: Callable[..., Any]) -> Callable[..., Any]:
        def add_request(request: Any, *args: Any, **kwargs: Any) -> Any:
            if pacer.owed_since is not None or g.drain_held_until is not None:
                # A drain went unaudited (the pace, or a hold whose bound may have passed
                # since: an in-process engine is not stepped while idle): audit before it
                # enters, if due.
                try:
                    g.on_admitting()
                except Exception as exc:
                    errors.record("checkpoint", exc)  # an audit failed: no event was lost
            ret = orig(request, *args, **kwargs)
            try:
                now = time.time()
                g.on_admitted(request.request_id, now)  # typed: no NewType call
                if transfers is not None:
                    ev = transfers.admitted(request, now)
                    if ev is not None:
                        g.on_transfer(ev)
            except Exception as exc:
                errors.record("add_request", exc)
            if tracer is not None:  # off: no call at all
                try:
                    tracer.admitted(request.request_id, request.trace_headers)
                except Exception as exc:
                    errors.record("tracing", exc)
            return ret
        return add_request

    def make_preempt(orig: Callable[..., Any]) -> Callable[..., Any]:
        def _preempt_request(request: Any, *args: Any, **kwargs: Any) -> Any:
            rid: RequestId | None = None
            outer = claimed[0]
            try:
                rid = request.request_id  # a RequestId (no NewType call per event)
                g.claim(rid)
                claimed[0] = rid
            except Exception as exc:
                errors.record("preempt", exc)
            prev, owner[0] = owner[0], rid  # the blocks freed inside are its
            try:
                return orig(request, *args, **kwargs)
            finally:
                owner[0] = prev
                claimed[0] = outer
                # After the free inside: preempted is where the request ends up (a claim
                # there, e.g. when this hook's own failed, would mark it running).
                try:
                    if rid is not None:
                        g.on_preempted(rid)
                except Exception as exc:
                    errors.record("preempt", exc)
        return _preempt_request

    def make_free_request(orig: Callable[..., Any]) -> Callable[..., Any]:
        def _free_request(request: Any, *args: Any, **kwargs: Any) -> Any:
            rid: RequestId | None = None
            outer = claimed[0]
            try:
                rid = request.request_id  # a RequestId (no NewType call per event)
                g.on_finished(rid, finish_reason_of(request), time.time())  # claims it
                claimed[0] = rid
            except Exception as exc:
                errors.record("finish", exc)
            prev, owner[0] = owner[0], rid
            try:
                return orig(request, *args, **kwargs)
            finally:
                owner[0] = prev
                claimed[0] = outer
                try:
                    if rid is not None and vllm.holds_request(rid):
                        # The KV connector delayed the free: vLLM keeps the request.
                        now = time.time()
                        g.on_delayed_free_started(rid, now)
                        if transfers is not None:
                            ev = transfers.hold_started(request, now)
                            if ev is not None:
                                g.on_transfer(ev)
                    g.on_release_done()
                except Exception as exc:
                    errors.record("finish", exc)
        return _free_request

    def make_free_request_blocks(orig: Callable[..., Any]) -> Callable[..., Any]:
        def _free_request_blocks(request: Any, *args: Any, **kwargs: Any) -> Any:
            rid: RequestId | None = None
            n_deferred = 0
            deferred: Any = None
            try:
                rid = request.request_id  # a RequestId (no NewType call per event)
                deferred = read(sched, SCHEDULER_DEFERRED_FREES)  # vLLM's queue, if any
                n_deferred = len(deferred) if deferred is not None else 0
                if claimed[0] != rid:  # e.g. a delayed-free completion: claim
                    g.claim(rid)
            except Exception as exc:
                errors.record("free_request_blocks", exc)
            prev, owner[0] = owner[0], rid
            try:
                return orig(request, *args, **kwargs)
            finally:
                owner[0] = prev
                try:
                    if rid is not None and deferred is not None and len(deferred) > n_deferred:
                        g.on_deferred_free_started(rid)
                except Exception as exc:
                    errors.record("free_request_blocks", exc)
        return _free_request_blocks

    def make_free_blocks(orig: Callable[..., Any]) -> Callable[..., Any]:
        def _free_blocks(request: Any, *args: Any, **kwargs: Any) -> Any:
            rid: RequestId | None = None
            try:
                rid = request.request_id  # a RequestId (no NewType call per event)
            except Exception as exc:
                errors.record("free", exc)
            prev, owner[0] = owner[0], rid
            try:
                return orig(request, *args, **kwargs)
            finally:
                owner[0] = prev
                try:
                    if rid is not None:
                        g.on_freed(rid, time.time())
                    g.on_release_done()
                except Exception as exc:
                    errors.record("free", exc)
        return _free_blocks

    def make_step_end(hook: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(orig: Callable[..., Any]) -> Callable[..., Any]:
            def step_end(*args: Any, **kwargs: Any) -> Any:
                ret = orig(*args, **kwargs)
                try:
                    g.on_step_end()
                except Exception as exc:
                    errors.record(hook, exc)
                return ret
            return step_end
        return make

    def make_schedule(orig: Callable[..., Any]) -> Callable[..., Any]:
        def schedule(*args: Any, **kwargs: Any) -> Any:
            t0 = perf_counter()
            ret = orig(*args, **kwargs)
            schedule_seconds[0] = perf_counter() - t0  # the online audit's budget basis
            if track_in_flight[0]:
                try:
                    vllm.on_scheduled(ret)
                except Exception as exc:
                    errors.record("schedule", exc)
            return ret
        return schedule

    def make_update_from_output(orig: Callable[..., Any]) -> Callable[..., Any]:
        def update_from_output(*args: Any, **kwargs: Any) -> Any:
            t0 = perf_counter()
            ret = orig(*args, **kwargs)
            try:
                if track_in_flight[0]:
                    vllm.on_output_processed(args[0] if args
                                             else kwargs.get("scheduler_output"))
                g.on_step_end(step_seconds=schedule_seconds[0] + perf_counter() - t0)
            except Exception as exc:
                errors.record("update_from_output", exc)
            return ret
        return update_from_output

    def make_remove_skipped(orig: Callable[..., Any]) -> Callable[..., Any]:
        def remove_skipped_blocks(request_id: Any, *args: Any, **kwargs: Any) -> Any:
            # Blocks that slid out of a sliding window (hybrid models) are freed here,
            # inside allocate_slots or at finish, with no lifecycle call running: name
            # the request, so that its reference is the one given back (guessing could
            # take it off another request sharing the block through the prefix cache).
            prev = owner[0]
            owner[0] = RequestId(request_id) if isinstance(request_id, str) else prev
            try:
                return orig(request_id, *args, **kwargs)
            finally:
                owner[0] = prev
        return remove_skipped_blocks

    reclaimed = g.reclaimed_requests

    def make_kv_xfer_finished(orig: Callable[..., Any]) -> Callable[..., Any]:
        def _update_from_kv_xfer_finished(output: Any, *args: Any, **kwargs: Any) -> Any:
            if reclaimed:  # empty unless reclaim freed a request vLLM kept
                try:
                    drop_reclaimed(output, reclaimed)
                except Exception as exc:
                    errors.record("reclaim", exc)
            try:
                if transfers is not None:
                    for ev in transfers.connector_output(output, time.time()):
                        g.on_transfer(ev)
            except Exception as exc:
                errors.record("transfers", exc)
            return orig(output, *args, **kwargs)
        return _update_from_kv_xfer_finished

    if transfers is not None:
        for name, make in zip(CONNECTOR_HOOKS, (make_kv_xfer_finished,), strict=True):
            _wrap(g, sched, name, make)
    coordinator = read(g.kv_cache_manager, KVM_COORDINATOR)
    if skips_blocks(coordinator):  # else it runs per request per step for nothing
        for name, make in zip(COORDINATOR_HOOKS, (make_remove_skipped,), strict=True):
            _wrap(g, coordinator, name, make)
    sched_makers = (make_add_request, make_preempt, make_free_request,
                    make_free_request_blocks, make_free_blocks, make_step_end("finish_requests"),
                    make_schedule, make_update_from_output)
    for name, make in zip(SCHEDULER_HOOKS, sched_makers, strict=True):
        _wrap(g, sched, name, make)
    hooked = set(g.hooks_installed)
    seen = g.events_seen
    seen.admissions, seen.finishes, seen.frees = (
        f"{type(sched).__name__}.{name}" in hooked
        for name in ("add_request", "_free_request", "_free_blocks"))
    track_in_flight[0] = (vllm.batches_overlap
                          and f"{type(sched).__name__}.update_from_output" in g.hooks_installed)
    g.meter.attach(_switch_for(g.installed_hooks))
