"""``register_pages``: the routes that serve the status page, the queue lab and their assets.

The files are read once, when the routes are registered, and served from
memory. Only the files named in ``_PAGES`` and ``_STATIC`` are reachable; no
path from the request ever touches the file system. Every answer carries a
strict Content-Security-Policy (no inline script or style, no third-party
origin), and an ``ETag`` with ``Cache-Control: no-cache`` so that a browser
revalidates (cheaply, 304) and never runs a stale script after an upgrade.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib.resources import files

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)

_PACKAGE = "kvguard.sidecar.pages"
_HTML = "text/html; charset=utf-8"
_PAGES = {"/": "status.html", "/lab": "lab.html"}
_STATIC = {
    "kvguard.css": "text/css; charset=utf-8",
    "status.js": "text/javascript; charset=utf-8",
    "lab.js": "text/javascript; charset=utf-8",
    "dom.js": "text/javascript; charset=utf-8",
    "favicon.svg": "image/svg+xml",
}


@dataclass(frozen=True, slots=True)
class _Asset:
    body: bytes
    media_type: str
    etag: str

    @classmethod
    def load(cls, name: str, media_type: str) -> _Asset:
        body = files(_PACKAGE).joinpath(name).read_bytes()
        return cls(body, media_type, '"' + hashlib.sha256(body).hexdigest()[:20] + '"')

    def respond(self, request: Request) -> Response:
        headers = {
            "Cache-Control": "no-cache",
            "ETag": self.etag,
            "Content-Security-Policy": CONTENT_SECURITY_POLICY,
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
        }
        if request.headers.get("if-none-match") == self.etag:
            return Response(status_code=304, headers=headers)
        return Response(self.body, media_type=self.media_type, headers=headers)


def register_pages(app: FastAPI) -> None:
    """Add ``GET /`` (status page), ``GET /lab`` (queue lab) and ``GET /static/{name}``."""
    pages = {route: _Asset.load(name, _HTML) for route, name in _PAGES.items()}
    static = {name: _Asset.load(name, media_type) for name, media_type in _STATIC.items()}

    @app.get("/", include_in_schema=False)
    def status_page(request: Request) -> Response:
        return pages["/"].respond(request)

    @app.get("/lab", include_in_schema=False)
    def queue_lab(request: Request) -> Response:
        return pages["/lab"].respond(request)

    @app.get("/static/{name}", include_in_schema=False)
    def static_file(name: str, request: Request) -> Response:
        asset = static.get(name)
        if asset is None:
            raise HTTPException(404, "no such static file")
        return asset.respond(request)
