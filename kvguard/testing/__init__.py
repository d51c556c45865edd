"""Test tooling, not kvguard's runtime: what ``kvguard demo``, ``kvguard chaos``, the
benchmarks and the tests use to start real vLLM engines and servers on a CPU.

- :mod:`~kvguard.testing.tiny_model`: a tiny local Llama (and draft, hybrid, sliding
  variants), written to disk with no download;
- :mod:`~kvguard.testing.engine`: an in-process engine or an OpenAI server process from an
  :class:`~kvguard.testing.engine.EngineSpec`;
- :mod:`~kvguard.testing.scheduling`: vLLM's async scheduling on the CPU build (with
  ``async_site/sitecustomize.py`` for server processes);
- :mod:`~kvguard.testing.warmup`, :mod:`~kvguard.testing.workload`,
  :mod:`~kvguard.testing.ports`: warm-up requests, the demo's workload, loopback ports;
- :mod:`~kvguard.testing.offload_spec` (with ``offload_worker`` and ``offload_copy``): a
  torch-CPU ``OffloadingWorker`` under a ``CPUOffloadingSpec`` subclass, so that vLLM's
  real OffloadingConnector runs on a CPU (on a GPU vLLM's own worker does this).

Nothing here is imported when vLLM loads kvguard, and nothing here is public API: it
changes with the tests. The P/D pair and its proxy live with their tests (``tests/pd``).
"""
