"""Prefix reuse of rows in every storage: a fresh fp16 / affine row rebuilt from cached blocks
(``load_blocks``, the exact tier's disk and memory hits of the baselines; KVarN rows adopt pool
blocks instead: ``apc/pool_tier.py``), and whole rows copied out and back (``snapshot`` /
``restore``, the checkpoint tier of models with layers of their own). Each storage's layers are
saved and loaded in their own form; ``kvarn.rows`` makes the rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

from kvarn.baselines import AffineKVCache, FP16KVCache
from kvarn.paged import PagedLayer
from kvarn.rotating import AffineRotatingKVCache
from kvarn.rows import paged_row
from kvarn.slots import SlotRow


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
