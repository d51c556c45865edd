"""The sidecar's FastAPI application (design.md section 7, "Sidecar HTTP")."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

from fastapi import Depends, FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvguard.config import ENGINE_NAME_PATTERN
from kvguard.core.drain_model import DrainPrediction
from kvguard.core.transfer_links import link_transfers
from kvguard.sidecar.metrics import KvguardCollector
from kvguard.sidecar.models import (
    CheckpointRequestResponse,
    CheckpointsResponse,
    DrainView,
    EngineReport,
    ErrorResponse,
    Health,
    ReportsResponse,
    TrendReport,
)
from kvguard.sidecar.pages.routes import register_pages
from kvguard.sidecar.readiness import Readiness, readiness
from kvguard.sidecar.store import EngineStore
from kvguard.transport.control import write_request
from kvguard.version import __version__

_ENGINE_NAME = ENGINE_NAME_PATTERN
_log = logging.getLogger("kvguard.sidecar")


def _drain_view(d: DrainPrediction | None) -> DrainView | None:
    if d is None:
        return None
    return DrainView(at=d.at, arrival_rate_per_s=d.arrival_rate_per_s,
                     completion_rate_per_s=d.completion_rate_per_s, backlog=d.backlog,
                     drains=d.drains, eta_seconds=d.eta_seconds if d.drains else None,
                     explanation=d.explanation)


def create_app(store: EngineStore, *, control_token: str | None = None,
               poll_interval_seconds: float = 0.5) -> FastAPI:
    """Build the app. ``store`` is read once at start-up, before any request is
    served, then refreshed every ``poll_interval_seconds`` while it runs."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        failed = False

        async def refresh() -> None:
            nonlocal failed
            try:
                await asyncio.to_thread(store.refresh)
            except Exception as exc:  # the refresh task must outlive any bad input
                if not failed:
                    _log.error("kvguard sidecar: refresh failed (%s); retrying", exc,
                               exc_info=exc)
                failed = True

        async def poll() -> None:
            while True:
                await asyncio.sleep(poll_interval_seconds)
                await refresh()

        # The state files are read once before the first request is served: a
        # sidecar that has just (re)started must not answer its first scrape with
        # no engines, which Prometheus would record as every kvguard series gone.
        await refresh()
        task = asyncio.create_task(poll())
        try:
            yield
        finally:
            task.cancel()

    app = FastAPI(title="kvguard sidecar", version=__version__, lifespan=lifespan,
                  description="KV-cache block ownership reports and metrics for vLLM engines.")
    registry = CollectorRegistry(auto_describe=False)  # only kvguard's families, read per scrape
    registry.register(KvguardCollector(store))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """Every rejection is JSON ``{"detail": ...}``; a 405 lists every method of the path.

        Starlette answers 405 with the methods of the first route whose path
        matches, so ``/v1/checkpoints`` would advertise ``GET`` only.
        """
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            methods: set[str] = set()
            for route in app.router.routes:
                regex = getattr(route, "path_regex", None)
                if regex is not None and regex.match(request.url.path):
                    methods |= set(getattr(route, "methods", None) or ())
            if methods:
                headers["Allow"] = ", ".join(sorted(methods))
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code,
                            headers=headers)

    def require_token(authorization: Annotated[str | None, Header()] = None) -> None:
        if control_token is None:
            return
        if authorization is None:
            raise HTTPException(401, "this endpoint needs 'Authorization: Bearer <token>' "
                                     "(the sidecar has KVGUARD_CONTROL_TOKEN set)")
        scheme, _, given = authorization.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(),
                                                                 control_token.encode()):
            raise HTTPException(403, "wrong control token")

    @app.get("/metrics", response_class=Response, summary="Prometheus metrics",
             responses={200: {"content": {"text/plain": {}}}})
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz", response_model=Health)
    def healthz() -> Health:
        return Health(status="ok", engines=len(store.engines),
                      engines_up=sum(store.is_up(v) for v in store.engines.values()),
                      read_errors=dict(store.read_errors))

    @app.get("/v1/ready", response_model=Readiness,
             responses={503: {"model": Readiness, "description": "Not ready: no engine "
                              "state yet, an engine's state is stale, or an engine is wedged"}},
             summary="Readiness: 503 while an engine is wedged or silent, never for load")
    def ready() -> Response:
        r = readiness(store)
        return JSONResponse(r.model_dump(mode="json"), status_code=200 if r.ready else 503)

    @app.get("/v1/report", response_model=ReportsResponse,
             summary="Latest checkpoint report and trend per engine")
    def report() -> ReportsResponse:
        out = []
        for name, view in sorted(store.engines.items()):
            t = view.trend
            kv_checks = store.kv_events.checks if store.kv_events is not None else {}
            latest = next((r for r in reversed(view.history) if r.epoch == view.state.epoch),
                          None)
            out.append(EngineReport(
                engine=name, epoch=view.state.epoch, up=store.is_up(view),
                hook_errors_total=view.state.hook_errors_total,
                faults_enabled=list(view.state.faults_enabled), latest=latest,
                drain=_drain_view(view.state.drain), online=view.state.online,
                transfers=view.state.transfers, cost=view.state.cost,
                kv_events=kv_checks.get(name), offload=view.state.offload,
                wedge=view.state.wedge, reclaim=view.state.reclaim,
                hooks_missing=list(view.state.hooks_missing),
                trend=TrendReport(verdict=t.verdict, checkpoints=t.checkpoints,
                                  holding_series=list(t.holding_series),
                                  explanation=t.explanation)))
        links = link_transfers({n: v.state for n, v in store.engines.items()})
        return ReportsResponse(engines=out, transfer_links=links)

    @app.get("/v1/checkpoints", response_model=CheckpointsResponse,
             responses={404: {"model": ErrorResponse}},
             summary="Checkpoint history, oldest first")
    def checkpoints(
        engine: Annotated[str | None, Query(pattern=_ENGINE_NAME)] = None,
        limit: Annotated[int, Query(ge=1, le=10_000)] = 100,
        epoch: Annotated[str | None, Query(pattern=_ENGINE_NAME,
                                           description="Only this engine run (each report "
                                                       "carries its epoch).")] = None,
    ) -> CheckpointsResponse:
        if engine is not None and engine not in store.engines:
            raise HTTPException(404, f"no engine named {engine!r}; known: "
                                     f"{sorted(store.engines) or 'none yet'}")
        return CheckpointsResponse(checkpoints=store.checkpoints(engine, limit, epoch=epoch))

    @app.post("/v1/checkpoints", response_model=CheckpointRequestResponse, status_code=202,
              dependencies=[Depends(require_token)],
              responses={401: {"model": ErrorResponse}, 403: {"model": ErrorResponse},
                         404: {"model": ErrorResponse}},
              summary="Ask engines for a checkpoint at their next drained moment")
    def request_checkpoint(
        engine: Annotated[str | None, Query(pattern=_ENGINE_NAME)] = None,
    ) -> CheckpointRequestResponse:
        if engine is not None and engine not in store.engines:
            raise HTTPException(404, f"no engine named {engine!r}; known: "
                                     f"{sorted(store.engines) or 'none yet'}")
        names = [engine] if engine else sorted(store.engines)
        for name in names:
            write_request(store.run_dir, name)
        return CheckpointRequestResponse(
            requested=names,
            note="each engine checkpoints at its next drained moment, or reports 'skipped' "
                 "with the reason; an idle engine takes it within about a second")

    register_pages(app)
    return app
