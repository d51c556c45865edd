"""What a guard session publishes to, and asks from, outside the engine: in-memory fakes
for the session tests (the state file and the sidecar's request file are tested with the
real transport elsewhere)."""

from __future__ import annotations

from kvguard.core.state import EngineState


class ListSink:
    """Keeps every offered state (a state file would keep the last)."""

    def __init__(self) -> None:
        self.states: list[EngineState] = []
        self.closed = False

    @property
    def drops(self) -> int:
        return 0

    def offer(self, state: EngineState) -> None:
        self.states.append(state)

    def close(self) -> None:
        self.closed = True


class AskOnce:
    def __init__(self) -> None:
        self.asked = False

    def poll(self) -> bool:
        asked, self.asked = self.asked, False
        return asked
