"""vLLM's KV-event wire format, decoded without vLLM (the sidecar's image has no vLLM, no torch).

One ZMQ message per batch: ``(topic, seq, payload)``, ``seq`` 8 bytes big-endian, ``payload``
the msgpack of a ``KVEventBatch`` (``vllm.distributed.kv_events``, encoded by msgspec):

* the batch is an **array** (``array_like``; trailing fields equal to their default are
  omitted): ``[ts, events, data_parallel_rank?]``;
* each event is a msgspec **tagged** struct, tag field ``"type"``, tag the class name
  (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), in one of two forms:

  - a **map** (vLLM 0.32 to 0.34, whose ``KVCacheEvent`` is not ``array_like``):
    ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": h | None,
    "token_ids": [...], "block_size": n, "lora_id": ..., "medium": "GPU", ...,
    "group_idx": g}``, fields equal to their default (``group_idx`` None, ...) omitted;
  - an **array** (the schema of vLLM's ``examples/online_serving/kv_events_subscriber.py``,
    ``array_like=True``): ``["BlockStored", block_hashes, parent_block_hash, token_ids,
    block_size, lora_id, medium, lora_name, extra_keys, group_idx, ...]``,
    ``["BlockRemoved", block_hashes, medium, group_idx, ...]``, ``["AllBlocksCleared"]``.

A block hash is msgpack ``bin`` (bytes: vLLM's ``ExternalBlockHash``) or an int (with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``). Fields kvguard does not use (``extra_keys``,
``lora_name``, ``locality``, newer ones) and event types it does not know are skipped, so a
newer vLLM that adds either still decodes. Token ids are counted and dropped here: nothing
decoded keeps them (:class:`~kvguard.kv_events.mirror.Stored` holds their number only).

``tests/kv_events/test_wire.py`` checks this against batches from vLLM's own
``ZmqEventPublisher`` and the documented array schema, with vLLM and torch unimportable.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import msgspec

from kvguard.errors import ProtocolError
from kvguard.kv_events.digest import block_key
from kvguard.kv_events.mirror import Cleared, Event, Removed, Stored

STORED: Final = "BlockStored"
REMOVED: Final = "BlockRemoved"
CLEARED: Final = "AllBlocksCleared"

_STORED_FIELDS: Final = ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                         "lora_id", "medium", "lora_name", "extra_keys", "group_idx")
"""``BlockStored``'s fields in declaration order: their positions in the array form."""
_REMOVED_FIELDS: Final = ("block_hashes", "medium", "group_idx")

_decoder: Final = msgspec.msgpack.Decoder()
"""Untyped: msgpack arrays, maps, bytes, ints, strings (stateless, safe to share)."""


def decode_batch(payload: bytes) -> list[Event]:
    """One batch payload as mirror events, in order (see the module docstring).

    Raises :class:`~kvguard.errors.ProtocolError` when the payload is not a ``KVEventBatch``
    (not msgpack, not an array with a list of events, a known event with a field of the wrong
    type)."""
    try:
        batch = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"a KV-event batch is not msgpack: {exc}") from exc
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ProtocolError("a KV-event batch is not [ts, events, ...] (vLLM's KVEventBatch)")
    out: list[Event] = []
    for raw in batch[1]:
        ev = _event(raw)
        if ev is not None:
            out.append(ev)
    return out


def _event(raw: object) -> Event | None:
    """One event, or None for an event type kvguard does not know."""
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        names = _STORED_FIELDS if kind == STORED else _REMOVED_FIELDS
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise ProtocolError(f"a KV event is neither a map nor an array: {type(raw).__name__}")
    try:
        if kind == STORED:
            group = _opt_int(fields.get("group_idx"))
            parent = fields.get("parent_block_hash")
            return Stored(_keys(group, fields["block_hashes"]),
                          None if parent is None else block_key(group, _hash(parent)),
                          len(fields.get("token_ids") or ()), _opt_str(fields.get("medium")))
        if kind == REMOVED:
            group = _opt_int(fields.get("group_idx"))
            return Removed(_keys(group, fields["block_hashes"]), _opt_str(fields.get("medium")))
    except KeyError as exc:
        raise ProtocolError(f"a {kind} event has no {exc.args[0]}") from exc
    if kind == CLEARED:
        return Cleared()
    return None


def _keys(group: int | None, hashes: Any) -> list[str]:
    if not isinstance(hashes, Sequence) or isinstance(hashes, (bytes, str)):
        raise ProtocolError(f"block_hashes is not a list: {type(hashes).__name__}")
    return [block_key(group, _hash(h)) for h in hashes]


def _hash(h: object) -> bytes | int:
    if isinstance(h, (bytes, int)) and not isinstance(h, bool):
        return h
    raise ProtocolError(f"a block hash is neither bytes nor an int: {type(h).__name__}")


def _opt_int(v: object) -> int | None:
    if v is None or (isinstance(v, int) and not isinstance(v, bool)):
        return v
    raise ProtocolError(f"group_idx is not an int: {type(v).__name__}")


def _opt_str(v: object) -> str | None:
    if v is None or isinstance(v, str):
        return v
    raise ProtocolError(f"medium is not a string: {type(v).__name__}")
