"""P/D transfers and their hazards as a monitor (a KV connector that moves KV between engines).

Watches: the connector's events (a transfer started, ended, a read after its lease
expired), its live hold deadlines (NIXL leases, renewed by heartbeats), read at most every
``TRANSFER_POLL_SECONDS`` at step ends, at each idle wake-up and before each drained audit;
decode requests that finish before their KV arrived; requests the engine frees.
Adds: hold deadlines to the ledger (a delayed free the connector still holds is
legitimate until its deadline; one it let go of only for the grace after), the
``transfers`` section of the state (records, outcomes, hazards, worker ranks), a warning
per hazard. Failures of the connector's worker-side wrappers are counted under
``transfers_worker``.
Costs per step: one monotonic clock read (the read itself at most 4 times a second, and
proportional to the transfers in flight, never to the ledger's size).
"""

from __future__ import annotations

import logging
import time

from kvguard.core.monitor import BaseMonitor, MonitorHost, StateSection
from kvguard.core.transfers import (
    TransferEvent,
    TransferEventKind,
    TransferLog,
    TransferOutcome,
    TransferRole,
    TransferSource,
)
from kvguard.core.types import FinishReason, RequestId

log = logging.getLogger("kvguard")

TRANSFER_POLL_SECONDS = 0.25
"""How often, at most, the KV connector's hold deadlines are read (at step ends)."""


class TransferMonitor(BaseMonitor):
    """Follows one engine's KV connector: its transfer log and its holds in the ledger."""

    name = "transfers"

    def __init__(self, host: MonitorHost, source: TransferSource) -> None:
        self.host = host
        self.source = source
        self.log = TransferLog(connector=source.connector, kv_role=source.kv_role,
                               kv_engine_id=source.kv_engine_id,
                               hold_source=source.hold_source)
        self._next_poll = 0.0
        self._errors_seen = 0
        self._leased: set[RequestId] = set()
        """Delayed frees that have had a deadline from the connector (polled until freed)."""

    def on_request_finished(self, request_id: RequestId, reason: FinishReason,
                            at: float) -> None:
        rec = self.log.get(request_id)
        if rec is not None and rec.role is TransferRole.DECODE \
                and rec.outcome is TransferOutcome.PENDING:
            # A decode request that finishes before its KV arrived: the engine keeps
            # its blocks until that transfer ends (the connector still writes them).
            self.log.ended(request_id, TransferOutcome.ABORTED_WAITING, at)
            self.host.ledger.on_waited_for_remote_kv(request_id, (
                f"prefill engine {rec.remote_engine_id or '?'} (its request "
                f"{rec.remote_request_id or '?'})"))

    def on_request_freed(self, request_id: RequestId, at: float) -> None:
        self.log.ended(request_id, TransferOutcome.RELEASED, at)  # a hold that ended
        # without a word from the connector

    def on_transfer(self, event: TransferEvent) -> None:
        log_ = self.log
        rid = event.request_id
        if event.kind is TransferEventKind.STARTED and event.role is not None:
            log_.started(rid, self.host.adapter.client_request_id(rid), event.role, event.at,
                         remote_engine_id=event.remote_engine_id,
                         remote_request_id=event.remote_request_id)
        elif event.kind is TransferEventKind.ENDED and event.outcome is not None:
            log_.ended(rid, event.outcome, event.at, reads=event.reads)
        elif event.kind is TransferEventKind.LATE_READ:
            hz = log_.read_after_expiry(rid, event.at)
            if hz is not None:
                log.warning("kvguard on %s: %s for request %s: %s", self.host.engine,
                            hz.kind.value, hz.client_request_id, hz.detail)

    def poll(self, now: float) -> None:
        """Apply the connector's queued events and its live hold deadlines to the ledger.

        A delayed free the connector lists gets its deadline (renewals included); one it
        listed before and no longer does was let go (read, or lease lapsed) and may only
        be held for the grace after that; one it never listed keeps the configured bound.
        """
        src, log_, ledger = self.source, self.log, self.host.ledger
        for ev in src.drain_events():
            self.on_transfer(ev)
        if src.errors > self._errors_seen:  # contained in the worker's wrappers
            self.host.errors.by_hook["transfers_worker"] += src.errors - self._errors_seen
            self._errors_seen = src.errors
        deadlines = src.hold_deadlines()
        log_.hold_source = src.hold_source
        log_.worker_ranks = src.worker_ranks()
        if deadlines is None:
            return
        # Only the holds the connector lists and those it listed before: the work follows
        # the transfers in flight, never the ledger's size.
        for rid, d in deadlines.items():
            rec = ledger.record(RequestId(rid))
            if rec is not None and rec.delayed_free_pending:
                ledger.on_hold_deadline(rec.request_id, d, log_.hold_source)
                log_.deadline(rid, d)
                self._leased.add(rec.request_id)
        for r in [r for r in self._leased if r not in deadlines]:
            rec = ledger.record(r)
            if rec is None or not rec.delayed_free_pending:
                self._leased.discard(r)  # released: nothing left to judge
            elif rec.hold_deadline is not None and rec.hold_deadline > now:
                ledger.on_hold_deadline(r, now, f"{src.connector} let go of the hold")

    def on_step_end(self, step_seconds: float | None) -> None:
        mono = time.monotonic()
        if mono >= self._next_poll:
            self._next_poll = mono + TRANSFER_POLL_SECONDS
            self.poll(time.time())

    def on_idle(self) -> bool:
        with self.host.contain(self.name):
            self.poll(time.time())
        return False

    def before_drained_audit(self, now: float) -> None:
        with self.host.contain(self.name):
            self.poll(now)  # judge delayed frees by the connector's current leases

    def state_section(self) -> StateSection:
        return {"transfers": self.log.state()}
