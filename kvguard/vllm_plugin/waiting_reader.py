"""What waits in one vLLM scheduler: the wedge monitor's
:class:`~kvguard.core.wedge_monitor.WaitingSource`.

vLLM admits waiting requests in order (requests that already hold KV blocks, in
``kv_holding_waiting`` where the version has it, before ``waiting``): the head of
those queues is the request the next admission must take. Every attribute is read
with ``getattr``; a field a version lacks reads as empty, so the monitor sees nothing
waiting rather than breaking the engine. Call on the scheduler thread, between steps.
"""

from __future__ import annotations

from typing import Any

from kvguard.core.wedge import WaitingView, blocks_for_tokens
from kvguard.vllm_plugin.versions import (
    BLOCK_POOL_BLOCKS,
    BLOCK_POOL_NULL_BLOCK,
    CACHE_BLOCK_SIZE,
    CHUNKED_PREFILL,
    KVM_BLOCK_POOL,
    REQUEST_ARRIVAL_TIME,
    REQUEST_ID,
    REQUEST_NUM_COMPUTED_TOKENS,
    REQUEST_NUM_TOKENS,
    REQUEST_QUEUE_PEEK,
    SCHEDULER_BLOCK_SIZE,
    SCHEDULER_CACHE_CONFIG,
    SCHEDULER_KV_CACHE_MANAGER,
    SCHEDULER_KV_HOLDING_WAITING,
    SCHEDULER_MAX_NUM_SCHEDULED_TOKENS,
    SCHEDULER_RUNNING,
    SCHEDULER_SCHEDULER_CONFIG,
    SCHEDULER_WAITING,
    read,
)

_EMPTY: tuple[Any, ...] = ()


def _len(q: Any) -> int:
    try:
        return len(q)
    except TypeError:
        return 0


class VllmWaiting:
    """Reads ``scheduler.waiting`` (and ``kv_holding_waiting``), the head request's
    arrival time and size, and the pool's free count."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        kvm = read(scheduler, SCHEDULER_KV_CACHE_MANAGER)
        self._pool: Any = read(kvm, KVM_BLOCK_POOL)
        self.block_size = int(read(scheduler, SCHEDULER_BLOCK_SIZE, 0) or
                              read(read(scheduler, SCHEDULER_CACHE_CONFIG), CACHE_BLOCK_SIZE,
                                   16))
        """Tokens per block (vLLM's ``scheduler.block_size``)."""

    def _queues(self) -> tuple[Any, Any]:
        """Read each time: a scheduler (or a subclass) may replace its queues."""
        s = self.scheduler
        return (read(s, SCHEDULER_KV_HOLDING_WAITING, _EMPTY),
                read(s, SCHEDULER_WAITING, _EMPTY))

    def num_waiting(self) -> int:
        holding, waiting = self._queues()
        return _len(waiting) + _len(holding)

    def num_running(self) -> int:
        return _len(read(self.scheduler, SCHEDULER_RUNNING, _EMPTY))

    def _head(self) -> Any:
        for q in self._queues():
            if _len(q):
                peek = read(q, REQUEST_QUEUE_PEEK)
                return peek() if peek is not None else next(iter(q))
        return None

    def head_request_id(self) -> str | None:
        head = self._head()
        return None if head is None else str(read(head, REQUEST_ID, id(head)))

    def _oldest_arrival(self) -> float | None:
        times = [read(r, REQUEST_ARRIVAL_TIME) for q in self._queues() for r in q]
        known = [t for t in times if isinstance(t, (int, float))]
        return min(known) if known else None

    def head_blocks_needed(self) -> int:
        """Blocks the head needs for its first chunk (no prefix hit assumed: an upper
        bound). With chunked prefill, a chunk is at most the step's token budget."""
        head = self._head()
        if head is None:
            return 0
        tokens = int(read(head, REQUEST_NUM_TOKENS, 0)) - int(read(head,
                                                                   REQUEST_NUM_COMPUTED_TOKENS,
                                                                   0))
        s = self.scheduler
        chunked = read(read(s, SCHEDULER_SCHEDULER_CONFIG), CHUNKED_PREFILL, True)
        budget = read(s, SCHEDULER_MAX_NUM_SCHEDULED_TOKENS)
        if chunked and isinstance(budget, int) and budget > 0:
            tokens = min(tokens, budget)
        return blocks_for_tokens(tokens, max(1, self.block_size))

    def read(self, now: float) -> WaitingView:
        pool = self._pool
        blocks = read(pool, BLOCK_POOL_BLOCKS, _EMPTY)
        nulls = 1 if read(pool, BLOCK_POOL_NULL_BLOCK) is not None else 0
        free = int(pool.get_num_free_blocks()) if pool is not None else 0
        oldest = self._oldest_arrival()
        return WaitingView(num_waiting=self.num_waiting(), num_running=self.num_running(),
                           oldest_wait_seconds=max(0.0, now - oldest) if oldest else 0.0,
                           head_blocks_needed=self.head_blocks_needed(),
                           num_free_blocks=free,
                           capacity_blocks=max(0, _len(blocks) - nulls))
