"""Content hashes of full KV blocks, the keys of the prefix cache.

A block's hash covers its token ids and, through its parent's hash, every token
before it, so equal hashes mean equal prefixes and therefore equal KV. A
request's ``cache_salt`` enters the first block's hash, so requests with
different salts never share a block. SHA-256 keeps collisions (which would let
one request read another's KV) out of reach.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def hash_block(parent: bytes | None, token_ids: Sequence[int], salt: str | None = None) -> bytes:
    h = hashlib.sha256()
    if parent is None:
        h.update(b"root" if salt is None else b"salt:" + salt.encode("utf-8", "surrogatepass"))
    else:
        h.update(parent)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], num_tokens: int,
                        block_size: int, salt: str | None = None) -> list[bytes]:
    """Append to ``hashes`` the hashes of the full blocks among the first
    ``num_tokens`` of ``token_ids`` it does not cover yet; returns ``hashes``."""
    for i in range(len(hashes), num_tokens // block_size):
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], salt))
    return hashes
