"""A real Arize Phoenix trace store on loopback, for tests that query traces.

Installed by ``scripts/bootstrap-phoenix`` into ``.venv-phoenix`` (its own virtual
environment, a pinned release). :func:`phoenix_server` starts ``phoenix serve`` with its
HTTP server (OTLP/HTTP at ``/v1/traces``, the REST API at ``/v1/...``) on the given host and
port, its gRPC receiver on a port of its own (Phoenix cannot turn it off; nothing here
sends to it), its SQLite database in the given directory, no outside requests, and stops
it by its pid. Reusable from any test (e.g. one whose engines run in network namespaces:
pass that namespace's address as ``host`` and wrap the command with ``command_prefix``).

Phoenix keeps no resource attributes per span: spans must carry ``service.name`` and the
engine's identity as span attributes to be told apart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PHOENIX_VENV = ROOT / ".venv-phoenix"
PHOENIX_BIN = PHOENIX_VENV / "bin" / "phoenix"
READY_TIMEOUT_S = 90.0
"""Measured ready in 12-20 s on two loaded cores; a cold page cache takes longer."""
PROJECT = "default"
"""Phoenix's project for spans whose resource names none (vLLM's and kvguard's)."""


@dataclass(frozen=True)
class Phoenix:
    """A running Phoenix: where to send spans and how to read them back."""

    host: str
    port: int
    grpc_port: int
    work_dir: Path
    pid: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def otlp_traces_endpoint(self) -> str:
        """OTLP/HTTP (protobuf) traces endpoint: vLLM's ``--otlp-traces-endpoint`` with
        ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``."""
        return f"{self.base_url}/v1/traces"

    def spans(self, trace_id: str, *, project: str = PROJECT,
              limit: int = 1000) -> list[dict[str, Any]]:
        """Every span Phoenix holds for ``trace_id`` (32 lowercase hex digits), through its
        REST API (``GET /v1/projects/{project}/spans?trace_id=...``), every page. Each span
        is a dict with ``name``, ``context`` (``trace_id``, ``span_id``), ``parent_id``,
        ``start_time``, ``end_time``, ``status_code`` and flat dotted ``attributes``."""
        out: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            q: dict[str, str | int] = {"trace_id": trace_id, "limit": limit}
            if cursor:
                q["cursor"] = cursor
            url = (f"{self.base_url}/v1/projects/{urllib.parse.quote(project)}/spans?"
                   + urllib.parse.urlencode(q))
            try:
                with urllib.request.urlopen(url, timeout=10) as resp:
                    body = json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                if exc.code == 404:  # the project exists only once a span arrived
                    return []
                raise
            out.extend(body["data"])
            cursor = body.get("next_cursor")
            if not cursor:
                return out

    def wait_for_spans(self, trace_id: str, names: Sequence[str], *,
                       timeout: float = 60.0) -> list[dict[str, Any]]:
        """The trace's spans once one span of each name in ``names`` is there."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans(trace_id)
            have = {s["name"] for s in spans}
            if all(n in have for n in names):
                return spans
            assert time.monotonic() < deadline, (
                f"trace {trace_id}: no span named {sorted(set(names) - have)} after "
                f"{timeout:.0f} s; it has {sorted(have)}")
            time.sleep(0.5)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


def _ready(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url + "/healthz", timeout=2) as resp:
            return bool(resp.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to Phoenix's pid (it runs as the leader of its own session), SIGKILL after
    10 s."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


@contextmanager
def phoenix_server(host: str, port: int, work_dir: Path, *, grpc_port: int,
                   command_prefix: Sequence[str] = ()) -> Iterator[Phoenix]:
    """Phoenix serving on ``host:port`` with its database under ``work_dir``, until the
    block ends. ``grpc_port``: a free port for the gRPC receiver Phoenix always opens (on
    every interface). ``command_prefix``: e.g. ``["ip", "netns", "exec", "ns1"]``.
    Fails (never skips) when Phoenix is not installed: ``scripts/bootstrap-phoenix``."""
    assert PHOENIX_BIN.exists(), (
        f"{PHOENIX_BIN} is missing: run scripts/bootstrap (or scripts/bootstrap-phoenix)")
    work_dir.mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(work_dir),
        "PHOENIX_HOST": host, "PHOENIX_PORT": str(port), "PHOENIX_GRPC_PORT": str(grpc_port),
        "PHOENIX_WORKING_DIR": str(work_dir),
        "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false", "PHOENIX_TELEMETRY_ENABLED": "false",
    }
    log_path = work_dir / "phoenix.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([*command_prefix, str(PHOENIX_BIN), "serve"],
                                stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    px = Phoenix(host, port, grpc_port, work_dir, proc.pid, log_path)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _ready(px.base_url):
            assert proc.poll() is None, f"phoenix exited ({proc.returncode}):\n{px.log_tail()}"
            assert time.monotonic() < deadline, f"phoenix not ready:\n{px.log_tail()}"
            time.sleep(0.25)
        yield px
    finally:
        _stop(proc)
