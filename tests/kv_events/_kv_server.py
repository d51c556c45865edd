"""A real vLLM OpenAI server publishing KV events over real ZMQ (``ipc://``), with kvguard in
its EngineCore and the test scheduler (:mod:`kv_truth_scheduler`) writing vLLM's pool."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvguard.kv_events.digest import block_key
from kvguard.testing.engine import EngineSpec, ServerProcess
from kvguard.transport.reader import read_run_dir
from kvguard.transport.state import EngineState

HERE = Path(__file__).resolve().parent
ENGINE = "kvev"
BLOCK = 32


@dataclass
class KvServer:
    server: ServerProcess
    run_dir: Path
    truth_dir: Path
    endpoint: str
    replay_endpoint: str

    @property
    def model(self) -> str:
        return self.server.spec.served_model_name

    def complete(self, token_ids: list[int], max_tokens: int = 4) -> None:
        body = json.dumps({"model": self.model, "prompt": token_ids, "max_tokens": max_tokens,
                           "temperature": 0.0}).encode()
        req = urllib.request.Request(f"{self.server.base_url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200

    def run(self, prompts: list[list[int]], concurrency: int = 4, max_tokens: int = 4) -> None:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(lambda p: self.complete(p, max_tokens), prompts))

    def reset_prefix_cache(self) -> None:
        req = urllib.request.Request(f"{self.server.base_url}/reset_prefix_cache", data=b"",
                                     method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200

    def truth(self) -> dict[str, object]:
        return json.loads((self.truth_dir / "truth.json").read_text())  # type: ignore[no-any-return]

    def truth_keys(self) -> set[str]:
        keys = self.truth()["keys"]
        assert isinstance(keys, list)
        return {_key(k) for k in keys}

    def dropped_keys(self, name: str = "dropped.json") -> set[str]:
        """Keys the test scheduler took out of the stream (``dropped_stored.json``: stores)."""
        path = self.truth_dir / name
        return {_key(k) for k in json.loads(path.read_text())} if path.exists() else set()

    def state(self) -> EngineState | None:
        for s in read_run_dir(self.run_dir).states:
            if s.engine == ENGINE:
                return s
        return None

    def drained_state(self, timeout: float = 90.0) -> EngineState:
        """The engine's state once its snapshot is at the pool's current batch: vLLM's own
        pool (the truth file) idle, and kvguard's snapshot taken after the last batch."""
        deadline = time.monotonic() + timeout
        while True:
            truth = self.truth()
            s = self.state()
            snap = s.kv_events.snapshot if s is not None and s.kv_events is not None else None
            if truth["requests"] == 0 and snap is not None \
                    and snap.last_seq == int(truth["batches"]) - 1:  # type: ignore[call-overload]
                assert s is not None
                return s
            assert time.monotonic() < deadline, (truth["batches"], snap)
            time.sleep(0.2)


def _key(k: list[object]) -> str:
    group, kind, value = k
    assert isinstance(group, int)
    return block_key(group, bytes.fromhex(str(value)) if kind == "b" else int(str(value)))


def prompts(family: int, n: int, *, prefix_blocks: int = 3, suffix_blocks: int = 4,
            ) -> list[list[int]]:
    """``n`` prompts sharing a ``prefix_blocks``-block prefix, each with its own suffix; ids in
    [200, 500) so that no block matches the warm-up's (ids 4..131)."""
    rng = [(family * 7919 + i * 104729) for i in range(n + 1)]
    prefix = [200 + (rng[0] + j * 31) % 300 for j in range(prefix_blocks * BLOCK)]
    return [prefix + [200 + (rng[i + 1] + j * 17 + i) % 300
                      for j in range(suffix_blocks * BLOCK)] for i in range(n)]


@contextmanager
def kv_server(model_dir: Path, log_dir: Path, *, env: dict[str, str] | None = None,
              replay: bool = True, publisher: dict[str, object] | None = None,
              ) -> Iterator[KvServer]:
    """The server with kvguard and KV events on ``ipc://`` endpoints in a short temp dir;
    ``publisher``: more ``kv_events_config`` keys (``hwm``, ``buffer_steps``)."""
    sock_dir = Path(tempfile.mkdtemp(prefix="kvev-", dir="/tmp"))
    run_dir, truth_dir = log_dir / "run", log_dir / "truth"
    truth_dir.mkdir(parents=True, exist_ok=True)
    endpoint, replay_ep = f"ipc://{sock_dir}/pub", f"ipc://{sock_dir}/replay"
    kv_cfg: dict[str, object] = {"enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": endpoint, "topic": ""}
    if replay:
        kv_cfg["replay_endpoint"] = replay_ep
    kv_cfg.update(publisher or {})
    spec = EngineSpec(model_dir=model_dir, max_num_seqs=8, extra={
        "kv_events_config": kv_cfg, "scheduler_cls": "kv_truth_scheduler.KvTruthScheduler"})
    child_env = {"VLLM_PLUGINS": "kvguard", "KVGUARD_RUN_DIR": str(run_dir),
                 "KVGUARD_ENGINE_NAME": ENGINE, "KVG_TEST_TRUTH_DIR": str(truth_dir),
                 "VLLM_SERVER_DEV_MODE": "1",
                 "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
                 **(env or {})}
    try:
        with ServerProcess(spec, log_path=log_dir / "server.log", env=child_env,
                           health_timeout_seconds=400.0) as server:
            yield KvServer(server, run_dir, truth_dir, endpoint, replay_ep)
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
