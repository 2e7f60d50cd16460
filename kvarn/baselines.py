"""Per-sequence caches for every layout: KVarN, and the baselines behind the same flags:
fp16 (mlx-lm ``KVCache``) and affine (mlx-lm ``QuantizedKVCache``, bits and group size).

The engine gives every row a ``capacity`` (its reservation: prompt + max_tokens). The baselines
then allocate exactly that many token slots at their first update instead of mlx-lm's 256-token
steps, whose final size depends on how the prompt was chunked; so their bytes are known up front
(capacity pricing, ``engine.pricing``). KVarN stores exactly what it holds and needs no capacity.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from kvarn.cache import KVarNKVCache
from kvarn.layout import KVLayout


class _Reserved:
    """Mixin: the first update allocates ``capacity`` token slots (if set) in one piece."""

    capacity: int | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        if self.keys is None and self.capacity is not None and keys.shape[2] <= self.capacity:
            self.step = self.capacity  # mlx-lm allocates ceil(L / step) * step slots
            try:
                return super().update_and_fetch(keys, values)
            finally:
                del self.step
        return super().update_and_fetch(keys, values)

    def fork(self) -> Any:
        """A copy sharing this row's buffers through new array handles: the first write of either
        row copies the buffer (MLX never writes a shared buffer in place), the other keeps its own."""
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__)
        if self.keys is not None:
            other.keys, other.values = tree_map(lambda a: a[...], (self.keys, self.values))
        return other


class FP16KVCache(_Reserved, KVCache):
    """mlx-lm's ``KVCache`` with an exact reservation (keys and values in the compute dtype)."""

    def __init__(self, capacity: int | None = None) -> None:
        super().__init__()
        self.capacity = capacity


class AffineKVCache(_Reserved, QuantizedKVCache):
    """mlx-lm's ``QuantizedKVCache`` with an exact reservation."""

    def __init__(self, group_size: int, bits: int, capacity: int | None = None) -> None:
        super().__init__(group_size=group_size, bits=bits)
        self.capacity = capacity


def make_cache(model: nn.Module, layout: KVLayout, capacity: int | None = None) -> list[Any]:
    """A fresh per-sequence cache (one entry per layer) for ``layout``.

    Only plain full-attention layers (mlx-lm ``KVCache``) take the layout; layers with a cache
    structure of their own (sliding windows, recurrent state) keep it, unquantized for now. With
    ``layout.max_kv_size`` fp16 / affine layers are rotating windows (``kvarn.rotating``) and
    KVarN layers windowed single-stream caches.
    """
    return [_for_layer(cache, layout, capacity) for cache in make_prompt_cache(model)]


def _for_layer(cache: Any, layout: KVLayout, capacity: int | None) -> Any:
    if type(cache) is not KVCache:
        return cache
    if layout.max_kv_size is not None and layout.scheme != "kvarn":
        from kvarn.rotating import make_window_cache

        return make_window_cache(layout, capacity)
    if layout.scheme == "fp16":
        return FP16KVCache(capacity)
    if layout.scheme == "affine":
        return AffineKVCache(layout.group_size, layout.key_bits, capacity)
    return KVarNKVCache(layout)


def uses_layout(cache: Any) -> bool:
    """Whether a layer cache is one of the layout's caches (others keep their model's own)."""
    from kvarn.paged import PagedLayer
    from kvarn.slots import SlotRow

    return isinstance(cache, (KVarNKVCache, FP16KVCache, AffineKVCache, PagedLayer, SlotRow))


def count_quantized_layers(model: nn.Module, layout: KVLayout) -> tuple[int, int]:
    """(layers that use ``layout``, windowed fp16 / affine rows included, all layers)."""
    from kvarn.rotating import WINDOW_CACHES

    caches = make_cache(model, layout)
    return sum(uses_layout(c) or isinstance(c, WINDOW_CACHES) for c in caches), len(caches)


def fork_cache(cache: list[Any]) -> list[Any]:
    """A second row with the same history (``n > 1``): no re-prefill, no re-quantization."""
    return [layer.fork() if hasattr(layer, "fork") else _fork_other(layer) for layer in cache]


def _fork_other(layer: Any) -> Any:
    """Any other mlx-lm cache (sliding window, recurrent state): a shallow copy whose arrays are
    new handles on the same buffers, so an in-place write of either copies instead of sharing."""
    def handle(value: Any) -> Any:
        if isinstance(value, mx.array):
            return value[...]
        if isinstance(value, (list, tuple)):
            return type(value)(handle(v) for v in value)
        return value

    other = type(layer).__new__(type(layer))
    other.__dict__.update({name: handle(value) for name, value in layer.__dict__.items()})
    return other


def cache_nbytes(cache: list[Any]) -> int:
    return sum(c.nbytes for c in cache)
