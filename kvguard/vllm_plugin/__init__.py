"""The vLLM integration: hooks in EngineCore that feed the ledger and run checkpoints.

Everything that touches vLLM objects lives in this package; ``kvguard.core``
never imports vLLM or torch.
"""
