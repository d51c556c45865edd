"""The engine-priority tooling of the P/D tests, on real processes: every thread of every
process in the group but its leader ends at nice 19, processes started later included, and
the leader (a server's API process) keeps its own priority."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvguard.testing.engine_nice import ENGINE_NICE, EngineNice, group_members

_LEADER = """
import subprocess, sys, time
time.sleep(1.0)  # an engine process that starts after the tooling does
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
print(child.pid, flush=True)
time.sleep(60)
"""
_CHILD = """
import threading, time
threading.Thread(target=time.sleep, args=(60,)).start()
time.sleep(60)
"""


def _nice_of_threads(pid: int) -> dict[int, int]:
    return {int(t): os.getpriority(os.PRIO_PROCESS, int(t))
            for t in os.listdir(f"/proc/{pid}/task")}


def _until(predicate: object, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.1)
    return False


def test_every_engine_thread_is_reniced_and_the_leader_is_not(tmp_path: Path) -> None:
    leader = subprocess.Popen([sys.executable, "-c", _LEADER, _CHILD], stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    nice = EngineNice(leader.pid)
    nice.start()  # as ServerProcess does: before the engine processes exist
    try:
        assert leader.stdout is not None
        child = int(leader.stdout.readline())
        assert group_members(leader.pid) == [child]
        # the engine process that appeared later is found, and both its threads reniced
        assert _until(lambda: len(_nice_of_threads(child)) == 2
                      and set(_nice_of_threads(child).values()) == {ENGINE_NICE})
        assert set(_nice_of_threads(leader.pid).values()) == {os.getpriority(os.PRIO_PROCESS, 0)}
    finally:
        nice.stop()
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
