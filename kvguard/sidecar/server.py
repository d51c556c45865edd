"""``kvguard sidecar``: serve the app with uvicorn on loopback (or a Unix socket)."""

from __future__ import annotations

import os
from pathlib import Path

import uvicorn

from kvguard.config import KvguardConfig
from kvguard.sidecar.app import create_app
from kvguard.sidecar.store import EngineStore


def serve(*, host: str, port: int, run_dir: Path | None = None, uds: str | None = None,
          config: KvguardConfig | None = None) -> None:
    config = config or KvguardConfig.from_env()
    store = EngineStore(run_dir or config.run_dir, history=max(256, config.history))
    app = create_app(store, control_token=config.control_token)
    if uds:
        # Owner-only socket: create it under a restrictive umask.
        old = os.umask(0o077)
        try:
            uvicorn.run(app, uds=uds, log_level="warning")
        finally:
            os.umask(old)
    else:
        uvicorn.run(app, host=host, port=port, log_level="warning")
