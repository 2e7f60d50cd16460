"""Prefix reuse: the prefix cache's side of admission and of each step (the facade the engine holds).

The scheduler asks it, at admission and on the engine thread (``engine.scheduler.CacheHooks``):

- ``lookup(request)``: the longest cached prefix of the prompt, as a ``Restore`` (tokens it
  covers, and what rebuilds the row; a block-pool hit is pinned from here on), or ``PENDING``
  while the disk tier reads it on its own thread (the request waits; running rows go on);
- ``release(restore)`` if the request is not admitted now, ``admit(request, restore)`` if it is;
- ``cached_bytes()`` / ``evict_to(target)``: what the cache keeps beside running rows, and
  making room for a request.

and after admission: ``make_row(restore, empty)`` fills the new row (the runner), and
``after_step(...)`` caches what the step completed: whole blocks of prompts and of generated text
(exact tier), or whole-row snapshots at chosen prompt lengths (checkpoint tier).
``make_prefix_reuse`` builds it, with every tier, from what the loaded model and its row store are,
and with the KV events publisher when routers are told what it holds (``apc.publisher``); the
``PrefixReuse`` owns that publisher and closes it in ``close()``.

It reads requests and step plans by their attributes only (``CachedRequest``, ``CachedPlan``):
the engine's ``Request`` and ``StepPlan`` have them.

**Exact tier** (every layer takes the KV layout): a block is G tokens of every layer.
- KVarN rows in the block pool: the pool's hashed blocks are the memory tier
  (``apc/pool_tier.py``): block 0 is the float16 sink (a cached copy), block i > 0 is record
  i - 1, shared by reference count. Every token, in any prompt chunk or in decode, attends with
  decode's view (the sink, the records of committed tiles, its own tile in float16), and a record
  depends only on its own tile, so any cached block is what a run without the cache would
  compute, whatever the chunking.
- fp16 / affine: copies of the block's keys and values (``apc.memory_tier``; every token's are
  final once written, whatever the chunking).

**Windows** (``--max-kv-size N``): the layout stamp names N, so windowed and unwindowed rows (and
rows of other windows) never share a key. A windowed KVarN row publishes only blocks within its
first N tokens (nothing was evicted before them, so they are exact; a hit never needs an evicted
block); windowed fp16 / affine rows are rotating caches, snapshotted whole (the checkpoint tier).

**Checkpoint tier** (sliding windows, recurrent layers): the whole row after exactly L tokens,
at the end of a chat's system prompt and at the prompt's last token but one (the engine sets the
request's ``snapshot_at``; the scheduler ends a chunk there), so a repeat of a prompt, or a later
turn extending it, restores all but its last token.

Contract (tested): greedy output after a restore from memory or disk equals the output of the
same request without the cache, for fp16, affine and KVarN, up to float rounding of differently
shaped matmuls (the same rounding that batching changes).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx

from apc.blocks import Payload
from apc.events import CacheEvents, KVEventsConfig
from apc.hashing import BlockKey, prompt_keys
from apc.pool_tier import PoolHit, PoolTier, SinkOf
from apc.prefix_cache import PENDING, PrefixCache
from kvarn.layout import KVLayout
from kvarn.rows import RowStore, make_cache, uses_layout
from kvarn.snapshots import load_blocks, restore, snapshot

if TYPE_CHECKING:
    from apc.publisher import ZmqPublisher

logger = logging.getLogger(__name__)

_WIDTH = {"fp16": 2, "affine": 6}  # arrays per layer of a copied block

RequestId = str


class CachedParams(Protocol):
    prompt_logprobs: int | None  # set: never looked up (a cached prefix has no logits to score it)


class CachedRequest(Protocol):
    """What the hooks read of a request: its id, tokens and salt, how far it has run, and where
    the checkpoint tier snapshots it."""

    request_id: RequestId
    prompt_ids: list[int]
    output_ids: list[int]
    cache_salt: str | None
    params: CachedParams
    num_computed_tokens: int
    num_cached_tokens: int
    snapshot_at: tuple[int, ...]

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def is_finished(self) -> bool: ...


class CachedChunk(Protocol):
    request_id: RequestId
    end_idx: int
    forks: tuple[RequestId, ...]  # choices that become rows sharing this chunk's row


class CachedPlan(Protocol):
    """What ``after_step`` reads of a step: its prompt chunks and its decoding rows."""

    prefills: Sequence[CachedChunk]
    decodes: Sequence[RequestId]


class CachedRow(Protocol):
    cache: list[Any]  # one cache per layer


class CacheSettings(Protocol):
    """What ``make_prefix_reuse`` reads of the prefix cache's settings (the engine's ``ApcConfig``)."""

    memory_bytes: int | None  # a cap of the cache's own (None: what the KV budget leaves)
    disk_dir: str | None  # the disk tier's folder (None: memory only)
    disk_bytes: int
    kv_events: KVEventsConfig | None  # publish the exact tier's changes (None: no socket)


@dataclass
class Restore:
    """What a lookup found: ``tokens`` prompt tokens, as pinned pool blocks, block copies (exact
    tier) or a snapshot."""

    tokens: int
    keys: list[BlockKey] = field(default_factory=list)
    blocks: list[Payload] = field(default_factory=list)
    pool: PoolHit | None = None
    snapshot: Payload | None = None


@dataclass
class _Progress:
    """What of a running request's sequence is cached: blocks before ``next_block`` (exact tier)
    and its keys; ``done`` once a block could not be cached (nothing after it is reachable)."""

    next_block: int = 0
    keys: list[BlockKey] = field(default_factory=list)
    done: bool = False


class PrefixReuse:
    """The prefix cache as admission and the model runner see it (module docstring). While
    ``paused`` it looks nothing up and caches nothing (what it keeps stays, and still gives room)."""

    def __init__(self, cache: PrefixCache, layout: KVLayout, publisher: ZmqPublisher | None = None) -> None:
        """``publisher``: the KV events publisher ``cache.events`` feeds (None: none), closed with it."""
        self.cache = cache
        self.layout = layout
        self.publisher = publisher
        self.G = cache.block_size
        self.pool_tier = cache.memory if isinstance(cache.memory, PoolTier) else None
        self.progress: dict[RequestId, _Progress] = {}
        self._chains: dict[RequestId, list[BlockKey]] = {}  # prompt keys of requests waiting for admission
        self._read: set[RequestId] = set()  # requests whose disk read was started (one per request)
        self._paused = False

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Requests run meanwhile (a warm-up) neither hit nor fill the cache."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    @property
    def tier(self) -> str:
        return self.cache.tier

    def close(self) -> None:
        """Land the disk tier's queued writes, then close the publisher: their events go out too."""
        try:
            self.cache.close()
        finally:
            if self.publisher is not None:
                self.publisher.close()

    # --- admission (``engine.scheduler.CacheHooks``) ---
    def lookup(self, request: CachedRequest) -> Restore | None | Any:
        if self._paused or request.params.prompt_logprobs is not None:  # no logits to score a cached prefix
            return None
        rid = request.request_id
        disk = rid not in self._read
        if self.tier == "exact":
            chain = self._chains.get(rid)
            if chain is None:
                chain = self._chains[rid] = prompt_keys(request.prompt_ids, self.G, self.cache.root(request.cache_salt))
            found = self.cache.lookup(request.prompt_ids, request.cache_salt, disk=disk, chain=chain)
            if found is PENDING:
                self._read.add(rid)
                return PENDING
            keys, hits = found
            if not hits:
                return None
            if self.pool_tier is not None:  # the blocks, then the tail cached after them (all but the last token)
                tail = None
                if self.layout.max_kv_size is None:
                    tail = self.pool_tier.find_tail(keys[-1], request.prompt_ids[len(hits) * self.G: -1])
                hit = self.pool_tier.pin(hits, tail)
                return Restore(len(hits) * self.G + hit.tail_len, keys, pool=hit)
            return Restore(len(hits) * self.G, keys, blocks=hits)
        found = self.cache.longest_snapshot(request.prompt_ids, request.cache_salt, disk=disk)
        if found is PENDING:
            self._read.add(rid)
            return PENDING
        if found is None:
            return None
        length, payload = found
        return Restore(length, snapshot=payload)

    def release(self, restore: Restore) -> None:
        """A hit that no row took (not admitted now, or its step failed first): unpinned."""
        if restore.pool is not None:
            self.pool_tier.unpin(restore.pool)

    def admit(self, request: CachedRequest, restore: Restore | None) -> None:
        rid = request.request_id
        self._chains.pop(rid, None)
        self._read.discard(rid)
        if self._paused or request.params.prompt_logprobs is not None:  # never looked up: not in the stats
            return
        query = request.num_prompt_tokens
        if self.tier == "exact":
            keys = restore.keys if restore is not None else []
            self.cache.record(query, keys, restore.pool.tail_len if restore is not None and restore.pool else 0)
            if keys:
                self.progress[rid] = _Progress(next_block=len(keys), keys=list(keys))
        else:
            tokens = request.prompt_ids[: restore.tokens] if restore is not None else None
            self.cache.record_snapshot(query, self.cache.root(request.cache_salt), tokens)

    def cached_bytes(self) -> int:
        return self.cache.memory_bytes

    def trim(self) -> None:
        """Within the cap, after rows let go of blocks the cache keeps (the pool tier)."""
        cap = self.cache.memory_cap
        if cap is not None and self.cache.memory_bytes > cap:
            self.cache.evict_to(cap)

    def evict_to(self, target: int) -> None:
        self.cache.evict_to(target)

    def make_row(self, restore: Restore, empty: list[Any]) -> list[Any]:
        """``empty`` (a new row of the runner's, with its reservation) filled from ``restore``."""
        if restore.snapshot is not None:
            return load_snapshot(empty, restore.snapshot)
        if restore.pool is not None:
            self.pool_tier.adopt(restore.pool, empty[0].row)
            return empty
        return [load_blocks(layer, [p.arrays[l * _WIDTH[p.kind]: (l + 1) * _WIDTH[p.kind]] for p in restore.blocks],
                            self.G) for l, layer in enumerate(empty)]

    # --- after a step ---
    def after_step(self, plan: CachedPlan, requests: Mapping[RequestId, CachedRequest],
                   rows: Mapping[RequestId, CachedRow]) -> None:
        """Cache what the step completed for the requests it ran (``rows``: the runner's rows),
        after the scheduler advanced them and before any of them is finished and freed."""
        if self._paused:
            return
        ids = [c.request_id for c in plan.prefills] + [f for c in plan.prefills for f in c.forks] + list(plan.decodes)
        for chunk in plan.prefills:  # forks start from their parent's progress
            for fork_id in chunk.forks:
                parent = self.progress.get(chunk.request_id)
                if parent is not None:
                    self.progress[fork_id] = _Progress(parent.next_block, list(parent.keys), parent.done)
        for request_id in dict.fromkeys(ids):
            request, row = requests.get(request_id), rows.get(request_id)
            if request is None or row is None or request.is_finished:
                continue
            try:
                if self.tier == "exact":
                    self._cache_blocks(request, row.cache)
                else:
                    self._maybe_snapshot(request, row.cache, plan)
            except Exception:  # the cache is an optimization: a failure never fails the request
                logger.exception("prefix cache: could not cache blocks of %s", request_id)
                self.progress.setdefault(request_id, _Progress()).done = True

    def forget(self, request_id: RequestId) -> None:
        self.progress.pop(request_id, None)
        self._chains.pop(request_id, None)
        self._read.discard(request_id)

    def _cache_blocks(self, request: CachedRequest, cache: list[Any]) -> None:
        progress = self.progress.setdefault(request.request_id, _Progress())
        if progress.done:
            return
        computed = request.num_computed_tokens
        complete = computed // self.G
        if self.layout.max_kv_size is not None:  # a windowed row publishes only what no eviction touched
            complete = min(complete, self.layout.max_kv_size // self.G)
        start = progress.next_block
        if complete > start:
            tokens = (request.prompt_ids + request.output_ids)[:computed]
            progress.keys = self.cache.chain(tokens, request.cache_salt, progress.keys)
            if self.pool_tier is not None:  # the row's own blocks (its sink copied once)
                row = cache[0].row
                items = [SinkOf(row) if i == 0 else row.record_block(i - 1) for i in range(start, complete)]
                if None in items:  # evicted from a windowed row's table before it was cached: the chain stops
                    items = items[: items.index(None)]
                    progress.done = True
                    if not items:
                        return
            else:
                items = [self._layout_block(cache, i) for i in range(start, complete)]
                # evaluated now: a pending copy would keep its source (the row's whole buffer) alive
                mx.eval([a for payload in items for a in payload.arrays])
            held = self.cache.insert(progress.keys, start, items)
            progress.next_block = complete
            if held < len(items):  # a block the cache refused: nothing after it can be reached
                progress.done = True
                return
        if (self.pool_tier is not None and computed == request.num_prompt_tokens and computed % self.G
                and self.layout.max_kv_size is None and 0 < complete <= len(progress.keys)):
            # the prompt is in: its partial last tile too, so a repeat recomputes only its last token
            self.pool_tier.insert_tail(progress.keys[complete - 1], cache[0].row,
                                       request.prompt_ids[complete * self.G: computed])

    def _layout_block(self, cache: list[Any], i: int) -> Payload:
        """Block ``i`` of an fp16 / affine row as a payload of copies."""
        G = self.G
        kind = "fp16" if self.layout.scheme == "fp16" else "affine"
        arrays = []
        for layer in cache:
            for leg in (layer.keys, layer.values):
                parts = leg if isinstance(leg, tuple) else (leg,)
                arrays.append(tuple(mx.array(p[..., i * G:(i + 1) * G, :]) for p in parts))
        return Payload(kind, tuple(a for pair in arrays for a in pair))

    # --- checkpoint tier ---
    def _maybe_snapshot(self, request: CachedRequest, cache: list[Any], plan: CachedPlan) -> None:
        chunk = next((c for c in plan.prefills if c.request_id == request.request_id), None)
        if chunk is None:
            return
        end = chunk.end_idx
        if end not in request.snapshot_at or end <= request.num_cached_tokens:
            return
        payload = save_snapshot(cache)
        if payload is not None:
            mx.eval(list(payload.arrays))
            self.cache.put_snapshot(request.prompt_ids[:end], request.cache_salt, payload)


# --- whole-row snapshots (checkpoint tier): each storage writes and reads its own (``kvarn.snapshots``) ---

def save_snapshot(cache: list[Any]) -> Payload | None:
    """A row as one payload: every layer's arrays (copied) and what rebuilds it; None if a
    layer's cache type is not one the storages know."""
    saved = snapshot(cache)
    if saved is None:
        logger.warning("prefix cache: rows of this model cannot be snapshotted")
        return None
    metas, arrays = saved
    return Payload("snapshot", tuple(arrays), json.dumps(metas))


def load_snapshot(fresh: list[Any], payload: Payload) -> list[Any]:
    """Fill a fresh row (with the row's reservation) from a snapshot."""
    return restore(fresh, json.loads(payload.meta), payload.arrays)


def exact_tier_possible(row: list[Any]) -> bool:
    """Whether rows of this model cut at blocks: every layer takes the KV layout."""
    return all(uses_layout(layer) for layer in row)


def make_prefix_reuse(fingerprint: str, layout: KVLayout, store: RowStore, room: Callable[[], int],
                      settings: CacheSettings) -> PrefixReuse:
    """The prefix cache of a loaded model (``fingerprint``) whose rows ``store`` makes under
    ``layout``, complete: the exact tier where every layer takes the layout (blocks of G tokens:
    the block pool's own blocks for KVarN rows in it, copies for the baselines), else the
    checkpoint tier (whole-row snapshots). The keys' stamp names the layout and the model.

    ``room()``: the KV budget left beside what running requests hold; the cache keeps what it
    can of that (less what it keeps already), up to ``settings.memory_bytes`` (None: no cap of its
    own). ``settings.disk_dir``: the disk tier's folder (None: memory only), up to
    ``settings.disk_bytes``. ``settings.kv_events``: the exact tier's changes published from the
    start (the checkpoint tier's snapshots are not blocks: a warning, and no socket is opened)."""
    tier = "exact" if exact_tier_possible(make_cache(store.model, layout)) else "checkpoint"

    def headroom() -> int:  # what the tiers may still grow by: room beside rows, less what they keep
        return room() - cache.memory_bytes

    memory_bytes, disk_dir = settings.memory_bytes, settings.disk_dir
    memory: Any = memory_bytes
    if tier == "exact" and store.pool is not None:
        memory = PoolTier(store.pool, memory_bytes, headroom)
    events, publisher = _open_events(settings.kv_events, tier, layout.tile_size)
    try:
        cache = PrefixCache(layout.stamp(fingerprint), fingerprint, layout.tile_size, memory, disk_dir,
                            settings.disk_bytes, tier=tier, headroom=headroom, events=events)
    except BaseException:
        if publisher is not None:
            publisher.close()
        raise
    cap = f"up to {memory_bytes:,} bytes" if memory_bytes is not None else "no cap"
    logger.info("prefix cache: %s tier%s, in what the KV budget leaves free (%s)%s", tier,
                " in the block pool" if isinstance(memory, PoolTier) else "", cap,
                f", disk {disk_dir} up to {settings.disk_bytes:,} bytes" if disk_dir else "")
    return PrefixReuse(cache, layout, publisher)


def _open_events(config: KVEventsConfig | None, tier: str,
                 block_size: int) -> tuple[CacheEvents | None, ZmqPublisher | None]:
    """The ``CacheEvents`` and bound publisher of ``config`` for the exact tier, or (None, None):
    KV events off, or a checkpoint-tier cache (nothing a router can index)."""
    if config is None:
        return None, None
    if tier != "exact":
        logger.warning("KV events: this model's prefix cache keeps whole-row snapshots, not blocks; "
                       "nothing will be published")
        return None, None
    from apc.publisher import open_cache_events  # loads ZMQ: only where events are on

    return open_cache_events(config, block_size)
