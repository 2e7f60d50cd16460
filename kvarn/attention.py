"""The attention seam: the one entry from an mlx-lm model's attention into kvarn's storages.

mlx-lm models call ``scaled_dot_product_attention(queries, keys, values, cache, scale, mask)``
from ``mlx_lm.models.base`` after ``cache.update_and_fetch``; each model module binds that name at
import time. ``install_attention_seam`` (called once, by ``engine.make_engine``) replaces it in
every loaded ``mlx_lm.models.*`` module with ``make_dispatch``'s function, which routes by the
cache the model passes:

- KVarN rows in the pool (one row's chunk or token, or a whole decode batch):
  ``kvarn.paged_batch.paged_attention``;
- the baselines' slot rows decoding as one batch: the fused ragged kernel where the device has
  it (``kvarn.slot_attention``), one call per deep row where that is faster, else mlx-lm's own
  attention over all rows;
- other rows batched together (``kvarn.batch.BatchRows``): each row alone, through this dispatch;
- affine caches where MLX lacks ``quantized_matmul`` kernels (CUDA): dequantized first;
- anything else: mlx-lm's own function, unchanged.

mlx-lm 0.32 has no attention-backend hook to register with, so this is the one seam; a model
whose module no longer holds the name fails at start-up rather than silently running fp16.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

from kvarn.batch import BatchRows, batch_attention
from kvarn.paged import PagedLayer
from kvarn.paged_batch import PagedBatch, paged_attention, reads_codes_directly
from kvarn.slot_attention import attends_per_row, fused_decode, fused_decode_attention, per_row_attention
from kvarn.slots import SlotBatch

SEAM_NAME = "scaled_dot_product_attention"
_SEAM_MARK = "__kvarn_seam__"


def affine_dequantized_attention(queries: mx.array, keys: tuple, values: tuple, cache: QuantizedKVCache,
                                 scale: float, mask: Any, sinks: mx.array | None) -> mx.array:
    """mlx-lm's affine cache through dequantization: where MLX CUDA has no ``quantized_matmul``
    kernel for a sequence length (any odd one), this gives the same values to float noise."""
    k = mx.dequantize(*keys, group_size=cache.group_size, bits=cache.bits).astype(queries.dtype)
    v = mx.dequantize(*values, group_size=cache.group_size, bits=cache.bits).astype(queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)


def make_dispatch(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):  # noqa: ANN001
        if isinstance(cache, (PagedLayer, PagedBatch)):
            if sinks is not None:
                raise ValueError("KVarN attention does not support attention sinks")
            return paged_attention(queries, cache, scale, mask)
        if isinstance(cache, SlotBatch) and fused_decode(cache, queries, sinks):
            return fused_decode_attention(queries, cache, scale)
        if isinstance(cache, SlotBatch) and attends_per_row(cache):
            return per_row_attention(queries, keys, values, cache, scale, sinks)
        if isinstance(cache, BatchRows):
            return batch_attention(scaled_dot_product_attention, queries, cache, scale, mask, sinks)
        if isinstance(keys, tuple) and getattr(cache, "bits", None) is not None and not reads_codes_directly():
            return affine_dequantized_attention(queries, keys, values, cache, scale, mask, sinks)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    setattr(scaled_dot_product_attention, _SEAM_MARK, True)
    return scaled_dot_product_attention


def install_attention_seam(model: Any) -> list[str]:
    """Route every mlx-lm model module's ``scaled_dot_product_attention`` through KVarN.

    mlx-lm model modules bind the function at import time, so each loaded ``mlx_lm.models.*``
    module that holds it is patched. Fails loudly if the model's own module does not hold it
    (a new mlx-lm that moved the seam must not silently run fp16). Returns the patched modules.
    """
    own = sys.modules[type(model).__module__]
    if not callable(getattr(own, SEAM_NAME, None)):
        raise RuntimeError(f"{own.__name__} has no '{SEAM_NAME}': cannot route attention to KVarN "
                           "(mlx-lm's attention seam moved; refusing to run without it)")
    patched = []
    for name, module in list(sys.modules.items()):
        current = getattr(module, SEAM_NAME, None) if name.startswith("mlx_lm.models.") else None
        if current is None:
            continue
        if not getattr(current, _SEAM_MARK, False):  # installed once per module, never wrapped twice
            setattr(module, SEAM_NAME, make_dispatch(current))
        patched.append(name)
    if own.__name__ not in patched:
        raise RuntimeError(f"failed to install the KVarN attention seam in {own.__name__}")
    return patched
