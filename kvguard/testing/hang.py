"""A watchdog for the real vLLM servers that tests start: a hung server fails fast, explained.

A vLLM server that stops answering (its API process no longer serves ``GET /metrics``)
used to hold a test until every one of its waits ran out, then its module's teardown,
for many minutes, and leave nothing to say why. :class:`HangWatch` probes the server
from a daemon thread every :data:`PROBE_EVERY_SECONDS`; when no probe has been answered
for :data:`UNANSWERED_LIMIT_SECONDS` while the server's process still lives, it

1. writes what the machine was doing (load average, memory, the processes holding the
   most memory) and a ``py-spy dump`` of every thread of every process in the server's
   process group (API server, EngineCore, workers) to ``<log>.hang.txt`` and to stderr
   (pytest shows it with the failing test);
2. stops the group by its pid (SIGKILL): the test's pending requests then fail at once
   instead of waiting out their own timeouts;
3. records a :class:`HangReport` in :data:`HUNG`, which the suite's ``conftest`` turns
   into a failure of the test that was running, naming the server and the dump.

The probe thread is started by the thread that starts the server, so a server started
inside a network namespace (``setns`` on that thread) is probed inside it: a new thread
inherits its creator's namespaces. A test that stops its server (``ServerProcess.stop``)
stops the watch first. Test tooling only: nothing here runs in a serving process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Final

PROBE_EVERY_SECONDS: Final = 5.0
"""Seconds between probes (``GET /metrics``, answered by the API server's event loop)."""
PROBE_TIMEOUT_SECONDS: Final = 10.0
"""A probe not answered within this counts as unanswered."""
UNANSWERED_LIMIT_SECONDS: Final = 45.0
"""A server that answered no probe for this long is hung. On 2 loaded cores a healthy
server has answered every ``/metrics`` within 10 s; with the dump and the kill the
test fails within about a minute of the server's last answer."""
DUMP_TIMEOUT_SECONDS: Final = 30.0
"""Per process: ``py-spy dump`` of a process of 50 threads takes 1-3 s here."""


@dataclass(frozen=True, slots=True)
class HangReport:
    """A server the watch declared hung and stopped."""

    server: str
    """What the server is (its log file's name, e.g. ``decode.log``)."""
    pid: int
    """The API server's pid, also its process group id."""
    silent_seconds: float
    """Seconds since its last answered probe, when it was declared hung."""
    dump_path: Path
    """The ``py-spy dump`` of every thread of its processes."""

    def describe(self) -> str:
        return (f"vLLM server {self.server} (pid {self.pid}) answered no GET /metrics for "
                f"{self.silent_seconds:.0f} s and was stopped; every thread of its "
                f"processes: {self.dump_path}")


HUNG: list[HangReport] = []
"""Every server declared hung in this process, oldest first (the suite's conftest takes
them after each test)."""
_HUNG_LOCK = threading.Lock()


def raise_if_hung(what: str) -> None:
    """Raise ``AssertionError`` at once when a watched server was declared hung (and
    stopped): a test's polling loop (``until``) calls this so that it stops waiting for a
    server that will never answer again. The reports stay for the suite's conftest."""
    with _HUNG_LOCK:
        hung = list(HUNG)
    if hung:
        raise AssertionError(f"gave up waiting for {what}: "
                             + "; ".join(h.describe() for h in hung))


def take_hung() -> list[HangReport]:
    """The hung servers recorded since the last call (and forget them)."""
    with _HUNG_LOCK:
        out = list(HUNG)
        HUNG.clear()
    return out


def group_pids(pgid: int) -> list[int]:
    """Every live process whose process group is ``pgid`` (from ``/proc``)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) == pgid:
                pids.append(int(entry))
        except OSError:
            continue
    return sorted(pids)


def dump_threads(pids: list[int]) -> str:
    """``py-spy dump`` of each process (its native frames left out: faster, and what a
    Python hang needs); a process it cannot read says why."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    parts = []
    for pid in pids:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            comm = "?"
        try:
            out = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True,
                                 text=True, timeout=DUMP_TIMEOUT_SECONDS)
            text = out.stdout + out.stderr
        except (OSError, subprocess.TimeoutExpired) as exc:
            text = f"(py-spy could not dump it: {exc})"
        parts.append(f"===== pid {pid} ({comm}) =====\n{text}")
    return "\n".join(parts)


def machine_summary() -> str:
    """What the machine was doing: load, memory, and the processes holding the most memory
    and CPU (a hang on 2 cores has been CPU or memory starvation as often as a deadlock)."""
    lines = []
    with contextlib.suppress(OSError):
        lines.append("loadavg: " + Path("/proc/loadavg").read_text().strip())
    with contextlib.suppress(OSError):
        mem = Path("/proc/meminfo").read_text().splitlines()
        lines += [m for m in mem if m.split(":")[0] in ("MemTotal", "MemAvailable", "Cached",
                                                         "Dirty", "SwapTotal", "SwapFree")]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        ps = subprocess.run(["ps", "-eo", "pid,pgid,stat,nlwp,pcpu,rss,etimes,args",
                             "--sort=-rss"], capture_output=True, text=True, timeout=10)
        lines += [row[:200] for row in ps.stdout.splitlines()[:25]]
    return "\n".join(lines)


def write_dump(log_path: Path, pgid: int) -> Path:
    """Write what the machine was doing and every thread of process group ``pgid`` to
    ``<log_path>.hang.txt`` (also to stderr); returns that path."""
    dump = machine_summary() + "\n" + dump_threads(group_pids(pgid))
    path = log_path.with_name(log_path.name + ".hang.txt")
    with contextlib.suppress(OSError):
        path.write_text(dump)
    sys.stderr.write(f"\n[hang-watch] process group {pgid} ({log_path.name}):\n{dump}\n")
    return path


class HangWatch:
    """Probes one running server; declares it hung, dumps and stops it (see the module)."""

    def __init__(self, url: str, pgid: int, log_path: Path, *,
                 limit_seconds: float = UNANSWERED_LIMIT_SECONDS,
                 every_seconds: float = PROBE_EVERY_SECONDS) -> None:
        self._url = url.rstrip("/") + "/metrics"
        self._pgid = pgid
        self._log_path = log_path
        self._limit = limit_seconds
        self._every = every_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"hang-watch-{pgid}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop probing (returns at once; the thread ends within one probe)."""
        self._stop.set()

    def _answered(self) -> bool:
        timeout = min(PROBE_TIMEOUT_SECONDS, self._limit)
        try:
            with urllib.request.urlopen(self._url, timeout=timeout) as resp:
                resp.read()
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError, TimeoutError):
            return False

    def _alive(self) -> bool:
        try:
            os.killpg(self._pgid, 0)
        except ProcessLookupError:
            return False
        return True

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self._every):
            if self._answered():
                last = time.monotonic()
                continue
            if self._stop.is_set() or not self._alive():
                return  # stopped, or exited: the test sees that for itself
            silent = time.monotonic() - last
            if silent >= self._limit:
                self._declare_hung(silent)
                return

    def _declare_hung(self, silent: float) -> None:
        path = write_dump(self._log_path, self._pgid)
        report = HangReport(self._log_path.name, self._pgid, silent, path)
        sys.stderr.write(f"\n[hang-watch] {report.describe()}\n")
        with _HUNG_LOCK:
            HUNG.append(report)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._pgid, signal.SIGKILL)
