"""``kvguard sidecar``: serve the app with uvicorn on loopback (or a Unix socket)."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from pathlib import Path

import uvicorn

from kvguard.config import KvguardConfig
from kvguard.errors import ConfigError
from kvguard.sidecar.app import create_app
from kvguard.sidecar.kv_events import KvEventsWatch
from kvguard.sidecar.store import EngineStore


def serve(*, host: str, port: int, run_dir: Path | None = None, uds: str | None = None,
          config: KvguardConfig | None = None) -> None:
    config = config or KvguardConfig.from_env()
    store = EngineStore(run_dir or config.run_dir, history=max(256, config.history),
                        kv_events=KvEventsWatch() if config.kv_events_watch else None)
    app = create_app(store, control_token=config.control_token)
    if uds:
        sock = owner_only_unix_socket(uds)
        try:
            uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])
        finally:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(uds)
    else:
        uvicorn.run(app, host=host, port=port, log_level="warning")


def owner_only_unix_socket(path: str) -> socket.socket:
    """A listening Unix socket at ``path`` that only its owner can connect to (mode 0600).

    Bound under a 0177 umask, so it is never reachable by others, not even for
    a moment. (``uvicorn.run(uds=...)`` would chmod the socket to 0666.) A stale
    socket left by a previous run is replaced; any other file there is an error.
    """
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise ConfigError("KVGUARD_SIDECAR_UDS", path,
                              "a path that is free or holds a stale socket")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise ConfigError("KVGUARD_SIDECAR_UDS", path, f"a path where a socket can be created "
                                                       f"({exc.strerror})") from None
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(128)
    return sock
