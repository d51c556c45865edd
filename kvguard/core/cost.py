"""kvguard's own cost on the engine thread, measured live on a sample of engine steps.

The benchmarks measure what kvguard costs on the tiny CPU model of ``BENCHMARKS.md``; an
operator needs it on their own engines (GPU models, their traffic). So a session meters
itself: one window of :data:`WINDOW_STEPS` engine steps in every ``every`` steps runs
with *metered* hooks (the same hook code, with a clock at each boundary between kvguard
and the engine), the rest with the plain hooks, which carry no clock at all. Per window:

- ``self_ns``: kvguard's own time, each hook's wall time minus the time spent in the
  engine's method it wraps (a hook nested in that method counts its own time once);
- ``scheduler_ns``: the wall time of the engine's entry points kvguard hooks (admission,
  ``schedule``, ``update_from_output``, aborts), kvguard's part included: the same
  boundary as the step-mix benchmark's per-step scheduler time.

``self_ns / scheduler_ns`` is kvguard's share of scheduler time;
``scheduler_ns / (scheduler_ns - self_ns)`` the ratio target 8 of the benchmarks states
(1.02x). Both include the meter's own clock reads (4 per hook call, about 0.1-0.3 us
each): an upper bound, by that much.

Windows are switched by the engine side (:meth:`CostMeter.attach`): a switch that cannot
put every metered hook in place (another wrapper sits over one of kvguard's hooks) puts
none and the window is counted as skipped. Not thread-safe: scheduler thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from kvguard.core.state import CostState

WINDOW_STEPS: Final = 8
"""Engine steps metered in a row: enough that a window holds admissions, finishes and a
step end of each kind, few enough that the metered share of steps stays small."""

Switch = Callable[[bool], bool]
"""Puts the metered hooks in place (True) or the plain ones back (False); returns False
when it could not meter (it then changed nothing)."""


class CostMeter:
    """Counts steps and opens a metered window every ``every`` steps (0: never).

    The metered hooks add to ``window_self_ns`` and ``window_scheduler_ns``; a window's
    numbers join the totals only when the window closes complete, so the totals always
    describe whole sampled steps. Invariant: ``0 <= self_ns_total <= scheduler_ns_total``
    up to the clocks' resolution (kvguard runs inside the entry points it meters).
    """

    __slots__ = (
        "_switch",
        "active",
        "closing",
        "countdown",
        "depth",
        "every",
        "scheduler_ns_total",
        "self_ns_total",
        "steps_total",
        "window",
        "window_scheduler_ns",
        "window_self_ns",
        "windows_skipped_total",
    )

    def __init__(self, every: int) -> None:
        self.self_ns_total = 0
        self.scheduler_ns_total = 0
        self.steps_total = 0
        self.windows_skipped_total = 0
        self._switch: Switch | None = None
        self.active = False
        self.reconfigure(every)

    def reconfigure(self, every: int) -> None:
        """A new sampling period (0: off); the totals stay, a window in progress is
        dropped (its hooks back to the plain ones)."""
        if every < 0:
            raise ValueError(f"every={every}: a number of steps >= 0 (0: off)")
        if self.active and self._switch is not None:
            self._switch(False)
        self.every = every
        self.window = min(WINDOW_STEPS, every) if every else 0
        self.countdown = every
        """Step ends until the next window opens (or, while ``active``, closes)."""
        self.active = False
        self.closing = False
        """The window's last step has ended: it closes when the entry point running now
        returns (that call's time is the window's)."""
        self.window_self_ns = 0
        self.window_scheduler_ns = 0
        self.depth = 0
        """Entry points running now (a nested one is not counted twice)."""

    def attach(self, switch: Switch) -> None:
        """The engine side's hook switch; without one, every window is skipped."""
        self._switch = switch

    def tick(self) -> None:
        """Called at a step end when ``countdown`` has run out: open a window, or mark the
        open one for closing (:meth:`close`, from the metered entry point that ends the
        step)."""
        if self.active:
            if self.closing:  # the step end ran outside a metered entry point: close now
                self.close()
                return
            self.closing = True
            self.countdown = 1  # should the close not come, the next step end closes it
            return
        self.window_self_ns = self.window_scheduler_ns = 0
        self.depth = 0
        if self._switch is not None and self._switch(True):
            self.active = True
            self.countdown = self.window
        else:
            self.windows_skipped_total += 1
            self.countdown = self.every

    def close(self) -> None:
        """The window's steps are done: its numbers join the totals; the plain hooks go
        back in place (unless every step is metered)."""
        self.closing = False
        self.self_ns_total += self.window_self_ns
        self.scheduler_ns_total += self.window_scheduler_ns
        self.steps_total += self.window
        self.window_self_ns = self.window_scheduler_ns = 0
        if self.every <= self.window:  # every step is metered: stay in place
            self.countdown = self.window
            return
        self.active = False
        self.countdown = self.every - self.window
        if self._switch is not None:
            self._switch(False)

    def state(self) -> CostState:
        return CostState(sample_every_steps=self.every, window_steps=self.window,
                         sampled_steps_total=self.steps_total,
                         self_seconds_total=self.self_ns_total / 1e9,
                         scheduler_seconds_total=self.scheduler_ns_total / 1e9,
                         windows_skipped_total=self.windows_skipped_total)
