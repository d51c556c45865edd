"""One transfer seen from both engines of a P/D pair: the cross-engine verdicts.

Each engine publishes what it saw of its own transfers (:mod:`kvguard.core.transfers`).
A decode engine's record names the prefill engine by its KV-connector id
(``remote_engine_id``) and the prefill engine's request id (``remote_request_id``);
the prefill engine publishes its own KV-connector id (``kv_engine_id``). Joining on
that pair, :func:`link_transfers` says what neither side can say alone:

- ``prefill_holds_for_aborted_decode``: the prefill engine still holds a request's
  blocks although its decode was aborted (the decode side will never read them);
- ``freed_before_read``: the prefill engine freed the blocks when the lease lapsed
  unread, and the decode engine received "the KV" afterwards;
- ``read_not_received``: the prefill engine reports the read done, but the decode
  request was aborted still waiting: the completion was lost on the decode side.

This joins JSON states that a reader already has: one sidecar reading both engines'
state files, ``kvguard report --transfers`` given both run dirs, or, across nodes,
``kvguard report --transfers --sidecar URL --sidecar URL`` reading each node's sidecar
over HTTP (no shared file). Each engine publishes its last 64 ended records, so the join
is for what is recent: read it while the finding is live (the trace spans of
:mod:`kvguard.tracing` keep each side's half for as long as the trace store keeps
traces). It is per request and never becomes a metric label. Times are Unix seconds
from each engine's clock: across machines, clock skew shifts ``freed_before_read``'s
order (NTP keeps it to milliseconds).
"""

from __future__ import annotations

import datetime
import enum
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict

from kvguard.core.state import EngineState
from kvguard.core.transfers import TransferOutcome, TransferRecord, TransferRole, TransfersState

EXPIRED = (TransferOutcome.EXPIRED_UNREAD, TransferOutcome.EXPIRED_PARTLY_READ)


class LinkKind(enum.StrEnum):
    PREFILL_HOLDS_FOR_ABORTED_DECODE = "prefill_holds_for_aborted_decode"
    FREED_BEFORE_READ = "freed_before_read"
    READ_NOT_RECEIVED = "read_not_received"


class TransferLink(BaseModel):
    """One request's transfer joined across its prefill and decode engines."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    kind: LinkKind
    prefill_engine: str
    decode_engine: str
    prefill_request_id: str
    decode_request_id: str
    at: float | None
    """When the decisive event happened (the abort, the late receive)."""
    sentence: str


def _fmt(at: float | None) -> str:
    if at is None:
        return "an unknown time"
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%H:%M:%S UTC")


def link_transfers(states: Mapping[str, EngineState]) -> list[TransferLink]:
    """Every cross-engine verdict in ``states`` (engine name -> its latest state)."""
    return link_transfer_states({name: st.transfers for name, st in states.items()})


def link_transfer_states(transfers: Mapping[str, TransfersState | None]) -> list[TransferLink]:
    """Every cross-engine verdict among engines' transfer states (engine name -> what it
    published of its transfers, ``None`` for an engine without a KV connector).

    The states may come from anywhere: one run dir, several, or the ``transfers`` of
    several sidecars' ``/v1/report`` (one per node): the join needs only each prefill
    engine's ``kv_engine_id`` and each record's ids.
    """
    prefill: dict[tuple[str, str], tuple[str, TransferRecord]] = {}
    for name, t in transfers.items():
        if t is None or t.kv_engine_id is None:
            continue
        for rec in t.records:
            if rec.role is TransferRole.PREFILL:
                prefill[(t.kv_engine_id, rec.request_id)] = (name, rec)
    # One decode per prefill request: the earliest that names it (vLLM's serving layer may
    # admit a second, blockless request with the same parameters to tell the prefill side
    # to let go after an abort).
    decodes: dict[tuple[str, str], tuple[str, TransferRecord]] = {}
    for d_name, dt in sorted(transfers.items()):
        if dt is None:
            continue
        for d in dt.records:
            if d.role is not TransferRole.DECODE or d.remote_engine_id is None \
                    or d.remote_request_id is None:
                continue
            key = (d.remote_engine_id, d.remote_request_id)
            if key in prefill and (key not in decodes or d.started_at < decodes[key][1].started_at):
                decodes[key] = (d_name, d)
    out: list[TransferLink] = []
    for key, (d_name, d) in decodes.items():
        p_name, p = prefill[key]
        link = _judge(p_name, p, d_name, d)
        if link is not None:
            out.append(link)
    return out


def _judge(p_name: str, p: TransferRecord, d_name: str, d: TransferRecord) -> TransferLink | None:
    def link(kind: LinkKind, at: float | None, sentence: str) -> TransferLink:
        return TransferLink(kind=kind, prefill_engine=p_name, decode_engine=d_name,
                            prefill_request_id=p.client_request_id,
                            decode_request_id=d.client_request_id, at=at, sentence=sentence)

    if d.outcome is TransferOutcome.ABORTED_WAITING:
        if p.outcome is TransferOutcome.PENDING:
            return link(LinkKind.PREFILL_HOLDS_FOR_ABORTED_DECODE, d.ended_at,
                        f"prefill engine {p_name} holds blocks for request "
                        f"{p.client_request_id} whose decode on engine {d_name} (request "
                        f"{d.client_request_id}) was aborted at {_fmt(d.ended_at)}")
        if p.outcome is TransferOutcome.READ:
            return link(LinkKind.READ_NOT_RECEIVED, d.ended_at,
                        f"prefill engine {p_name} reports request {p.client_request_id} read "
                        f"at {_fmt(p.ended_at)}, but its decode on engine {d_name} (request "
                        f"{d.client_request_id}) still waited for it when aborted at "
                        f"{_fmt(d.ended_at)}: the completion was lost on the decode side")
    if d.outcome is TransferOutcome.RECEIVED and p.outcome in EXPIRED and \
            p.ended_at is not None and d.ended_at is not None and d.ended_at >= p.ended_at:
        return link(LinkKind.FREED_BEFORE_READ, d.ended_at,
                    f"prefill engine {p_name} freed the blocks of request "
                    f"{p.client_request_id} when its lease lapsed unread at "
                    f"{_fmt(p.ended_at)}; decode engine {d_name} (request "
                    f"{d.client_request_id}) received them at {_fmt(d.ended_at)}: what it "
                    "read may be another request's KV")
    return None
