"""Chained prefix hashes of full KV blocks, the keys of the prefix cache.

``hash_block_tokens(parent, tokens) = sha256(parent || int64_le(tokens))`` where ``parent``
is the previous block's 32-byte hash, or :data:`ROOT_HASH` for the first block. Every hash
input is therefore 32 bytes followed by 8 bytes per token, so two blocks share a hash only
when they have the same parent (hence the same whole prefix) and the same tokens.
Extra keys (vLLM's name; here a request's ``cache_salt``, on its first block only) follow the
tokens, each as uint32_le(length) || UTF-8: a salted block's input is longer than any
unsalted one of the same block size, and two different salts never give the same input, so
salted requests share no block with unsalted ones or with other salts (CVE-2025-46570's fix).
Python's ``hash()`` is never used: it is salted per process and only 64 bits wide.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH: bytes = hashlib.sha256(b"llm-workbench prefix cache root").digest()
"""The parent hash of a request's first block (32 bytes, like every block hash)."""


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int],
                      extra_keys: Sequence[str] = ()) -> bytes:
    """The 32-byte sha256 of ``parent_hash`` (ROOT_HASH when None), the token ids as int64 LE,
    then each extra key length-prefixed."""
    h = hashlib.sha256(ROOT_HASH if parent_hash is None else parent_hash)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    for key in extra_keys:
        data = key.encode()
        h.update(struct.pack("<I", len(data)) + data)
    return h.digest()


def block_extra_keys(block_index: int, cache_salt: str | None) -> tuple[str, ...]:
    """The extra keys of a request's block ``block_index``: its salt on the first block only
    (the later ones inherit it through their parent hash), as vLLM."""
    return (cache_salt,) if block_index == 0 and cache_salt else ()


def hash_request_blocks(
    token_ids: Sequence[int], block_size: int, parent_hash: bytes | None = None,
    cache_salt: str | None = None,
) -> list[bytes]:
    """The chained hashes of every *full* block of ``token_ids`` (a partial tail is not hashed)."""
    hashes: list[bytes] = []
    for i, start in enumerate(range(0, len(token_ids) - block_size + 1, block_size)):
        parent_hash = hash_block_tokens(parent_hash, token_ids[start : start + block_size],
                                        block_extra_keys(i, cache_salt))
        hashes.append(parent_hash)
    return hashes
