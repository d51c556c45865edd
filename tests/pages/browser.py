"""A real headless Chromium (the system's, no download) on a real sidecar, for page tests.

Reusable outside this directory (e.g. a test that drives a real engine leak
into the status page)::

    from browser import browser_page, serve_sidecar

    with serve_sidecar(run_dir) as url, browser_page(tmp_path / "profile") as page:
        page.goto(url + "/")

(``launch_chromium`` once per module plus ``open_page`` per test is faster:
a launch takes about a second.)

``browser_page`` fails the test when the page logged a JavaScript error or a
Content-Security-Policy violation, so a page that silently broke is not
mistaken for one that shows nothing.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from playwright.sync_api import BrowserContext, ConsoleMessage, Error, Page, sync_playwright

from kvguard.sidecar.app import create_app
from kvguard.sidecar.store import EngineStore

CHROMIUM = os.environ.get("KVGUARD_TEST_CHROMIUM", "/usr/bin/chromium")
"""The system browser. Playwright's own browser download is never used."""

CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--no-first-run",
]

SCREENSHOTS_ENV = "KVGUARD_SCREENSHOTS"
"""Directory to save page screenshots into (for a person to look at); unset: none."""


@contextmanager
def serve_sidecar(run_dir: Path, *, poll_interval_seconds: float = 0.1,
                  control_token: str | None = None) -> Iterator[str]:
    """Serve ``create_app`` on a free loopback port; yield its base URL (no trailing slash)."""
    store = EngineStore(run_dir)
    app = create_app(store, control_token=control_token,
                     poll_interval_seconds=poll_interval_seconds)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name=f"sidecar-{port}", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the sidecar did not start")
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@dataclass  # not slots: Playwright caches a wrapper on bound-method handlers
class PageProblems:
    """What the page reported that a user would never see but a test must."""

    errors: list[str] = field(default_factory=list)

    def on_console(self, msg: ConsoleMessage) -> None:
        # CSP violations and failed loads surface as console errors.
        if msg.type == "error":
            self.errors.append(f"console: {msg.text}")

    def on_page_error(self, err: Error) -> None:
        self.errors.append(f"uncaught: {err.message}")


@contextmanager
def launch_chromium(user_data_dir: Path) -> Iterator[BrowserContext]:
    """The system Chromium, headless, with ``user_data_dir`` as its (fresh) profile."""
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(user_data_dir), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900}, timezone_id="UTC", locale="en-US",
            service_workers="block")
        try:
            yield context
        finally:
            context.close()


@contextmanager
def open_page(context: BrowserContext, *, allow_errors: bool = False) -> Iterator[Page]:
    """A new page (tab) in ``context``, closed at exit.

    Raises ``AssertionError`` at exit if the page logged an error (unless
    ``allow_errors``): a blocked script or a CSP violation must fail the test.
    """
    problems = PageProblems()
    page = context.new_page()
    page.on("console", problems.on_console)
    page.on("pageerror", problems.on_page_error)
    page.set_default_timeout(10_000)
    try:
        yield page
    finally:
        page.close()
    if problems.errors and not allow_errors:
        raise AssertionError("the page reported errors:\n" + "\n".join(problems.errors))


@contextmanager
def browser_page(user_data_dir: Path, *, allow_errors: bool = False) -> Iterator[Page]:
    """One page in its own fresh browser: ``launch_chromium`` and ``open_page`` together."""
    with launch_chromium(user_data_dir) as context, \
            open_page(context, allow_errors=allow_errors) as page:
        yield page


def maybe_screenshot(page: Page, name: str) -> Path | None:
    """Save a full-page screenshot as ``$KVGUARD_SCREENSHOTS/<name>.png`` when that is set."""
    target = os.environ.get(SCREENSHOTS_ENV)
    if not target:
        return None
    path = Path(target) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=True)
    return path
