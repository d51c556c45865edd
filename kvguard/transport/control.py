"""Asking an engine for a checkpoint: a request file the engine polls.

The sidecar writes ``<run_dir>/<engine>.checkpoint-request`` (its content is
the Unix time of the request); the engine notices a newer file at its next
step, or, idle, through its idle waker (a ``stat`` every 0.25 s off the engine
thread), and takes a checkpoint at its next drained moment (or reports
``skipped`` with the reason). Files, not sockets: the engine never waits for
the sidecar, and the request survives either side restarting.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SUFFIX = ".checkpoint-request"


def request_path(run_dir: Path, engine: str) -> Path:
    return run_dir / f"{engine}{SUFFIX}"


def write_request(run_dir: Path, engine: str) -> None:
    path = request_path(run_dir, engine)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, f"{time.time():.6f}".encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def request_mtime_ns(run_dir: Path, engine: str) -> int:
    """The request file's mtime, 0 when there is none. One ``stat``; never raises."""
    try:
        return request_path(run_dir, engine).stat().st_mtime_ns
    except OSError:
        return 0
