"""kvguard's features, one monitor each (:mod:`kvguard.core.monitor` says what a monitor is).

Each module says at its top what it watches, what it adds to the report and the published
state, and what it costs per step.
"""
