"""``kvguard report --transfers``: each P/D transfer joined across its engines, for people.

One block per transfer (:class:`~kvguard.core.transfer_links.JoinedTransfer`), oldest
first: the prefill side (engine, request, outcome, when the hold began, the lease's end,
when the hold ended: the read, or the lapse), the decode side (engine, request, outcome,
when it was admitted, when the KV arrived or the wait ended), each hazard the prefill
engine reported for it (when the blocks were freed, when the late read was reported) and
the cross-engine verdict. A side kvguard has no record of is printed as unknown, never
guessed. Times are UTC with milliseconds, each from its own engine's clock. Ids, times and
outcomes only: never prompts or token ids.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

from kvguard.core.transfer_links import JoinedTransfer, TransferLink
from kvguard.core.transfers import TransferOutcome, TransferRecord

_ENDED = {TransferOutcome.READ: "read", TransferOutcome.RECEIVED: "received",
          TransferOutcome.EXPIRED_UNREAD: "lapsed", TransferOutcome.EXPIRED_PARTLY_READ: "lapsed"}
"""What the end of a hold or a wait was, by outcome (else ``ended``)."""


def clock(at: float | None) -> str:
    """Unix seconds as ``HH:MM:SS.mmm`` UTC; ``?`` when unknown."""
    if at is None:
        return "?"
    return datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%H:%M:%S.%f")[:-3]


def _side(label: str, engine: str | None, rec: TransferRecord | None) -> str:
    if rec is None:
        return f"  {label:<8}{engine or '?'}: no record (engine not read, or record rolled off)"
    out = [f"  {label:<8}{engine}: request {rec.client_request_id} ({rec.request_id}) "
           f"{rec.outcome.value}", f"started {clock(rec.started_at)}"]
    if rec.hold_deadline is not None:
        out.append(f"lease until {clock(rec.hold_deadline)}")
    if rec.ended_at is not None:
        out.append(f"{_ENDED.get(rec.outcome, 'ended')} {clock(rec.ended_at)}")
    if rec.reads is not None:
        out.append(f"reads {rec.reads}")
    return ", ".join(out)


def render_joined(joined: JoinedTransfer) -> str:
    """One transfer's block: a head line, both sides, its hazards and its finding."""
    p, d = joined.prefill, joined.decode
    rid = p.client_request_id if p is not None else d.client_request_id if d is not None \
        else joined.hazards[0].client_request_id
    verdict = joined.link.kind.value.upper() if joined.link is not None else (
        "HAZARD" if joined.hazards else "not judged (a later decode naming the same prefill "
        "request: vLLM's clean-up after an abort)" if joined.repeat else "no finding")
    prefill_engine = joined.prefill_engine or (
        f"KV id {joined.kv_engine_id}" if joined.kv_engine_id is not None else None)
    lines = [f"transfer {rid}: {verdict}", _side("prefill", prefill_engine, p),
             _side("decode", joined.decode_engine, d)]
    for hz in joined.hazards:
        lines.append(f"  hazard  {hz.kind.value}: blocks freed {clock(hz.freed_at)}, late read "
                     f"reported {clock(hz.read_at)} by the prefill engine: {hz.detail}")
    if joined.link is not None:
        lines.append(f"  finding {joined.link.kind.value}: {joined.link.sentence}")
    return "\n".join(lines)


def render_transfers(joined: Sequence[JoinedTransfer], links: Sequence[TransferLink]) -> str:
    """The whole view: every transfer, then the findings (or that there are none)."""
    if not joined:
        return ("no KV transfer in the engines' states (no KV connector, or nothing "
                "transferred yet)\nno cross-engine transfer finding")
    head = (f"{len(joined)} transfer(s), times UTC (each engine's clock); "
            f"{len(links)} cross-engine finding(s)")
    return "\n\n".join([head, *(render_joined(j) for j in joined)])
