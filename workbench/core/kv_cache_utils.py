"""Chained prefix hashes of full KV blocks, the keys of the prefix cache.

``hash_block_tokens(parent, tokens) = sha256(parent || int64_le(tokens))`` where ``parent``
is the previous block's 32-byte hash, or :data:`ROOT_HASH` for the first block. Every hash
input is therefore 32 bytes followed by 8 bytes per token, so two blocks share a hash only
when they have the same parent (hence the same whole prefix) and the same tokens.
Python's ``hash()`` is never used: it is salted per process and only 64 bits wide.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH: bytes = hashlib.sha256(b"llm-workbench prefix cache root").digest()
"""The parent hash of a request's first block (32 bytes, like every block hash)."""


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """The 32-byte sha256 of ``parent_hash`` (ROOT_HASH when None) then the token ids as int64 LE."""
    h = hashlib.sha256(ROOT_HASH if parent_hash is None else parent_hash)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def hash_request_blocks(
    token_ids: Sequence[int], block_size: int, parent_hash: bytes | None = None
) -> list[bytes]:
    """The chained hashes of every *full* block of ``token_ids`` (a partial tail is not hashed)."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[start : start + block_size])
        hashes.append(parent_hash)
    return hashes
