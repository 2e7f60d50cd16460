"""Baseline KV caches behind the same layout flags as KVarN: fp16 (mlx-lm ``KVCache``)."""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from kvarn.layout import KVLayout


def make_cache(model: nn.Module, layout: KVLayout) -> list[Any]:
    """A fresh per-sequence cache (one entry per layer) for ``layout``. Models with their own
    cache structure (sliding windows, recurrent layers) keep it: mlx-lm builds it for them."""
    if layout.scheme == "fp16":
        return make_prompt_cache(model)
    raise ValueError(f"no cache for KV scheme {layout.scheme!r}")


def cache_nbytes(cache: list[Any]) -> int:
    return sum(c.nbytes for c in cache)
