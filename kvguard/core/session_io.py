"""What a guard session talks to outside the engine's hooks: where its state goes, who asks
it for checkpoints, and who wakes it when the engine is idle (each set by the engine
integration; the session works without the last two)."""

from __future__ import annotations

from typing import Protocol

from kvguard.core.state import EngineState


class StateSink(Protocol):
    """Where the published state goes (a state file written off the engine thread)."""

    @property
    def drops(self) -> int:
        """States replaced before they were written (the reader was slower)."""

    def offer(self, state: EngineState) -> None:
        """Hand over the latest state; never blocks the engine."""

    def close(self) -> None: ...


class CheckpointRequests(Protocol):
    """Asks from outside (the sidecar) for a checkpoint at the next drained moment."""

    def poll(self) -> bool:
        """True once per new request; cheap (called at most once per publish interval)."""


class IdleWaker(Protocol):
    """Runs the session's :meth:`GuardSession.on_idle` on the engine's own thread, once the
    engine is idle, at the earliest after a delay. Never blocks the caller, never runs
    ``on_idle`` while the engine steps (that would race the scheduler)."""

    def wake_after(self, seconds: float) -> None:
        """Run ``on_idle`` when the engine is idle, ``seconds`` from now at the earliest;
        replaces an earlier wake that is later than this one."""

    def close(self) -> None: ...
