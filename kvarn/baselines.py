"""Per-sequence caches for every layout: KVarN, and the baselines behind the same flags:
fp16 (mlx-lm ``KVCache``) and affine (mlx-lm ``QuantizedKVCache``, bits and group size)."""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from kvarn.cache import KVarNKVCache
from kvarn.layout import KVLayout


def make_cache(model: nn.Module, layout: KVLayout) -> list[Any]:
    """A fresh per-sequence cache (one entry per layer) for ``layout``.

    Only plain full-attention layers (mlx-lm ``KVCache``) take the layout; layers with a cache
    structure of their own (sliding windows, recurrent state) keep it, unquantized for now.
    """
    return [_for_layer(cache, layout) for cache in make_prompt_cache(model)]


def _for_layer(cache: Any, layout: KVLayout) -> Any:
    if type(cache) is not KVCache or layout.scheme == "fp16":
        return cache
    if layout.scheme == "affine":
        return QuantizedKVCache(group_size=layout.group_size, bits=layout.key_bits)
    return KVarNKVCache(layout)


def count_quantized_layers(model: nn.Module, layout: KVLayout) -> tuple[int, int]:
    """(layers that use ``layout``, all layers)."""
    caches = make_cache(model, layout)
    if layout.scheme == "fp16":
        return sum(type(c) is KVCache for c in caches), len(caches)
    return sum(isinstance(c, (KVarNKVCache, QuantizedKVCache)) for c in caches), len(caches)


def cache_nbytes(cache: list[Any]) -> int:
    return sum(c.nbytes for c in cache)
