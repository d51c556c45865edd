"""Getting engine state out of EngineCore: a state file per engine, written off-thread."""
