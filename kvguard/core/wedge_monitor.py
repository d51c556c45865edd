"""``WedgeMonitor``: the wedge verdict online, shaped as a monitor of a guard session.

Moments (all on the engine's thread, between steps):

* :meth:`WedgeMonitor.on_step_end` -- a step ended: track the stall (requests waiting,
  none admitted) and, past the thresholds, judge (:func:`~kvguard.core.wedge.judge_wedge`);
  returns the verdict when a wedge is newly named.
* :meth:`WedgeMonitor.state` -- its section of the published engine state.
* :meth:`WedgeMonitor.report` -- its section of a report: the current verdict, if any.

Cost: while nothing waits, the length of the engine's waiting queues per step (about
0.2 us with its call from the session, measured in a loop on a 2-core host). While
requests wait, the head's id and two counts per step; the dead owners are collected at
most once per ``judge_interval_seconds`` and only once the stall passed the thresholds.

*Admitted* is read from what the engine shows between steps: the oldest waiting request
changed, fewer requests wait, or more run. Any of these resets the stall (an abort from
the queue does too: that can only delay a verdict, never make a false one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from kvguard.core.dead_owners import dead_owners
from kvguard.core.ledger import OwnershipLedger
from kvguard.core.offload import OffloadAudit
from kvguard.core.online import OnlineAuditor
from kvguard.core.types import LeakCause
from kvguard.core.wedge import (
    DeadOwner,
    Stall,
    WaitingView,
    WedgeOptions,
    WedgeVerdict,
    judge_wedge,
)

log = logging.getLogger("kvguard")

JUDGE_INTERVAL_SECONDS = 0.5
"""Most often the dead owners are collected while a stall lasts (monotonic s)."""


class WaitingSource(Protocol):
    """What waits in the engine (its scheduler's queue); every method is cheap and runs on
    the engine's thread between steps. May raise: the session contains it."""

    def num_waiting(self) -> int:
        """Requests waiting to be admitted (called every step)."""

    def num_running(self) -> int: ...

    def head_request_id(self) -> str | None:
        """The request the engine would admit next (its queue's head)."""

    def read(self, now: float) -> WaitingView:
        """The whole view (``now``: Unix s), read only while a stall is judged."""


class WedgeState(BaseModel):
    """The wedge monitor in the engine's published state."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    wedged: bool = Field(description="The last judgment named a wedge.")
    wedged_since: float | None = Field(default=None, description="Unix s.")
    verdicts_total: int = Field(default=0, ge=0, description="Wedges named (each once).")
    after_seconds: float
    after_steps: int
    last: WedgeVerdict | None = Field(default=None, description="The last judgment (None: "
                                      "no stall reached the thresholds since the start).")


class WedgeMonitor:
    """Names a wedged engine online. Not thread-safe (engine thread only)."""

    def __init__(self, source: WaitingSource,
                 dead: Callable[[float], list[DeadOwner]],
                 opts: WedgeOptions | None = None,
                 *, engine: str = "engine") -> None:
        """``dead(now)``: the dead owners now (Unix s), collected only when judging."""
        self.source = source
        self.dead = dead
        self.opts = opts or WedgeOptions()
        self.engine = engine
        self.verdicts_total = 0
        self.last: WedgeVerdict | None = None
        self.last_owners: tuple[DeadOwner, ...] = ()
        """The dead owners (with their block ids) of the last judgment, ``last``."""
        self.wedged_since: float | None = None
        self._head: str | None = None
        self._waiting = 0
        self._running = 0
        self._stall_since_mono: float | None = None
        self._stall_steps = 0
        self._next_judge = 0.0

    @property
    def wedged(self) -> bool:
        return self.wedged_since is not None

    def _progress(self) -> None:
        self._stall_since_mono = None
        self._stall_steps = 0
        if self.wedged_since is not None:
            log.warning("kvguard on %s: the engine admits requests again (no longer wedged)",
                        self.engine)
            self.wedged_since = None
            if self.last is not None:
                self.last = self.last.model_copy(update={"wedged": False, "explanation":
                                                         "admitting again"})

    def on_step_end(self, wall: float | None = None, mono: float | None = None, *,
                    stepped: bool = True) -> WedgeVerdict | None:
        """A step ended (``wall``: Unix s, ``mono``: monotonic s, read from the clocks when
        None and something waits; ``stepped``: False for the end of an abort, which is no
        engine step). Returns the verdict when it names a wedge that was not named before."""
        n = self.source.num_waiting()
        if n == 0:
            if self._stall_since_mono is not None or self.wedged_since is not None:
                self._waiting = 0
                self._head = None
                self._progress()
            return None
        wall = time.time() if wall is None else wall
        mono = time.monotonic() if mono is None else mono
        head = self.source.head_request_id()
        running = self.source.num_running()
        if (self._stall_since_mono is None or head != self._head or n < self._waiting
                or running > self._running):
            self._progress()
            self._stall_since_mono = mono
        elif stepped:
            self._stall_steps += 1
        self._head, self._waiting, self._running = head, n, running
        stalled_for = mono - self._stall_since_mono
        opts = self.opts
        if stalled_for < opts.after_seconds or self._stall_steps < opts.after_steps \
                or mono < self._next_judge:
            return None
        self._next_judge = mono + JUDGE_INTERVAL_SECONDS
        owners = self.dead(wall)
        verdict = judge_wedge(self.source.read(wall), Stall(stalled_for, self._stall_steps),
                              owners, opts, now=wall)
        self.last = verdict
        self.last_owners = tuple(owners)
        if not verdict.wedged:
            if self.wedged_since is not None:
                self.wedged_since = None
            return None
        if self.wedged_since is not None:
            return None
        self.wedged_since = wall
        self.verdicts_total += 1
        log.warning("kvguard on %s: %s", self.engine, verdict.explanation)
        return verdict

    def state(self) -> WedgeState:
        return WedgeState(wedged=self.wedged, wedged_since=self.wedged_since,
                          verdicts_total=self.verdicts_total,
                          after_seconds=self.opts.after_seconds,
                          after_steps=self.opts.after_steps, last=self.last)

    def report(self) -> WedgeVerdict | None:
        """The current wedge verdict (None: not wedged)."""
        return self.last if self.wedged else None


class OwnerRecords(Protocol):
    """What a guard session keeps that names dead owners (``GuardSession`` has it all)."""

    @property
    def ledger(self) -> OwnershipLedger: ...

    @property
    def offload(self) -> OffloadAudit | None: ...

    @property
    def online(self) -> OnlineAuditor | None: ...

    @property
    def delayed_free_bound(self) -> float:
        """Seconds a delayed free may last."""


def session_dead_owners(session: OwnerRecords, now: float) -> list[DeadOwner]:
    """Dead owners from what ``session`` keeps: its ledger, its offload audit's stuck jobs
    and its online audit's confirmed blocks."""
    stuck: list[str] = []
    offload = session.offload
    if offload is not None and offload.last is not None:
        stuck = [j.request_id for j in offload.last.stuck]
    confirmed: dict[int, list[LeakCause]] = {}
    online = session.online
    if online is not None:
        confirmed = {b: [f.cause for f in c.findings] for b, c in online.confirmed.items()}
    return dead_owners(session.ledger, now=now, bound_seconds=session.delayed_free_bound,
                       stuck_offload_requests=stuck, confirmed_causes=confirmed)
