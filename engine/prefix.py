"""Prefix reuse: the engine's side of the automatic prefix cache (``apc``).

The engine asks three things of it, all on the engine thread:

- ``lookup(request)`` at admission: the longest cached prefix of the prompt, as a ``Restore``
  (tokens it covers, and what rebuilds the row); the scheduler then prefills only the rest;
- ``make_row(restore, fresh)``: a fresh row of the runner's filled from it;
- ``after_step(...)``: cache what the step completed: whole blocks of prompts and of generated
  text (exact tier), or whole-row snapshots at chosen prompt lengths (checkpoint tier).

**Exact tier** (every layer takes the KV layout): a block is G tokens of every layer.
- fp16 / affine: the block's keys and values (every token's are final once written, whatever
  the chunking), so any cached block is what a run without the cache would compute.
- KVarN: a prompt's first chunk (tokens ``[0, C)``, C the prefill chunk size) attends in full
  precision; everything after it, chunk or decode, attends with decode's view (records of
  committed tiles, its own tile in float16), which does not depend on chunking. So blocks
  ``i < C/G`` are cached as "fresh" blocks (the raw keys and values of the fresh chunk: a
  restore inside the fresh chunk continues it in full precision) and blocks ``i >= C/G`` as
  records. A block below C/G that a fresh chunk did not make (decoded after a short prompt)
  is never cached, nor anything after it; the chunk size is part of the keys.

**Checkpoint tier** (sliding windows, recurrent layers): the whole row after exactly L tokens,
at the end of a chat's system prompt and at the prompt's last token but one (the engine sets
``Request.snapshot_at``; the scheduler ends a chunk there), so a repeat of a prompt, or a later
turn extending it, restores all but its last token. With KVarN layers, the fresh chunk ends at the first of the
system prompt's end and C; a snapshot before that end is not taken (a restore could not
continue the fresh chunk), and that end is part of the keys.

Contract (tested): greedy output after a restore from memory or disk equals the output of the
same request without the cache, for fp16, affine and KVarN, up to float rounding of differently
shaped matmuls (the same rounding that batching changes).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from apc.blocks import Payload
from apc.hashing import BlockKey
from apc.prefix_cache import PrefixCache
from engine.request import Request, RequestId
from engine.step_types import StepPlan
from kvarn.baselines import AffineKVCache, FP16KVCache, uses_layout
from kvarn.cache import Block, KVarNKVCache
from kvarn.layout import KVLayout
from kvarn.paged import PagedLayer
from kvarn.slots import SlotRow

logger = logging.getLogger(__name__)

KVARN_ROWS = (KVarNKVCache, PagedLayer)
_WIDTH = {"fresh": 2, "record": 8, "fp16": 2, "affine": 6}  # arrays per layer of a block


@dataclass
class Restore:
    """What a lookup found: ``tokens`` prompt tokens, as blocks (exact tier) or a snapshot."""

    tokens: int
    blocks: list[Payload] = field(default_factory=list)
    snapshot: Payload | None = None


@dataclass
class _Progress:
    """What of a running request's sequence is cached: blocks before ``next_block`` (exact tier)
    and its keys; ``done`` once a block could not be cached (nothing after it is reachable)."""

    next_block: int = 0
    keys: list[BlockKey] = field(default_factory=list)
    done: bool = False


class PrefixReuse:
    def __init__(self, cache: PrefixCache, layout: KVLayout, chunk_size: int) -> None:
        self.cache = cache
        self.layout = layout
        self.G = cache.block_size
        self.chunk_size = chunk_size
        self.fresh_blocks = chunk_size // self.G if layout.scheme == "kvarn" else 0
        self.progress: dict[RequestId, _Progress] = {}

    @property
    def tier(self) -> str:
        return self.cache.tier

    # --- admission ---
    def lookup(self, request: Request) -> Restore | None:
        if self.tier == "exact":
            keys, blocks = self.cache.lookup(request.prompt_ids, request.cache_salt)
            if not blocks:
                return None
            self.progress[request.request_id] = _Progress(next_block=len(blocks), keys=list(keys))
            return Restore(len(blocks) * self.G, blocks=blocks)
        found = self.cache.longest_snapshot(request.prompt_ids, self._snapshot_salt(request))
        if found is None:
            return None
        length, payload = found
        if length < self._fresh_end(request) and self.layout.scheme == "kvarn":
            return None  # cannot happen for snapshots this engine took; a guard for foreign salts
        return Restore(length, snapshot=payload)

    def make_row(self, restore: Restore, fresh: list[Any]) -> list[Any]:
        """``fresh`` (a new row of the runner's, with its reservation) filled from ``restore``."""
        if restore.snapshot is not None:
            return load_snapshot(fresh, restore.snapshot)
        out = []
        for l, layer in enumerate(fresh):
            blocks = [Block(i, p.kind, p.arrays[l * _WIDTH[p.kind]: (l + 1) * _WIDTH[p.kind]])
                      for i, p in enumerate(restore.blocks)]
            out.append(_restore_layer(layer, blocks, self.layout, self.chunk_size))
        return out

    # --- after a step ---
    def after_step(self, plan: StepPlan, requests: Mapping[RequestId, Request], rows: Mapping[RequestId, Any]) -> None:
        """Cache what the step completed for the requests it ran (``rows``: the runner's rows),
        after the scheduler advanced them and before any of them is finished and freed."""
        fresh = {c.request_id for c in plan.prefills if _ran_fresh(rows.get(c.request_id))}
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
                    self._cache_blocks(request, row.cache, request_id in fresh)
                else:
                    self._maybe_snapshot(request, row.cache, plan)
            except Exception:  # the cache is an optimization: a failure never fails the request
                logger.exception("prefix cache: could not cache blocks of %s", request_id)
                self.progress.setdefault(request_id, _Progress()).done = True
        for chunk in plan.prefills:  # the fresh chunk's raw keys are no longer needed
            row = rows.get(chunk.request_id)
            for layer in row.cache if row is not None else ():
                if isinstance(layer, KVARN_ROWS):
                    layer.chunk = None

    def forget(self, request_id: RequestId) -> None:
        self.progress.pop(request_id, None)

    def _cache_blocks(self, request: Request, cache: list[Any], ran_fresh: bool) -> None:
        progress = self.progress.setdefault(request.request_id, _Progress())
        if progress.done:
            return
        computed = request.num_computed_tokens
        complete = computed // self.G
        start = progress.next_block
        if complete <= start:
            return
        tokens = (request.prompt_ids + request.output_ids)[:computed]
        progress.keys = self.cache.chain(tokens, request.cache_salt, progress.keys)
        F = self.fresh_blocks
        payloads: list[Payload] = []
        if start < F:  # blocks of the fresh chunk: only right after it ran, from its raw keys
            if not ran_fresh:
                progress.done = True
                return
            stop = min(complete, F)
            payloads += [_join("fresh", [layer.fresh_blocks(i, i + 1)[0].arrays for layer in cache])
                         for i in range(start, stop)]
            if stop < F:  # a prompt shorter than C: its next blocks are decoded, not fresh
                progress.done = True
        if not progress.done:
            payloads += [self._layout_block(cache, i) for i in range(max(start, F), complete)]
        if payloads:
            # evaluated now: a pending copy would keep its source (the row's whole buffer) alive
            mx.eval([a for payload in payloads for a in payload.arrays])
            self.cache.insert(progress.keys, start, payloads)
        progress.next_block = start + len(payloads)

    def _layout_block(self, cache: list[Any], i: int) -> Payload:
        G = self.G
        if self.layout.scheme == "kvarn":
            return _join("record", [layer.record_blocks(i, i + 1)[0].arrays for layer in cache])
        kind = "fp16" if self.layout.scheme == "fp16" else "affine"
        arrays = []
        for layer in cache:
            for leg in (layer.keys, layer.values):
                parts = leg if isinstance(leg, tuple) else (leg,)
                arrays.append(tuple(mx.array(p[..., i * G:(i + 1) * G, :]) for p in parts))
        return Payload(kind, tuple(a for pair in arrays for a in pair))

    # --- checkpoint tier ---
    def _fresh_end(self, request: Request) -> int:
        """Where this request's fresh chunk ends (KVarN layers): the scheduler's first chunk."""
        points = [p for p in request.snapshot_at if 0 < p < request.num_prompt_tokens]
        return min([self.chunk_size, request.num_prompt_tokens, *points])

    def _snapshot_salt(self, request: Request) -> str:
        fresh = self._fresh_end(request) if self.layout.scheme == "kvarn" else 0
        return f"{request.cache_salt or ''}\x00fresh={fresh}"

    def _maybe_snapshot(self, request: Request, cache: list[Any], plan: StepPlan) -> None:
        chunk = next((c for c in plan.prefills if c.request_id == request.request_id), None)
        if chunk is None:
            return
        end = chunk.end_idx
        if end not in request.snapshot_at:
            return
        if self.layout.scheme == "kvarn" and end < self._fresh_end(request):
            return
        if end <= request.num_cached_tokens:
            return
        payload = save_snapshot(cache)
        if payload is not None:
            mx.eval(list(payload.arrays))
            self.cache.put_snapshot(request.prompt_ids[:end], self._snapshot_salt(request), payload)


def _ran_fresh(row: Any) -> bool:
    """Whether a row's latest update was its fresh chunk (KVarN layers keep it as ``chunk``)."""
    if row is None:
        return False
    layer = next((c for c in row.cache if isinstance(c, KVARN_ROWS)), None)
    return layer is not None and layer.chunk is not None and layer.chunk.fresh


def _join(kind: str, per_layer: Sequence[tuple[mx.array, ...]]) -> Payload:
    return Payload(kind, tuple(a for arrays in per_layer for a in arrays))


def _restore_layer(layer: Any, blocks: list[Block], layout: KVLayout, chunk_size: int) -> Any:
    continue_fresh = len(blocks) * layout.tile_size < chunk_size  # inside the fresh chunk: it goes on
    if isinstance(layer, PagedLayer):
        return layer.load_blocks(blocks, continue_fresh=continue_fresh)
    if isinstance(layer, KVarNKVCache):
        return KVarNKVCache.from_blocks(layout, blocks, continue_fresh=continue_fresh)
    if isinstance(layer, SlotRow):
        width = len(blocks[0].arrays) // 2
        legs = [tuple(mx.concatenate([b.arrays[leg * width + j] for b in blocks], axis=2) for j in range(width))
                for leg in (0, 1)]
        keys, values = (leg[0] if width == 1 else leg for leg in legs)
        layer.load(keys, values, offset=len(blocks) * layout.tile_size)
        return layer
    if isinstance(layer, (FP16KVCache, AffineKVCache)):
        capacity = layer.capacity
        width = len(blocks[0].arrays) // 2
        legs = []
        for leg in (0, 1):
            parts = [mx.concatenate([b.arrays[leg * width + j] for b in blocks], axis=2) for j in range(width)]
            legs.append(tuple(_reserve(p, capacity) for p in parts))
        keys, values = legs
        layer.keys, layer.values = (keys[0], values[0]) if width == 1 else (keys, values)
        layer.offset = len(blocks) * layout.tile_size
        return layer
    raise TypeError(f"{type(layer).__name__} rows cannot be rebuilt from blocks")


def _reserve(array: mx.array, capacity: int | None) -> mx.array:
    """``array`` [B, H, T, ...] in a buffer of ``capacity`` token slots (the row's reservation)."""
    tokens = array.shape[2]
    if capacity is None or capacity <= tokens:
        return array
    buffer = mx.zeros((*array.shape[:2], capacity, *array.shape[3:]), array.dtype)
    return mx.slice_update(buffer, array, mx.array([0]), axes=(2,))


# --- whole-row snapshots (checkpoint tier) ---

def save_snapshot(cache: list[Any]) -> Payload | None:
    """A row as one payload: every layer's arrays (copied) and what rebuilds it; None if a
    layer's cache type is not one this knows."""
    arrays: list[mx.array] = []
    metas = []
    for layer in cache:
        saved = _save_layer(layer)
        if saved is None:
            logger.warning("prefix cache: %s layers cannot be snapshotted", type(layer).__name__)
            return None
        meta, layer_arrays = saved
        metas.append({**meta, "n": len(layer_arrays)})
        arrays += [mx.array(a) for a in layer_arrays]
    return Payload("snapshot", tuple(arrays), json.dumps(metas))


def _save_layer(layer: Any) -> tuple[dict[str, Any], list[mx.array]] | None:
    if isinstance(layer, KVarNKVCache):
        return {"type": "kvarn", "meta": list(layer.meta_state)}, list(layer.state)
    if isinstance(layer, RotatingKVCache):
        return ({"type": "rotating", "offset": layer.offset, "keep": layer.keep, "max_size": layer.max_size,
                 "idx": layer._idx}, [layer.keys, layer.values])
    if isinstance(layer, SlotRow):
        n = layer.offset
        if layer.store.quantized:
            return {"type": "affine", "offset": n}, [p for leg in layer.state for p in leg]
        return {"type": "kv", "offset": n}, list(layer.state)
    if isinstance(layer, QuantizedKVCache):
        n = layer.offset
        return ({"type": "affine", "offset": n},
                [p[..., :n, :] for leg in (layer.keys, layer.values) for p in leg])
    if isinstance(layer, KVCache):
        n = layer.offset
        return {"type": "kv", "offset": n}, [layer.keys[..., :n, :], layer.values[..., :n, :]]
    if isinstance(layer, ArraysCache):
        present = [i for i, a in enumerate(layer.cache) if a is not None]
        return {"type": "arrays", "present": present}, [layer.cache[i] for i in present]
    return None


def load_snapshot(fresh: list[Any], payload: Payload) -> list[Any]:
    """Fill a fresh row (the model's own cache types, with the row's reservation) from a snapshot."""
    metas = json.loads(payload.meta)
    if len(metas) != len(fresh):
        raise ValueError("snapshot of another model")
    arrays, at, out = payload.arrays, 0, []
    for layer, meta in zip(fresh, metas):
        mine = list(arrays[at: at + meta["n"]])
        at += meta["n"]
        out.append(_load_layer(layer, meta, mine))
    return out


def _load_layer(layer: Any, meta: dict[str, Any], arrays: list[mx.array]) -> Any:
    kind = meta["type"]
    if kind == "kvarn" and isinstance(layer, KVarNKVCache):
        return KVarNKVCache.from_state(arrays, tuple(meta["meta"]))
    if kind == "rotating" and isinstance(layer, RotatingKVCache):
        layer.keys, layer.values = arrays
        layer.offset, layer.keep, layer.max_size, layer._idx = meta["offset"], meta["keep"], meta["max_size"], meta["idx"]
        return layer
    if kind in ("affine", "kv") and isinstance(layer, SlotRow):
        keys, values = (tuple(arrays[:3]), tuple(arrays[3:])) if kind == "affine" else arrays
        layer.load(keys, values, offset=meta["offset"])
        return layer
    if kind == "affine" and isinstance(layer, QuantizedKVCache):
        capacity = getattr(layer, "capacity", None)
        layer.keys = tuple(_reserve(a, capacity) for a in arrays[:3])
        layer.values = tuple(_reserve(a, capacity) for a in arrays[3:])
        layer.offset = meta["offset"]
        return layer
    if kind == "kv" and isinstance(layer, KVCache):
        capacity = getattr(layer, "capacity", None)
        layer.keys, layer.values = (_reserve(a, capacity) for a in arrays)
        layer.offset = meta["offset"]
        return layer
    if kind == "arrays" and isinstance(layer, ArraysCache):
        for i, a in zip(meta["present"], arrays):
            layer.cache[i] = a
        return layer
    raise ValueError(f"snapshot layer {kind} does not fit a {type(layer).__name__} row")


def exact_tier_possible(row: list[Any]) -> bool:
    """Whether rows of this model cut at blocks: every layer takes the KV layout."""
    return all(uses_layout(layer) for layer in row)
