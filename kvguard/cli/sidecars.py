"""Reading several sidecars over HTTP: one per node, for views that span nodes.

A P/D pair in a fleet runs its prefill and decode engines on different nodes (pods),
each with its own sidecar over its own run dir: no file is shared. The cross-engine
transfer verdicts (:mod:`kvguard.core.transfer_links`) need both engines' transfer
records; each sidecar serves its engines' in ``GET /v1/report`` (``engines[].transfers``).
:func:`read_sidecars` fetches them, and :func:`transfers_by_engine` names each engine
once across all of them.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import NamedTuple
from urllib.parse import urlsplit

from kvguard.core.transfers import TransfersState
from kvguard.errors import ProtocolError, TransportError
from kvguard.sidecar.models import ReportsResponse

TIMEOUT_SECONDS = 10.0
"""Per sidecar: a sidecar answers ``/v1/report`` from memory in milliseconds."""


class SidecarReport(NamedTuple):
    url: str
    """The sidecar's base URL, as given."""
    report: ReportsResponse


def read_sidecars(urls: Sequence[str], *,
                  timeout_seconds: float = TIMEOUT_SECONDS) -> list[SidecarReport]:
    """``GET /v1/report`` from each sidecar, in order.

    Raises :class:`TransportError` naming the first sidecar that cannot be read, or
    :class:`ProtocolError` for one that answers something other than a kvguard report:
    nothing is half-joined.
    """
    out = []
    for url in urls:
        base = url.rstrip("/")
        try:
            with urllib.request.urlopen(f"{base}/v1/report", timeout=timeout_seconds) as resp:
                out.append(SidecarReport(base, ReportsResponse.model_validate_json(resp.read())))
        except (urllib.error.URLError, OSError) as exc:
            raise TransportError(f"cannot read {base}/v1/report ({exc}): is `kvguard sidecar` "
                               "running there, and listening on an address this machine "
                               "reaches (--host)?") from exc
        except ValueError as exc:
            raise ProtocolError(f"{base}/v1/report is not a kvguard report ({exc}); is that "
                               "URL a kvguard sidecar of the same version?") from exc
    return out


def transfers_by_engine(reports: Sequence[SidecarReport]) -> dict[str, TransfersState | None]:
    """Each engine's transfer state, by engine name.

    An engine name that two sidecars both serve (e.g. every pod's default name) is
    qualified with its sidecar's ``host:port`` (``engine@host:port``) so that neither
    hides the other.
    """
    counts: dict[str, int] = {}
    for r in reports:
        for e in r.report.engines:
            counts[e.engine] = counts.get(e.engine, 0) + 1
    out: dict[str, TransfersState | None] = {}
    for r in reports:
        where = urlsplit(r.url).netloc or r.url
        for e in r.report.engines:
            name = e.engine if counts[e.engine] == 1 else f"{e.engine}@{where}"
            out[name] = e.transfers
    return out
