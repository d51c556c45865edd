"""A workload that never lets the engine drain: the setting of the online audit.

Every step, new requests arrive so that at least ``backlog`` requests wait
behind the ``concurrency`` running ones: arrivals keep up with completions, so
the drain model predicts no drain and no drained checkpoint is ever possible.
Token-id prompts only; half of them share a prefix so that prefix hits, cache
evictions and block reuse all happen.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from kvguard.chaos.harness import EngineHarness, prompt


@dataclass
class SustainedLoad:
    """Keeps ``concurrency + backlog`` requests in the engine at every step."""

    h: EngineHarness
    concurrency: int = 8
    backlog: int = 2
    prompt_tokens: int = 48
    max_tokens: int = 24
    shared_prefix_tokens: int = 32
    started: int = 0
    steps: int = 0
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def top_up(self) -> None:
        sched = self.h.scheduler
        in_flight = len(sched.running) + len(sched.waiting)
        for _ in range(self.concurrency + self.backlog - in_flight):
            n = next(self._ids)
            tokens = prompt(10_000 + n, self.prompt_tokens)
            if n % 2:
                tokens[: self.shared_prefix_tokens] = prompt(7, self.shared_prefix_tokens)
            self.h.add(tokens, max_tokens=self.max_tokens + n % 7, rid=f"load-{n}")
            self.started += 1

    def step(self, n: int = 1) -> None:
        """Top up, then one engine step; ``n`` times."""
        for _ in range(n):
            self.top_up()
            self.h.engine.step()
            self.steps += 1

    def in_flight(self) -> int:
        sched = self.h.scheduler
        return len(sched.running) + len(sched.waiting)
