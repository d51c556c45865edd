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

:func:`join_transfer_states` gives the joined view itself, one :class:`JoinedTransfer` per
transfer: both engines' records side by side (the prefill's lease deadline and when its
hold ended, the decode's start and receipt), the prefill engine's hazards for it, and the
verdict above when there is one. A side kvguard has no record of (an engine not read, or
a record past the last 64) is ``None``: the view never invents it.

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
from kvguard.core.transfers import (
    TransferHazard,
    TransferOutcome,
    TransferRecord,
    TransferRole,
    TransfersState,
)

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


class JoinedTransfer(BaseModel):
    """One transfer as both of its engines saw it (either side may be unknown).

    Invariant: at least one of ``prefill``, ``decode`` and ``hazards`` is there; a decode
    record is joined to the prefill record its ``remote_engine_id`` and
    ``remote_request_id`` name, and only the earliest decode naming a prefill request is
    judged (``link``). Times are Unix seconds from each engine's own clock.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    kv_engine_id: str | None
    """The prefill engine's KV-connector id (the join key with the prefill request id)."""
    prefill_engine: str | None
    prefill: TransferRecord | None
    """The prefill side: its ``hold_deadline`` is the lease, ``ended_at`` when the hold ended
    (read, or lapsed)."""
    decode_engine: str | None
    decode: TransferRecord | None
    """The decode side: ``ended_at`` is when the KV arrived (``received``) or the wait ended."""
    hazards: list[TransferHazard]
    """The prefill engine's hazards for this request (a read after the lease lapsed)."""
    link: TransferLink | None
    """The cross-engine verdict, if any."""
    repeat: bool = False
    """A later decode naming a prefill request that an earlier decode named (vLLM's
    blockless clean-up request after an abort): shown, not judged."""

    @property
    def first_at(self) -> float:
        """The earliest time the view knows of (for ordering)."""
        times = [r.started_at for r in (self.prefill, self.decode) if r is not None]
        times.extend(h.read_at for h in self.hazards)
        return min(times)


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
    prefill, decodes = _index(transfers)
    out: list[TransferLink] = []
    for key, (d_name, d) in decodes.items():
        p_name, p = prefill[key]
        link = _judge(p_name, p, d_name, d)
        if link is not None:
            out.append(link)
    return out


_Side = tuple[str, TransferRecord]
_Key = tuple[str, str]
"""(prefill engine's KV-connector id, prefill request id)."""


def _index(transfers: Mapping[str, TransfersState | None]
           ) -> tuple[dict[_Key, _Side], dict[_Key, _Side]]:
    """The prefill records by key, and the decode record judged for each (the earliest
    that names a known prefill record)."""
    prefill: dict[_Key, _Side] = {}
    for name, t in transfers.items():
        if t is None or t.kv_engine_id is None:
            continue
        for rec in t.records:
            if rec.role is TransferRole.PREFILL:
                prefill[(t.kv_engine_id, rec.request_id)] = (name, rec)
    # One decode per prefill request: the earliest that names it (vLLM's serving layer may
    # admit a second, blockless request with the same parameters to tell the prefill side
    # to let go after an abort).
    decodes: dict[_Key, _Side] = {}
    for d_name, d in _decode_records(transfers):
        key = _key_of(d)
        if key in prefill and (key not in decodes or d.started_at < decodes[key][1].started_at):
            decodes[key] = (d_name, d)
    return prefill, decodes


def _key_of(decode: TransferRecord) -> _Key | None:
    """The prefill side a decode record names, or None when it names none."""
    if decode.remote_engine_id is None or decode.remote_request_id is None:
        return None
    return (decode.remote_engine_id, decode.remote_request_id)


def _decode_records(transfers: Mapping[str, TransfersState | None]) -> list[_Side]:
    """Every decode record, by engine name, then as each engine lists them."""
    return [(name, d) for name, t in sorted(transfers.items()) if t is not None
            for d in t.records if d.role is TransferRole.DECODE]


def join_transfer_states(transfers: Mapping[str, TransfersState | None]
                         ) -> list[JoinedTransfer]:
    """Every transfer the engines published, joined across them, oldest first: each
    prefill record with every decode record that names it, each decode record whose
    prefill side is not there alone, and a hazard whose record has rolled off alone."""
    prefill, judged = _index(transfers)
    hazards: dict[tuple[str, str], list[TransferHazard]] = {}
    for name, t in transfers.items():
        for hz in t.hazards if t is not None else ():
            hazards.setdefault((name, hz.request_id), []).append(hz)
    out: list[JoinedTransfer] = []

    def row(key: _Key | None, p: _Side | None, d: _Side | None) -> JoinedTransfer:
        # The prefill's hazards go with its judged decode (or with it alone).
        main = p is not None and (d is None or (key is not None and key in judged
                                                and judged[key][1] is d[1]))
        return JoinedTransfer(
            kv_engine_id=key[0] if key is not None else None,
            prefill_engine=p[0] if p else None, prefill=p[1] if p else None,
            decode_engine=d[0] if d else None, decode=d[1] if d else None,
            hazards=hazards.pop((p[0], p[1].request_id), []) if p and main else [],
            link=_judge(p[0], p[1], d[0], d[1]) if p and d and main else None,
            repeat=p is not None and not main)

    for d in _decode_records(transfers):
        key = _key_of(d[1])
        out.append(row(key, prefill.get(key) if key is not None else None, d))
    for key, p in prefill.items():
        if key not in judged:
            out.append(row(key, p, None))
    for (name, _), hzs in hazards.items():  # their transfer's record has rolled off
        t = transfers.get(name)
        out.append(JoinedTransfer(kv_engine_id=t.kv_engine_id if t is not None else None,
                                  prefill_engine=name, prefill=None, decode_engine=None,
                                  decode=None, hazards=hzs, link=None))
    return sorted(out, key=lambda j: j.first_at)


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
