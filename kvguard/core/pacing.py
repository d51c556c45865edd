"""``CheckpointPacer``: how often a drained engine pays for a full audit (opt-in).

A drained checkpoint reads the whole pool on the scheduler thread (about 2 ms at 100k
blocks and 40 ms at 1M on a 2-core VM, plus the memory attribution). By default
(``interval_seconds == 0``) every drain is audited. An engine with a large pool that
drains every few hundred milliseconds, with requests arriving behind each drain, can
pace them instead.

The pacer is a token bucket: up to ``burst`` drained audits in a row, refilled at one
per ``interval_seconds``. A drained moment that finds no token is *owed*: it is audited
at the first later moment that is drained and finds one, at the next drain, at the
next admission (before the request enters, so the pool is still as the drains left it) or,
on an idle engine, by its idle waker.
Leaks persist, so the audit that pays the debt sees what the skipped drains would have
seen; what a skipped drain costs is time: its findings come at most one interval later,
also when the engine goes idle owing an audit (the session asks its idle waker to run it
on the engine's thread once the pace allows, :meth:`seconds_until_ready`). The published
state says so while it lasts (``unaudited_drain_at``). Explicit checkpoint requests (the
sidecar's) are never paced.

Invariants: ``0 <= tokens <= burst``; ``owed_since`` is set exactly while a drained moment
has gone unaudited since the last drained audit. Times: ``mono`` arguments are
``time.monotonic()`` seconds (the bucket), ``wall`` arguments ``time.time()`` (reported).
"""

from __future__ import annotations

_EPSILON = 1e-9
"""Tokens short of one that still count as one: a drain exactly one interval after the
last must be audited, whatever the float rounding of ``(t1 - t0) / interval``."""


class CheckpointPacer:
    """Token bucket for drained audits (module docstring). Not thread-safe: the engine's
    scheduler thread only."""

    def __init__(self, interval_seconds: float, burst: int) -> None:
        self.tokens = float(burst)
        self.reconfigure(interval_seconds, burst)
        self._refilled_at: float | None = None
        self.owed_since: float | None = None
        """Wall time of the first drained moment not audited since the last drained audit."""
        self.drains_unaudited = 0
        """Drained moments the pacer let go unaudited (monotonic count)."""

    def reconfigure(self, interval_seconds: float, burst: int) -> None:
        """New settings at run time; what is owed stays owed, tokens beyond ``burst`` go."""
        if interval_seconds < 0 or burst < 1:
            raise ValueError(f"interval_seconds >= 0 and burst >= 1 required, got "
                             f"{interval_seconds} and {burst}")
        self.interval_seconds = interval_seconds
        self.burst = burst
        self.tokens = min(self.tokens, float(burst))

    def _refill(self, mono: float) -> None:
        if self._refilled_at is not None:
            gained = (mono - self._refilled_at) / self.interval_seconds
            self.tokens = min(float(self.burst), self.tokens + gained)
        self._refilled_at = mono

    def ready(self, mono: float) -> bool:
        """Whether a drained moment now would be audited (consumes nothing)."""
        if self.interval_seconds <= 0:
            return True
        self._refill(mono)
        return self.tokens >= 1.0 - _EPSILON

    def seconds_until_ready(self, mono: float) -> float:
        """Seconds from ``mono`` until :meth:`ready` is True (0 when it is now)."""
        if self.ready(mono):
            return 0.0
        return (1.0 - self.tokens) * self.interval_seconds

    def take(self, mono: float, wall: float) -> bool:
        """A drained moment: True when it is to be audited now (a token spent); False when
        it is owed (counted, ``owed_since`` set if not already)."""
        if self.ready(mono):
            if self.interval_seconds > 0:
                self.tokens = max(0.0, self.tokens - 1.0)
            return True
        self.drains_unaudited += 1
        if self.owed_since is None:
            self.owed_since = wall
        return False

    def audited(self) -> None:
        """A drained audit ran (paced or asked for): nothing is owed."""
        self.owed_since = None
