"""Block keys and an exact, order-free digest of a set of them.

A **block key** names one hashed block the way KV events name it: the KV cache group and the
block hash as published (vLLM's ``ExternalBlockHash``: the prefix hash itself as bytes, or
its low 64 bits as an int with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``). These are hashes,
never token ids: a key carries nothing from which a prompt can be read back.

Canonical text form (``block_key``): ``"<group>:<hex>"`` for bytes hashes, ``"<group>:#<int>"``
for int hashes, ``group`` 0 when an event carries none. Engine and sidecar both build keys
with this one function, so equal blocks give equal keys.

The **digest** of a set is the sum, modulo 2**128, of a 128-bit BLAKE2b of each key. Sums do
not depend on order and update in O(1) per added or removed key; two sets with the same count
and digest are equal except with probability about 2**-128 per comparison.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

DIGEST_BITS = 128
_MOD = 1 << DIGEST_BITS


def block_key(group_idx: int | None, block_hash: bytes | int) -> str:
    """The canonical key of one hashed block (see the module docstring)."""
    g = group_idx or 0
    if isinstance(block_hash, bytes):
        return f"{g}:{block_hash.hex()}"
    return f"{g}:#{int(block_hash)}"


def key_term(key: str) -> int:
    """One key's term in the digest (128 bits)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=16).digest(), "big")


class SetDigest:
    """Count and order-free digest of a set of block keys, kept up to date by ``add``/``remove``.

    The caller guarantees set semantics: ``add`` only keys not in the set, ``remove`` only keys
    in it (the mirror checks membership first).
    """

    __slots__ = ("count", "value")

    def __init__(self, keys: Iterable[str] = ()) -> None:
        self.count = 0
        self.value = 0
        for k in keys:
            self.add(k)

    def add(self, key: str) -> None:
        self.count += 1
        self.value = (self.value + key_term(key)) % _MOD

    def remove(self, key: str) -> None:
        self.count -= 1
        self.value = (self.value - key_term(key)) % _MOD

    def clear(self) -> None:
        self.count = 0
        self.value = 0

    @property
    def hex(self) -> str:
        """The digest as 32 hex digits (how it is published)."""
        return f"{self.value:032x}"


def digest_hex(keys: Iterable[str]) -> str:
    """The digest of ``keys`` (a set: no key twice) as published."""
    return SetDigest(keys).hex
