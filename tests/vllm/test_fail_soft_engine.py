"""Fail soft on a real engine: one hook point missing, the engine serves the same tokens.

tests/scheduler/test_fail_soft.py removes each of the twelve always-hooked points in turn
from vLLM's real scheduler, under every release. This is the one engine run the issue's
"removing each hook point from a real engine" costs: the model runner, EngineCore's step
and the request outputs are the only things the scheduler level lacks, and none of them
is touched by a hook, so one removal (the finish hook, the one most features rest on)
stands for all of them; an engine per removal would add twelve engine starts to CI.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvguard.chaos.harness import EngineHarness as Harness
from kvguard.chaos.harness import prompt
from kvguard.vllm_plugin import hooks
from kvguard.vllm_plugin.versions import missing_message

MISSING = "_free_request"


def _serve(h: Harness) -> dict[str, list[int]]:
    """Shared-prefix requests, one aborted mid-decode; each request's tokens as its last
    output had them (an aborted request gets no final output in-process)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    shared = prompt(7, 64)
    for i in range(4):  # greedy: the same tokens on any engine of the same (dummy) model
        h.engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=shared + prompt(
            20 + i, 10 + 7 * i)), SamplingParams(max_tokens=12 + 3 * i, temperature=0.0,
                                                 ignore_eos=True))
    tokens: dict[str, list[int]] = {}
    for step in range(500):
        if not h.engine.has_unfinished_requests():
            break
        if step == 4:
            h.abort("r3")
        for out in h.engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    return tokens


def test_an_engine_missing_a_hook_point_serves_the_same_tokens_and_says_what_is_off(
        engines: Callable[..., Harness], monkeypatch: pytest.MonkeyPatch) -> None:
    reference = _serve(engines())
    install = hooks.install_hooks

    def install_without(g: Any) -> None:
        setattr(g.scheduler, MISSING, None)  # kvguard finds no hook point there
        try:
            install(g)
        finally:
            delattr(g.scheduler, MISSING)  # vLLM's own method again, unhooked

    monkeypatch.setattr(hooks, "install_hooks", install_without)
    h = engines()
    label = f"{type(h.scheduler).__name__}.{MISSING}"
    assert h.guard.hooks_missing == [missing_message(label)]
    assert h.guard.state().hooks_missing == [missing_message(label)]
    # The engine is unharmed: the same tokens, the same aborts, and vLLM's pool idle after.
    assert _serve(h) == reference and set(reference) == {"r0", "r1", "r2", "r3"}
    truth = h.pool_truth()
    assert truth.wrong_blocks == frozenset() and truth.tables == {}
    assert h.guard.errors.total == 0
