"""``kvguard chaos``: leak scenarios on a real vLLM engine, scored against expectations."""
