"""The message an engine publishes (defined in ``kvguard.core.state``; transport moves it)."""

from kvguard.core.state import STATE_SCHEMA_VERSION, CostState, EngineState, OnlineState

__all__ = ["STATE_SCHEMA_VERSION", "CostState", "EngineState", "OnlineState"]
