"""The hang watch: a server that stops answering is dumped, stopped and reported.

The server here is a real HTTP server in its own process group (the shape of a vLLM
server: one group, stopped by its pid) that is frozen with SIGSTOP, so that it stops
answering while its process lives, as the hung decode server did. The truth is the
kernel's (the group is gone) and py-spy's (the dump shows the frozen process's own
Python frames, which the watch could not have written itself).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvguard.testing.hang import HangReport, HangWatch, group_pids, take_hung
from kvguard.testing.ports import free_loopback_port

SERVER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
def serve_until_frozen():
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
serve_until_frozen()
"""


def _start(tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_loopback_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)],
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/metrics", timeout=1).read()
            return proc, url
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the test server did not start")


def test_a_server_that_stops_answering_is_dumped_and_stopped_by_its_group(
        tmp_path: Path) -> None:
    proc, url = _start(tmp_path)
    log = tmp_path / "decode.log"
    watch = HangWatch(url, proc.pid, log, limit_seconds=2.0, every_seconds=0.5)
    try:
        watch.start()
        time.sleep(1.5)
        assert take_hung() == []  # answering: not hung
        os.kill(proc.pid, signal.SIGSTOP)  # alive, silent
        deadline = time.monotonic() + 60
        hung: list[HangReport] = []
        while not hung and time.monotonic() < deadline:
            time.sleep(0.5)
            hung = take_hung()
        assert [h.pid for h in hung] == [proc.pid]
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert group_pids(proc.pid) == []
        dump = hung[0].dump_path.read_text()
        assert hung[0].dump_path == tmp_path / "decode.log.hang.txt"
        assert f"pid {proc.pid}" in dump and "MemAvailable" in dump and "loadavg" in dump
        assert "serve_until_frozen" in dump, dump  # py-spy read the frozen process's stack
        assert "decode.log" in hung[0].describe()
    finally:
        watch.stop()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_server_that_answers_or_exits_is_never_declared_hung(tmp_path: Path) -> None:
    proc, url = _start(tmp_path)
    watch = HangWatch(url, proc.pid, tmp_path / "prefill.log", limit_seconds=1.0,
                      every_seconds=0.2)
    watch.start()
    try:
        time.sleep(2.0)
        os.killpg(proc.pid, signal.SIGKILL)  # an exit is the test's to see, not a hang
        proc.wait()
        time.sleep(2.0)
        assert take_hung() == []
    finally:
        watch.stop()
