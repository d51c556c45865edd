"""kvguard's version (the published state carries it so readers can check compatibility)."""

__version__ = "0.1.0"
