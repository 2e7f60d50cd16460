"""Prefix-cache keys: a chained hash over blocks of G tokens, salted at the root.

    root = H("kvarn-apc" | version | layout stamp | model fingerprint | cache_salt)
    h_0  = H(root | tokens[0:G])        h_i = H(h_{i-1} | tokens[i*G:(i+1)*G])

A block's key therefore names every token before it, under one layout and one model, for one
salt: equal keys mean equal prefixes (up to a hash collision, which the store rules out by also
comparing the token ids it keeps). BLAKE2b-128 over little-endian uint32 token ids is stable
across processes, machines and restarts (unlike Python's ``hash``). Pure Python: no MLX.

The last prompt token is never served from cache (its logits are needed to sample), so a prompt
of n tokens may reuse at most ``(n - 1) // G`` whole blocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

KEY_VERSION = 1
DIGEST_BYTES = 16


def digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))  # length-prefixed: no two part lists collide by joining
        h.update(part)
    return h.digest()


def token_bytes(tokens: Sequence[int]) -> bytes:
    """Little-endian uint32 ids (``struct.error`` for an id outside uint32)."""
    return struct.pack(f"<{len(tokens)}I", *tokens)


def root_key(layout_stamp: str, model_fingerprint: str, cache_salt: str | None = None) -> bytes:
    """The salt every chain starts from. ``cache_salt`` None and "" are the same (no salt)."""
    return digest(b"kvarn-apc", str(KEY_VERSION).encode(), layout_stamp.encode(), model_fingerprint.encode(),
                   (cache_salt or "").encode())


@dataclass(frozen=True)
class BlockKey:
    """Block ``index`` (tokens ``[index*G, (index+1)*G)``) of a chain: its key and its tokens."""

    index: int
    key: bytes
    tokens: tuple[int, ...]

    @property
    def hex(self) -> str:
        return self.key.hex()


def block_keys(tokens: Sequence[int], block_size: int, root: bytes, limit: int | None = None) -> list[BlockKey]:
    """Keys of the whole blocks of ``tokens`` (at most ``limit``), in order."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    count = len(tokens) // block_size if limit is None else min(limit, len(tokens) // block_size)
    keys, previous = [], root
    for i in range(count):
        block = tuple(int(t) for t in tokens[i * block_size: (i + 1) * block_size])
        previous = digest(previous, token_bytes(block))
        keys.append(BlockKey(i, previous, block))
    return keys


def reusable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Whole blocks a prompt may take from the cache: all but what would cover its last token."""
    return max(num_prompt_tokens - 1, 0) // block_size


def prompt_keys(prompt: Sequence[int], block_size: int, root: bytes) -> list[BlockKey]:
    """The keys a lookup of ``prompt`` may hit (never the block holding its last token)."""
    return block_keys(prompt, block_size, root, limit=reusable_blocks(len(prompt), block_size))
