"""KV cache events in vLLM's wire format: what the prefix cache holds, told to routers.

A router that routes by prefix (vllm-router's ``kv_aware``, llm-d's precise prefix scorer, NVIDIA
Dynamo) subscribes to each replica's events and keeps an index of which replica holds which
blocks. The wire types mirror vLLM's ``vllm/distributed/kv_events.py`` (msgspec structs,
``array_like``, ``omit_defaults``, ``tag``: a batch is the msgpack array ``[ts, events, rank]``, an
event ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name]``, ``["BlockRemoved", block_hashes, medium]`` or ``["AllBlocksCleared"]``). Later vLLM
releases, and vllm-router, write each event as a map tagged by ``"type"`` instead
(``{"type": "BlockStored", "block_hashes": ...}``): ``KVEventsConfig.layout`` picks (``"array"``,
the default, or ``"map"``).

Routers hash at their own block size B (vLLM's default, and vllm-router's, is 16), and kvarn caches
blocks of G = 128 tokens. ``CacheEvents`` therefore publishes each cached block as G / B router-size
sub-blocks, each with a hash of its own, chained block to block::

    cached block i (key K_i, tokens t[iG:(i+1)G])
      sub-blocks j = 0 .. G/B - 1:  hash  s(K_i, j),  tokens t[iG + jB : iG + (j+1)B]
      parent of s(K_i, 0)        =  s(K_{i-1}, G/B - 1)   (None for block 0)

``s(K, j)`` is 63 bits of BLAKE2b over the block's chained key and j: a positive int64, as vLLM's
hashes are ints. A router that hashes token ids itself (vllm-router hashes each sub-block's
``token_ids`` and walks its tree by them) matches a request's own tokens against them; one that
trusts ``block_hashes`` gets a chain whose every hash names the whole prefix before it (the key
is salted like the cache's). ``medium`` names the tier: ``"GPU"`` for the memory tier (the
engine's own KV memory: the device tier of vLLM, vllm-router and Dynamo) and ``"DISK"`` for the
disk tier (vllm-router scores it as its disk tier).

Pure Python (no MLX, no sockets): ``emit`` is whatever takes the events (``apc.publisher``).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from apc.hashing import BlockKey

LAYOUTS = ("array", "map")  # each event a msgpack array (vLLM's subscriber example) or a tagged map


@dataclass(frozen=True)
class KVEventsConfig:
    """``endpoint``: the PUB socket; ``replay_endpoint``: the ROUTER socket (None: no replay);
    ``block_size``: the routers' block size (``apc.events``)."""

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    block_size: int = 16
    layout: str = "array"  # each event a msgpack array, or a tagged map ("map": vllm-router)
    buffer_steps: int = 10_000
    hwm: int = 100_000

    def __post_init__(self) -> None:
        if not self.endpoint:
            raise ValueError("the KV events endpoint must name a ZMQ endpoint, e.g. tcp://*:5557")
        if self.block_size < 1:
            raise ValueError(f"the KV events block size must be >= 1 (got {self.block_size})")
        if self.layout not in LAYOUTS:
            raise ValueError(f"the KV events layout must be one of {', '.join(LAYOUTS)} (got {self.layout!r})")


MEDIUM_MEMORY = "GPU"
MEDIUM_DISK = "DISK"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """A change to what a replica caches."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# The same events as msgpack maps tagged ``{"type": "BlockStored", ...}`` inside the same array
# batch: the layout later vLLM releases publish and vllm-router reads (``layout="map"``). Each is
# made from its array twin, field for field.
class MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A change to what a replica caches, as a tagged map."""


def _map_twin(event: type[KVCacheEvent]) -> type[MapEvent]:
    fields = [(f.name, f.type) for f in msgspec.structs.fields(event)]
    return msgspec.defstruct(f"Map{event.__name__}", fields, bases=(MapEvent,), tag=event.__name__,
                             module=__name__)


_AS_MAP = {event: _map_twin(event) for event in (BlockStored, BlockRemoved, AllBlocksCleared)}


class MapKVEventBatch(EventBatch):
    events: list[Any]  # the map twins (encoded only; readers type them as their own)


def sub_hash(key: bytes, index: int) -> int:
    """The hash of router-size sub-block ``index`` of the cached block with chained key ``key``."""
    digest = hashlib.blake2b(key + index.to_bytes(4, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # 63 bits: a positive int64 for every reader


class CacheEvents:
    """Turns the prefix cache's changes into events and hands them to ``emit`` (thread-safe:
    called from the engine thread and the disk tier's threads). ``block_size``: the routers'
    block size B, a divisor of the cache's block size G."""

    def __init__(self, emit: Callable[[Any], None], block_size: int, cache_block_size: int) -> None:
        if block_size < 1 or cache_block_size % block_size:
            raise ValueError(f"the KV events block size must divide the prefix cache's block size "
                             f"{cache_block_size} (got {block_size})")
        self.emit, self.block_size, self.per_block = emit, block_size, cache_block_size // block_size

    def hashes(self, key: bytes) -> list[int]:
        return [sub_hash(key, j) for j in range(self.per_block)]

    def stored(self, run: Sequence[BlockKey], parent: BlockKey | None, medium: str) -> None:
        """A run of consecutive blocks of one chain (``parent``: the block before the first)."""
        if not run:
            return
        hashes = [h for block in run for h in self.hashes(block.key)]
        tokens = [t for block in run for t in block.tokens]
        parent_hash = sub_hash(parent.key, self.per_block - 1) if parent is not None else None
        self.emit(BlockStored(hashes, parent_hash, tokens, self.block_size, None, medium, None))

    def removed(self, keys: Sequence[bytes], medium: str) -> None:
        if keys:
            self.emit(BlockRemoved([h for key in keys for h in self.hashes(key)], medium))

    def cleared(self) -> None:
        self.emit(AllBlocksCleared())


def make_batch(events: list[Any], rank: int = 0, layout: str = "array") -> KVEventBatch | MapKVEventBatch:
    """A batch of ``events`` in ``layout``: ``"array"`` (every event a msgpack array, as
    vLLM's published subscriber example decodes) or ``"map"`` (every event a tagged map)."""
    if layout == "map":
        return MapKVEventBatch(time.time(), [_AS_MAP[type(e)](*msgspec.structs.astuple(e)) for e in events], rank)
    return KVEventBatch(time.time(), events, rank)
