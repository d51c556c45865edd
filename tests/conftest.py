"""Shared fixtures. Tests that drive vLLM import it for real: a missing engine fails loudly."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvguard.config import default_run_dir
from kvguard.testing.hang import take_hung

# Keep EngineCore in this process so tests can reach the real scheduler and pool.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_PLUGINS", "kvguard")

# kvguard's default run dir ($XDG_RUNTIME_DIR/kvguard, else /tmp/kvguard) is shared by
# every kvguard on the host: a test writing there reads other runs' engines and leaves its
# own behind. Point the default at a directory of this session only (servers and chaos
# workers inherit it), start without an inherited KVGUARD_RUN_DIR, and fail any test after
# which something is found there (_no_test_writes_to_the_default_run_dir).
_SESSION_XDG = tempfile.mkdtemp(prefix="kvguard-tests-xdg-")
os.environ["XDG_RUNTIME_DIR"] = _SESSION_XDG
os.environ.pop("KVGUARD_RUN_DIR", None)
DEFAULT_RUN_DIR = default_run_dir()


@pytest.fixture(autouse=True)
def _no_test_writes_to_the_default_run_dir(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test (and fixture) gives kvguard a run dir of its own (``KVGUARD_RUN_DIR``)."""
    yield
    found = sorted(p.name for p in DEFAULT_RUN_DIR.iterdir()) if DEFAULT_RUN_DIR.is_dir() else []
    if found:
        shutil.rmtree(DEFAULT_RUN_DIR, ignore_errors=True)  # the next test is judged alone
        pytest.fail(f"{request.node.nodeid}, or a fixture it uses, let kvguard write {found} "
                    f"to its default run dir ({DEFAULT_RUN_DIR}): give the engine or server a "
                    "run dir of its own, e.g. KVGUARD_RUN_DIR=<tmp_path>/run in its "
                    "environment", pytrace=False)


@pytest.fixture(autouse=True)
def _no_vllm_server_hung(request: pytest.FixtureRequest) -> Iterator[None]:
    """A real vLLM server that stopped answering during this test (or a fixture it uses)
    fails it, naming the server and the ``py-spy`` dump of its threads
    (:mod:`kvguard.testing.hang` stopped it within about a minute). A server that hung
    between tests (a module's shared server) fails the next test, which would use it."""
    yield
    hung = take_hung()
    if hung:
        pytest.fail("; ".join(h.describe() for h in hung), pytrace=False)


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_SESSION_XDG, ignore_errors=True)


_SHARED_SERVERS_DIR = Path(__file__).resolve().parent / "observability"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run tests marked ``kv_connector`` after the others, and ``tests/observability`` last
    of all (stable order otherwise).

    vLLM keeps one worker-side KV connector per process: once an in-process
    engine with a connector exists, a later in-process engine without one fails
    (``kv_connector_metadata is not None`` assertion in vLLM's model runner).

    ``tests/observability`` shares session fixtures across its modules (a data-parallel
    vLLM server, two sidecars, a Prometheus scraping every second, the P/D replay), which
    pytest stops only when the session ends; it starts no in-process engine. Run last, it
    leaves the two cores to the P/D and two-node tests instead of loading them for the rest
    of the session.
    """
    items.sort(key=lambda item: (_SHARED_SERVERS_DIR in item.path.parents,
                                 item.get_closest_marker("kv_connector") is not None))
