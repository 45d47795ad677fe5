"""Chained prefix hashes of full KV blocks, the keys of the prefix cache.

``hash_block_tokens(parent, tokens) = sha256(parent || int64_le(tokens))`` where ``parent``
is the previous block's 32-byte hash, or :data:`ROOT_HASH` for the first block. Every hash
input is therefore 32 bytes followed by 8 bytes per token, so two blocks share a hash only
when they have the same parent (hence the same whole prefix) and the same tokens.
Extra keys (vLLM's name; here a request's ``cache_salt``, on its first block only) follow the
tokens, each as uint32_le(length) || UTF-8: a salted block's input is longer than any
unsalted one of the same block size, and two different salts never give the same input, so
salted requests share no block with unsalted ones or with other salts (CVE-2025-46570's fix).
A request under a LoRA adapter adds two keys to *every* block, ``"lora"`` and the adapter's
name (vLLM keys by ``lora_name``), before any salt: a block's key count (0 plain, 1 salt,
2 adapter, 3 both) is part of the unambiguous length-prefixed input, so no block is shared
between two adapters, nor between an adapter and the base model, whatever the salts.
Python's ``hash()`` is never used: it is salted per process and only 64 bits wide.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Callable, Sequence

ROOT_HASH: bytes = hashlib.sha256(b"llm-workbench prefix cache root").digest()
"""The parent hash of a request's first block (32 bytes, like every block hash)."""


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int],
                      extra_keys: Sequence[str] = ()) -> bytes:
    """The 32-byte sha256 of ``parent_hash`` (ROOT_HASH when None), the token ids as int64 LE,
    then each extra key length-prefixed. (One ``sha256(data)`` of the joined bytes, packed by
    a compiled ``Struct``: half the time of building the format and feeding the hash piece by
    piece, once per full block of every request.)"""
    data = (ROOT_HASH if parent_hash is None else parent_hash) + _int64_le(len(token_ids))(*token_ids)
    return hashlib.sha256(data + _encode_keys(extra_keys) if extra_keys else data).digest()


def hash_block_run(parent_hash: bytes | None, token_ids: Sequence[int], block_size: int,
                   first_index: int = 0, cache_salt: str | None = None,
                   lora_name: str | None = None) -> list[bytes]:
    """The chained hashes of the full blocks of ``token_ids`` (a partial tail is not hashed),
    whose first is the request's block ``first_index``, chained on ``parent_hash``: the
    i-th equals ``hash_block_tokens(parent, block, block_extra_keys(first_index + i, ...))``.
    One packer and one encoding of the extra keys serve the whole run (a request's new
    blocks are hashed once each, as they fill)."""
    pack = _int64_le(block_size)
    later_keys = _encode_keys(block_extra_keys(1, None, lora_name)) if lora_name else b""  # no salt after block 0
    parent = ROOT_HASH if parent_hash is None else parent_hash
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        keys = later_keys if first_index or start else _encode_keys(block_extra_keys(0, cache_salt, lora_name))
        parent = hashlib.sha256(parent + pack(*token_ids[start:start + block_size]) + keys).digest()
        hashes.append(parent)
    return hashes


def _encode_keys(extra_keys: Sequence[str]) -> bytes:
    """The extra keys as hashed: each one uint32_le(length of its UTF-8) || its UTF-8."""
    encoded = [key.encode() for key in extra_keys]
    return b"".join([struct.pack("<I", len(e)) + e for e in encoded])


@functools.cache
def _int64_le(n: int) -> Callable[..., bytes]:
    """The packer of ``n`` int64 little-endian values (compiled once per block size)."""
    return struct.Struct(f"<{n}q").pack


def block_extra_keys(block_index: int, cache_salt: str | None,
                     lora_name: str | None = None) -> tuple[str, ...]:
    """The extra keys of a request's block ``block_index``: ``("lora", name)`` on every block
    of a LoRA request, then its salt on the first block only (the later ones inherit it
    through their parent hash), as vLLM."""
    lora = ("lora", lora_name) if lora_name else ()
    return lora + (cache_salt,) if block_index == 0 and cache_salt else lora


def hash_request_blocks(
    token_ids: Sequence[int], block_size: int, parent_hash: bytes | None = None,
    cache_salt: str | None = None, lora_name: str | None = None,
) -> list[bytes]:
    """The chained hashes of every *full* block of ``token_ids`` (a partial tail is not hashed)."""
    return hash_block_run(parent_hash, token_ids, block_size, 0, cache_salt, lora_name)
