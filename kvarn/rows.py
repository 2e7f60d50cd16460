"""How a row is stored: the one place that knows every storage (the storage factory).

A row is one cache per layer. Which storage a layer gets is decided here, and so is everything
that differs by storage: making, forking, releasing, batching, snapshotting and restoring rows.
Nowhere else branches on cache classes.

- KVarN: every plain attention layer (mlx-lm ``KVCache``) is a view of one ``PagedRow`` in the
  ``KVarNPool`` (block tables; ``kvarn.paged``), so a decode batch runs one graph per layer for
  all rows. The one KVarN storage: a row made outside the engine (``make_cache``: tests,
  ``kvarn kld``) is a row of a pool of its own.
- fp16 / affine: every plain attention layer's rows share one slot buffer per layer
  (``kvarn.slots``), so a decode batch runs one fused attention per layer. With ``--max-kv-size``
  they are rotating caches of their own (``kvarn.rotating``, as mlx-lm's ``max_kv_size``),
  batched row by row; rows made outside the engine with no capacity are mlx-lm's caches with an
  exact reservation (``kvarn.baselines``).
- Layers with a cache of their own (sliding windows, recurrent state) keep their model's cache,
  for every layout. Their prefix reuse is whole-row snapshots (the checkpoint tier), which each
  storage writes and reads itself (``snapshot`` / ``restore``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from kvarn.baselines import AffineKVCache, FP16KVCache, fork_other
from kvarn.batch import BatchRows
from kvarn.decode_graph import DecodePlan, paged_plan
from kvarn.layout import KVLayout
from kvarn.paged import PagedBatch, PagedLayer, PagedRow
from kvarn.pool import KVarNPool
from kvarn.rotating import WINDOW_CACHES, AffineRotatingKVCache, make_window_cache
from kvarn.slot_step import slot_plan
from kvarn.slots import SlotBatch, SlotRow, SlotStore


def plain_layers(model: nn.Module) -> list[int]:
    """The layers that take the KV layout: plain full attention (mlx-lm ``KVCache``)."""
    return [l for l, cache in enumerate(make_prompt_cache(model)) if type(cache) is KVCache]


def make_stores(model: nn.Module, layout: KVLayout) -> list[SlotStore | None]:
    """One slot store per plain attention layer (``plain_layers``), None for layers that keep
    their model's own cache (fp16 / affine layouts)."""
    if layout.scheme == "kvarn":
        raise ValueError("slots hold the fp16 and affine baselines, not KVarN")
    bits = layout.key_bits if layout.scheme == "affine" else None
    plain = set(plain_layers(model))
    return [SlotStore(bits, layout.group_size) if l in plain else None for l in range(len(make_prompt_cache(model)))]


def make_row_cache(model: nn.Module, stores: Sequence[SlotStore | None], capacity: int) -> list[Any]:
    """A row's per-layer cache: a ``SlotRow`` of ``capacity`` tokens per store, the model's own
    cache elsewhere."""
    return [cache if store is None else store.new_row(capacity)
            for store, cache in zip(stores, make_prompt_cache(model), strict=True)]


class RowStore:
    """The rows of one model under one layout (owned by the engine's model runner)."""

    def __init__(self, model: nn.Module, layout: KVLayout) -> None:
        self.model = model
        self.layout = layout
        self.num_layers = len(make_prompt_cache(model))
        self.pool_layers = plain_layers(model) if layout.scheme == "kvarn" else []
        self.pool = KVarNPool(layout, self.num_layers) if layout.scheme == "kvarn" else None
        if layout.scheme == "kvarn" and layout.max_kv_size is not None and not self.exact:
            raise ValueError("--max-kv-size with kvarn needs a model whose every layer is plain attention "
                             "(its rows in the block pool); this model has layers of its own (sliding windows, "
                             "recurrent state): use --kv-scheme fp16 or affine")
        # windowed fp16 / affine rows are rotating caches of their own (``kvarn.rotating``), not slots
        windowed = layout.max_kv_size is not None
        self.slots = make_stores(model, layout) if layout.scheme != "kvarn" and not windowed else None

    @property
    def exact(self) -> bool:
        """Whether every layer is in the block pool (rows cut at blocks: the exact prefix tier)."""
        return self.pool is not None and len(self.pool_layers) == self.num_layers

    @property
    def in_place(self) -> bool:
        """Whether rows live in shared buffers that each step updates in place (pool or slots)."""
        return self.pool is not None or self.slots is not None

    def new_row(self, capacity: int | None) -> list[Any]:
        """A fresh row (one cache per layer) reserving ``capacity`` tokens."""
        if self.slots is not None and capacity is not None:
            return make_row_cache(self.model, self.slots, capacity)
        if self.pool is None:
            return make_cache(self.model, self.layout, capacity)
        return _paged(self.model, PagedRow(self.pool, self.pool_layers, self.layout.max_kv_size))

    @staticmethod
    def settle(cache: list[Any]) -> None:
        """After a prompt chunk was evaluated: a windowed paged row drops the records its next
        token will not attend (every layer has read them by now)."""
        row = paged_row(cache)
        if row is not None:
            row.evict()

    @staticmethod
    def fork(cache: list[Any]) -> list[Any]:
        """A second row with the same history (``n > 1``): paged layers share their blocks (the
        row forked once for all layers), slot rows copy their tokens into a slot of their own,
        other caches share buffers until either writes."""
        row = paged_row(cache)
        child = row.fork() if row is not None else None
        return [child.layers[layer.l] if isinstance(layer, PagedLayer) else
                layer.fork() if hasattr(layer, "fork") else fork_other(layer) for layer in cache]

    @staticmethod
    def release(cache: list[Any]) -> None:
        """Give a row's blocks and slots back (rows of other kinds are freed with their arrays)."""
        for layer in cache:
            if isinstance(layer, (PagedLayer, SlotRow)):
                layer.release()

    @staticmethod
    def own_nbytes(cache: list[Any]) -> int:
        """Bytes a row holds outside the shared pool and slot buffers."""
        return sum(c.nbytes for c in cache if not isinstance(c, (PagedLayer, SlotRow)))


def make_cache(model: nn.Module, layout: KVLayout, capacity: int | None = None) -> list[Any]:
    """A fresh row for ``layout`` outside the engine (one entry per layer): KVarN layers in a pool
    of the row's own, fp16 / affine layers as mlx-lm's caches with an exact reservation (rotating
    windows with ``layout.max_kv_size``); other layers keep their model's own cache."""
    if layout.scheme == "kvarn":
        layers = plain_layers(model)
        return _paged(model, PagedRow(KVarNPool(layout, len(make_prompt_cache(model))), layers, layout.max_kv_size))
    return [_baseline(cache, layout, capacity) for cache in make_prompt_cache(model)]


def _paged(model: nn.Module, row: PagedRow) -> list[Any]:
    return [row.layers[l] if l in row.layers else cache for l, cache in enumerate(make_prompt_cache(model))]


def _baseline(cache: Any, layout: KVLayout, capacity: int | None) -> Any:
    if type(cache) is not KVCache:
        return cache
    if layout.max_kv_size is not None:
        return make_window_cache(layout, capacity)
    if layout.scheme == "fp16":
        return FP16KVCache(capacity)
    return AffineKVCache(layout.group_size, layout.key_bits, capacity)


def paged_row(cache: Sequence[Any]) -> PagedRow | None:
    """The pool row a row's paged layers view (None: no layer is in the pool)."""
    return next((layer.row for layer in cache if isinstance(layer, PagedLayer)), None)


def uses_layout(cache: Any) -> bool:
    """Whether a layer cache is one of the layout's caches (others keep their model's own)."""
    return isinstance(cache, (FP16KVCache, AffineKVCache, PagedLayer, SlotRow))


def count_quantized_layers(model: nn.Module, layout: KVLayout) -> tuple[int, int]:
    """(layers that use ``layout``, windowed fp16 / affine rows included, all layers)."""
    caches = make_cache(model, layout)
    return sum(uses_layout(c) or isinstance(c, WINDOW_CACHES) for c in caches), len(caches)


def make_batch_cache(layer_rows: Sequence[Any]) -> Any:
    """The batch cache for one layer's decoding rows: rows in the KVarN pool (``PagedBatch``) or
    in the baselines' slots (``SlotBatch``), which their storage's decode step runs as one graph
    for all rows; rows of other caches (sliding windows, rotating windows) attend one by one
    (``BatchRows``)."""
    if layer_rows and isinstance(layer_rows[0], PagedLayer):
        return PagedBatch(layer_rows)
    if layer_rows and isinstance(layer_rows[0], SlotRow):
        return SlotBatch(layer_rows)
    return BatchRows(layer_rows, row_type=type(layer_rows[0]) if layer_rows else object)


def plan_decode(batches: Sequence[Any], pad: bool = True, counts: Sequence[int] | None = None) -> DecodePlan | None:
    """A decode step of these batch caches (one per layer) planned as arrays, so that it can be
    compiled (``kvarn.decode_graph``, ``kvarn.slot_step``): rows in the KVarN pool or in the
    baselines' slots, every layer's; None for anything else (layers of other caches: the model
    then runs through the batch caches, whose storage takes the same step layer by layer; slot
    rows attending one by one). ``counts``: tokens per row (a verify's; KVarN rows only:
    ``verifies_in_batch``)."""
    if batches and all(isinstance(b, PagedBatch) for b in batches):
        return paged_plan(batches, pad, counts)
    if batches and all(isinstance(b, SlotBatch) for b in batches) and not (counts and max(counts) > 1):
        return slot_plan(batches, pad)
    return None


def verifies_in_batch(cache: Sequence[Any]) -> bool:
    """Whether this row's verify (its last token and drafts) can ride in the planned decode batch
    (``plan_decode`` with counts): every layer a paged KVarN view, unwindowed; other rows verify in
    a chunk forward of their own (``engine/verify.py``)."""
    row = paged_row(cache)
    return row is not None and row.max_kv_size is None and all(isinstance(c, PagedLayer) for c in cache)


def batchable(cache: Sequence[Any]) -> bool:
    """Whether rows of these caches can decode as one batch (attention caches only: recurrent
    state cannot take a batch's rows)."""
    return all(isinstance(c, (KVCache, RotatingKVCache, QuantizedKVCache, AffineRotatingKVCache, PagedLayer, SlotRow))
               for c in cache)


# --- speculative verify: a row writes its drafted tokens, then drops the rejected ones ---

def verify_room(cache: Sequence[Any]) -> int:
    """How many tokens a verify (a chunk of the row's last token and its drafts) may write now:
    a paged row stays inside its tile (``PagedRow.verify_room``), a slot row inside its
    reservation; 0 where a layer cannot drop tokens again (rotating windows, recurrent state)."""
    row = paged_row(cache)
    room = row.verify_room() if row is not None else 1 << 30
    for layer in cache:
        if isinstance(layer, SlotRow):
            room = min(room, layer.capacity - layer.offset)
        elif not isinstance(layer, PagedLayer):
            return 0
    return room


def begin_verify(cache: Sequence[Any]) -> None:
    """The row's next chunk is a verify: a paged row commits no tile until ``end_verify``."""
    row = paged_row(cache)
    if row is not None:
        row.hold()


def end_verify(cache: Sequence[Any], rejected: int) -> None:
    """The verify's ``rejected`` newest tokens leave the row; a paged row then commits the tile
    its accepted tokens filled."""
    row = paged_row(cache)
    if row is not None:
        row.accept(rejected)
    for layer in cache:
        if isinstance(layer, SlotRow) and layer.trim(rejected) != rejected:
            raise RuntimeError("a slot row could not drop its rejected tokens")


# --- prefix reuse: blocks (exact tier) and whole-row snapshots (checkpoint tier) ---

def load_blocks(layer: Any, blocks: Sequence[Sequence[mx.array]], G: int) -> Any:
    """An fp16 / affine layer of a fresh row holding ``blocks`` (each the block's keys then values
    arrays: fp16 one each, affine a (codes, scales, biases) triple each) from token 0."""
    width = len(blocks[0]) // 2
    legs = [tuple(mx.concatenate([b[leg * width + j] for b in blocks], axis=2) for j in range(width))
            for leg in (0, 1)]
    keys, values = (leg[0] if width == 1 else leg for leg in legs)
    if isinstance(layer, SlotRow):
        layer.load(keys, values, offset=len(blocks) * G)
        return layer
    if isinstance(layer, (FP16KVCache, AffineKVCache)):
        layer.keys, layer.values = (_reserve(keys, layer.capacity), _reserve(values, layer.capacity)) if width == 1 \
            else (tuple(_reserve(p, layer.capacity) for p in keys), tuple(_reserve(p, layer.capacity) for p in values))
        layer.offset = len(blocks) * G
        return layer
    raise TypeError(f"{type(layer).__name__} rows cannot be rebuilt from blocks")


def _reserve(array: mx.array, capacity: int | None) -> mx.array:
    """``array`` [B, H, T, ...] in a buffer of ``capacity`` token slots (the row's reservation)."""
    tokens = array.shape[2]
    if capacity is None or capacity <= tokens:
        return array
    buffer = mx.zeros((*array.shape[:2], capacity, *array.shape[3:]), array.dtype)
    return mx.slice_update(buffer, array, mx.array([0]), axes=(2,))


def snapshot(cache: Sequence[Any]) -> tuple[list[dict[str, Any]], list[mx.array]] | None:
    """A whole row copied out: one meta entry per layer (the paged row once, at its first
    layer) and the arrays, for ``restore``; None if a layer's cache is one this does not know."""
    metas, arrays = [], []
    row = paged_row(cache)
    for layer in cache:
        if isinstance(layer, PagedLayer):
            meta, own = row.snapshot() if layer is row.layers[min(row.layers)] else ({}, [])
            meta = {"type": "paged", **meta}
        else:
            saved = _save_layer(layer)
            if saved is None:
                return None
            meta, own = saved
        metas.append({**meta, "n": len(own)})
        arrays += [mx.array(a) for a in own]
    return metas, arrays


def _save_layer(layer: Any) -> tuple[dict[str, Any], list[mx.array]] | None:
    if isinstance(layer, AffineRotatingKVCache):
        legs, arrays = layer.snapshot()
        return {"type": "affine_rotating", "legs": legs}, arrays
    if isinstance(layer, SlotRow):
        parts = [p for leg in layer.state for p in (leg if isinstance(leg, tuple) else (leg,))]
        return {"type": "affine" if layer.store.quantized else "kv", "offset": layer.offset}, parts
    if isinstance(layer, RotatingKVCache):  # mlx-lm's: its state names its ring position
        keys, values, offset, keep, max_size, idx = layer.state
        return {"type": "rotating", "ring": [offset, keep, max_size, idx]}, [keys, values]
    if isinstance(layer, QuantizedKVCache):
        n = layer.offset
        return {"type": "affine", "offset": n}, [p[..., :n, :] for leg in (layer.keys, layer.values) for p in leg]
    if isinstance(layer, KVCache):
        n = layer.offset
        return {"type": "kv", "offset": n}, [layer.keys[..., :n, :], layer.values[..., :n, :]]
    if isinstance(layer, ArraysCache):
        present = [i for i, a in enumerate(layer.cache) if a is not None]
        return {"type": "arrays", "present": present}, [layer.cache[i] for i in present]
    return None


def restore(fresh: list[Any], metas: list[dict[str, Any]], arrays: Sequence[mx.array]) -> list[Any]:
    """Fill a fresh row (with its reservation) from a ``snapshot``."""
    if len(metas) != len(fresh):
        raise ValueError("snapshot of another model")
    at, out = 0, []
    for layer, meta in zip(fresh, metas):
        mine = list(arrays[at: at + meta["n"]])
        at += meta["n"]
        out.append(_load_layer(layer, meta, mine))
    return out


def _load_layer(layer: Any, meta: dict[str, Any], arrays: list[mx.array]) -> Any:
    kind = meta["type"]
    if kind == "paged" and isinstance(layer, PagedLayer):
        if "views" in meta:  # the row's first layer carries the whole row
            layer.row.restore(meta, arrays)
        return layer
    if kind == "affine_rotating" and isinstance(layer, AffineRotatingKVCache):
        layer.restore(meta["legs"], arrays)
        return layer
    if kind in ("affine", "kv") and isinstance(layer, SlotRow):
        keys, values = (tuple(arrays[:3]), tuple(arrays[3:])) if kind == "affine" else arrays
        layer.load(keys, values, offset=meta["offset"])
        return layer
    if kind == "rotating" and isinstance(layer, RotatingKVCache):
        layer.state = (*arrays, *meta["ring"])
        return layer
    if kind in ("affine", "kv") and isinstance(layer, (KVCache, QuantizedKVCache)):
        capacity = getattr(layer, "capacity", None)
        legs = (tuple(arrays[:3]), tuple(arrays[3:])) if kind == "affine" else tuple(arrays)
        if kind == "affine":
            layer.keys, layer.values = (tuple(_reserve(p, capacity) for p in leg) for leg in legs)
        else:
            layer.keys, layer.values = (_reserve(a, capacity) for a in legs)
        layer.offset = meta["offset"]
        return layer
    if kind == "arrays" and isinstance(layer, ArraysCache):
        for i, a in zip(meta["present"], arrays):
            layer.cache[i] = a
        return layer
    raise ValueError(f"snapshot layer {kind} does not fit a {type(layer).__name__} row")
