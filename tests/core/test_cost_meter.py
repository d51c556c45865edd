"""The cost meter's windows: which steps are metered, when totals move, what a refused
switch does. The hooks' clocks are tested on a real engine (tests/vllm/test_cost_meter_engine.py);
here a fake switch stands for them."""

from __future__ import annotations

import pytest

from kvguard.config import KvguardConfig
from kvguard.core.cost import WINDOW_STEPS, CostMeter
from kvguard.errors import ConfigError


class FakeHooks:
    """Records the switch's calls; ``refuse`` makes it decline to meter."""

    def __init__(self, refuse: bool = False) -> None:
        self.metered = False
        self.refuse = refuse
        self.calls: list[bool] = []

    def __call__(self, metered: bool) -> bool:
        self.calls.append(metered)
        if metered and self.refuse:
            return False
        self.metered = metered
        return True


def step(m: CostMeter, hooks: FakeHooks, self_ns: int, sched_ns: int) -> None:
    """One engine step as the hooks drive the meter: the metered hooks (when in place) add
    their time, and the step's end counts down and, at zero, ticks; a window's last step
    closes from the entry point that ends it."""
    if hooks.metered:
        m.window_self_ns += self_ns
        m.window_scheduler_ns += sched_ns
    m.countdown -= 1
    if m.countdown == 0:
        m.tick()
    if hooks.metered and m.closing:
        m.close()


def test_one_window_of_8_steps_every_period_and_only_whole_windows_count() -> None:
    hooks = FakeHooks()
    m = CostMeter(32)
    m.attach(hooks)
    metered_steps = 0
    for _ in range(32 * 3 + 4):  # ends 4 steps into the third window
        was = hooks.metered
        step(m, hooks, 10, 100)
        metered_steps += was
    # Windows open at the end of steps 32, 64 and 96, and the 8 steps after are metered.
    assert hooks.calls == [True, False, True, False, True]
    assert m.steps_total == 2 * WINDOW_STEPS
    assert (m.self_ns_total, m.scheduler_ns_total) == (2 * 8 * 10, 2 * 8 * 100)
    assert metered_steps == 2 * 8 + 4  # the open window's steps are not in the totals yet
    st = m.state()
    assert st.sampled_steps_total == 16 and st.self_seconds_total == pytest.approx(160e-9)


def test_every_step_metered_keeps_the_metered_hooks_in_place() -> None:
    hooks = FakeHooks()
    m = CostMeter(1)
    m.attach(hooks)
    for _ in range(10):
        step(m, hooks, 1, 3)
    assert hooks.calls == [True]  # switched once, never back
    assert m.steps_total == 9  # the first step ended before any hook was metered
    assert (m.self_ns_total, m.scheduler_ns_total) == (9, 27)


def test_a_refused_switch_skips_the_window_and_waits_a_whole_period() -> None:
    hooks = FakeHooks(refuse=True)
    m = CostMeter(16)
    m.attach(hooks)
    for _ in range(16 * 3):
        step(m, hooks, 10, 100)
    assert m.windows_skipped_total == 3
    assert m.steps_total == 0 and m.self_ns_total == 0
    hooks.refuse = False
    for _ in range(16 + 8):
        step(m, hooks, 10, 100)
    assert m.steps_total == 8 and m.windows_skipped_total == 3
    assert (m.self_ns_total, m.scheduler_ns_total) == (80, 800)


def test_without_a_switch_every_window_is_skipped() -> None:
    m = CostMeter(4)
    for _ in range(12):
        m.countdown -= 1
        if m.countdown == 0:
            m.tick()
    assert m.windows_skipped_total == 3 and m.steps_total == 0


def test_off_never_ticks() -> None:
    hooks = FakeHooks()
    m = CostMeter(0)
    m.attach(hooks)
    for _ in range(1000):
        step(m, hooks, 10, 100)
    assert hooks.calls == [] and m.steps_total == 0 and m.windows_skipped_total == 0


def test_reconfigure_drops_an_open_window_and_keeps_the_totals() -> None:
    hooks = FakeHooks()
    m = CostMeter(16)
    m.attach(hooks)
    for _ in range(16 * 2 + 2):  # one whole window, then 2 steps into the next
        step(m, hooks, 10, 100)
    assert m.steps_total == 8 and hooks.metered
    m.reconfigure(0)
    assert not hooks.metered and m.steps_total == 8 and m.self_ns_total == 80
    for _ in range(100):
        step(m, hooks, 10, 100)
    assert m.steps_total == 8


def test_a_close_that_never_came_happens_at_the_next_step_end() -> None:
    """The step end of a window's last step ran outside a metered entry point (a wrapper
    set over kvguard's since): the window still closes, one step later."""
    hooks = FakeHooks()
    m = CostMeter(16)
    m.attach(hooks)
    for _ in range(16 + 8):
        m.countdown -= 1
        if m.countdown == 0:
            m.tick()
    assert m.active and m.closing
    m.countdown -= 1
    assert m.countdown == 0
    m.tick()
    assert not m.active and not hooks.metered and m.steps_total == 8


def test_config_rejects_a_negative_period_with_what_to_set() -> None:
    with pytest.raises(ConfigError, match="KVGUARD_COST_SAMPLE_EVERY_STEPS"):
        KvguardConfig.from_env({"KVGUARD_COST_SAMPLE_EVERY_STEPS": "-1"})
    assert KvguardConfig.from_env({}).cost_sample_every_steps == 512
