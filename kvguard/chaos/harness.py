"""A real in-process vLLM engine with kvguard attached, driven step by step.

Used by the chaos scenarios and by the test suite. Token-id prompts only: no
text, so nothing a scenario sends can end up in a report.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvguard.core.ledger import OwnershipLedger
from kvguard.core.report import CheckpointReport
from kvguard.core.types import Evidence
from kvguard.errors import KvguardError
from kvguard.testing.engine import (
    EngineSpec,
    batches_in_flight,
    build_engine,
    scheduler_of,
    scheduling_of,
)
from kvguard.testing.scheduling import Scheduling
from kvguard.vllm_plugin.guard import EngineGuard, guard_of
from kvguard.vllm_plugin.pool_reader import request_block_ids

if TYPE_CHECKING:
    from kvguard.chaos.faults.scheduler import ChaosScheduler
    from kvguard.chaos.truth import PoolTruth


def fail_finish_events(ledger: OwnershipLedger, times: int) -> None:
    """Make ``ledger.on_request_finished`` raise ``times`` times, then work again (tests of
    kvguard's containment; patches this ledger instance only)."""
    real = ledger.on_request_finished
    left = [times]

    def on_request_finished(*args: Any, **kwargs: Any) -> None:
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("injected failure inside kvguard's finish hook")
        real(*args, **kwargs)

    ledger.on_request_finished = on_request_finished  # type: ignore[method-assign]


def prompt(seed: int, n: int) -> list[int]:
    """A deterministic token-id prompt of ``n`` tokens, distinct per ``seed``."""
    return [3 + (seed * 7919 + i * 31) % 500 for i in range(n)]


class EngineHarness:
    """One engine, its scheduler, its block pool and the kvguard guard on it.

    :func:`~kvguard.testing.engine.build_engine` has run its warm-up request (a long
    first prompt, see :mod:`kvguard.testing.warmup`), so the guard already holds the
    drained checkpoint it took then; :meth:`reports` and everything built on it
    start after that one.
    """

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.engine: Any = build_engine(spec)
        self.scheduler: Any = scheduler_of(self.engine)
        guard = guard_of(self.scheduler)
        if guard is None:
            raise KvguardError("kvguard did not attach to the engine: is the package installed "
                               "in this environment and VLLM_PLUGINS unset or containing "
                               "'kvguard'?")
        self.guard: EngineGuard = guard
        self.pool: Any = self.scheduler.kv_cache_manager.block_pool
        self.warmup_checkpoint_id = max((r.checkpoint_id for r in guard.reports), default=0)
        """The last checkpoint id taken during the engine's warm-up (0: none)."""
        self.warmup_events = Counter(guard.ledger.num_events)
        """The ledger's lifecycle event counts after the warm-up (see :meth:`events`)."""
        self._n = 0

    @property
    def scheduling(self) -> Scheduling:
        """How vLLM really schedules this engine (read from its EngineCore, not the spec)."""
        return scheduling_of(self.engine)

    def batches_in_flight(self) -> int:
        """Scheduled batches whose output vLLM has not processed yet (its batch queue)."""
        return batches_in_flight(self.engine)

    def add(self, tokens: list[int], max_tokens: int, rid: str | None = None) -> str:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._n += 1
        rid = rid or f"req{self._n}"
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=tokens),
                                SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return rid

    def greedy_tokens(self, prompts: list[list[int]], max_tokens: int,
                      prefix: str = "greedy") -> list[list[int]]:
        """vLLM's greedy output tokens for each prompt (all added at once, run to the end;
        request ids ``<prefix>-<i>``)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        for i, tokens in enumerate(prompts):
            self.engine.add_request(f"{prefix}-{i}", TokensPrompt(prompt_token_ids=tokens),
                                    SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                   temperature=0.0))
        out: dict[str, list[int]] = {}
        while self.engine.has_unfinished_requests():
            for o in self.engine.step():
                if o.finished:
                    out[o.request_id] = list(o.outputs[0].token_ids)
        return [out[f"{prefix}-{i}"] for i in range(len(prompts))]

    def internal_id(self, client_id: str) -> str:
        for rid in self.scheduler.requests:
            if rid == client_id or rid.rsplit("-", 1)[0] == client_id:
                return str(rid)
        raise KeyError(client_id)

    def blocks_of(self, client_id: str) -> int:
        return len(request_block_ids(self.scheduler.kv_cache_manager,
                                     self.internal_id(client_id)))

    def abort(self, *client_ids: str) -> None:
        self.engine.abort_request(list(client_ids))

    def step(self, n: int = 1) -> None:
        for _ in range(n):
            self.engine.step()

    def step_until(self, cond: Callable[[], bool], max_steps: int = 5000,
                   max_seconds: float = 600.0, pause_seconds: float = 0.0) -> int:
        """Step until ``cond()``; ``pause_seconds`` between steps when waiting on a clock.

        ``max_steps`` and ``max_seconds`` only bound a failure: the wall-clock one is
        generous, for a loaded host where one step can take a large part of a second.
        """
        deadline = time.monotonic() + max_seconds
        for i in range(max_steps):
            if cond():
                return i
            if time.monotonic() > deadline:
                break
            self.engine.step()
            if pause_seconds:
                time.sleep(pause_seconds)
        raise TimeoutError(f"condition not reached in {max_steps} steps / {max_seconds:.0f} s")

    def run_to_completion(self, max_steps: int = 5000, max_seconds: float = 300.0) -> int:
        """Step until no request is unfinished; the deadline is generous on purpose (a
        loaded 2-core host runs the tiny model at about 10 tokens/s)."""
        return self.step_until(lambda: not self.engine.has_unfinished_requests(), max_steps,
                               max_seconds=max_seconds)

    def drain_scheduler(self, max_seconds: float = 600.0) -> None:
        """Step until the scheduler holds no request at all (delayed frees included) and
        no scheduled batch is in flight (with async scheduling, the last batch can still
        carry a request that finished in the batch before it)."""
        self.step_until(lambda: not self.scheduler.requests and not self.scheduler.running
                        and not len(self.scheduler.waiting) and not self.batches_in_flight(),
                        max_seconds=max_seconds)

    def events(self) -> Counter[str]:
        """The ledger's lifecycle event counts since the engine's warm-up."""
        since = Counter(self.guard.ledger.num_events)
        since.subtract(self.warmup_events)
        return +since

    def reports(self) -> list[CheckpointReport]:
        """The guard's reports (drained and online) since the engine's warm-up, oldest first."""
        return [r for r in self.guard.reports if r.checkpoint_id > self.warmup_checkpoint_id]

    def latest_drained(self) -> CheckpointReport | None:
        """The latest drained checkpoint (taken or skipped) since the warm-up, if any; online
        reports are not."""
        for r in reversed(self.reports()):
            if r.evidence is Evidence.DRAINED:
                return r
        return None

    def latest(self) -> CheckpointReport:
        """The latest drained checkpoint (taken or skipped); raises if there is none."""
        r = self.latest_drained()
        if r is None:
            raise KvguardError("no checkpoint was taken: the engine never drained")
        return r

    def online_reports(self) -> list[CheckpointReport]:
        """Reports of the online audit, oldest first."""
        return [r for r in self.reports() if r.evidence is Evidence.ONLINE]

    def num_usable(self) -> int:
        return int(self.pool.num_gpu_blocks) - 1

    def fail_kvguard_finish_hook(self, times: int) -> None:
        """Make kvguard's own finish hook raise ``times`` times, then work again.

        A monkeypatch of one kvguard call (the ledger's finish event), to prove that
        kvguard contains its own failures: no fault in the engine, and no branch for it
        in kvguard's hooks."""
        fail_finish_events(self.guard.ledger, times)

    # ------------------------------------------------- vLLM's own side
    @property
    def chaos(self) -> ChaosScheduler:
        """The chaos scheduler (raises unless built with ``scheduler_cls=SCHEDULER_CLS``)."""
        from kvguard.chaos.faults.scheduler import ChaosScheduler

        if not isinstance(self.scheduler, ChaosScheduler):
            raise KvguardError("this engine runs vLLM's own scheduler: build it with "
                               "scheduler_cls=kvguard.chaos.faults.SCHEDULER_CLS for faults")
        return self.scheduler

    def vllm_status(self, client_id: str) -> str | None:
        """vLLM's ``RequestStatus`` name for a finished request (None: not finished)."""
        for rid, status in self.chaos.finished.items():
            if rid == client_id or rid.rsplit("-", 1)[0] == client_id:
                return status
        return None

    def vllm_aborted(self, client_ids: list[str]) -> int:
        """How many of these requests vLLM itself finished as ``FINISHED_ABORTED``."""
        return sum(1 for c in client_ids if self.vllm_status(c) == "FINISHED_ABORTED")

    def vllm_metric(self, name: str) -> float:
        """One of vLLM's own metrics (``engine.get_metrics()``), summed over label sets."""
        from kvguard.chaos.truth import metric_value

        return metric_value(self.engine.get_metrics(), name) or 0.0

    def pool_truth(self) -> PoolTruth:
        from kvguard.chaos.truth import read_pool_truth

        return read_pool_truth(self.scheduler)
