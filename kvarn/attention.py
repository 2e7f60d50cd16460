"""The attention seam: the one entry from an mlx-lm model's attention into kvarn's storages.

mlx-lm models call ``scaled_dot_product_attention(queries, keys, values, cache, scale, mask)``
from ``mlx_lm.models.base`` after ``cache.update_and_fetch``; each model module binds that name at
import time. ``install_attention_seam`` (called once, by ``engine.make_engine``) replaces it in
every loaded ``mlx_lm.models.*`` module with ``make_dispatch``'s function, which routes by the
cache the model passes, by capability: a storage that attends its own way has
``attend(queries, keys, values, *, scale, mask, sinks, dispatch, default)``, and no class is
named here:

- ``kvarn.paged.PagedLayer.attend``: one KVarN row's prompt chunk (``kvarn.chunk_attention``) or
  lone decode token; a decode step's layer (``kvarn.decode_graph.PagedStepLayer.attend``, also
  behind ``kvarn.paged.PagedBatch``): a whole decode batch in one graph (``kvarn.paged_attention``);
- ``kvarn.slot_step.SlotStepLayer.attend`` (also behind ``kvarn.slots.SlotBatch``): the
  baselines' decode batch (the fused ragged kernel where the device has it, one call per deep row
  where that is faster, else ``default``);
- ``kvarn.batch.BatchRows.attend``: other rows batched together, each row through ``dispatch``;
- any other cache: ``default``, mlx-lm's own function (affine codes dequantized first where MLX
  lacks their ``quantized_matmul`` kernels, CUDA).

mlx-lm 0.32 has no attention-backend hook to register with, so this is the one seam; a model
whose module no longer holds the name fails at start-up rather than silently running fp16.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache

from kvarn.paged_attention import reads_codes_directly

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
    """The seam around mlx-lm's ``original`` function: a cache that knows how it attends (it has
    ``attend``: paged KVarN rows and batches, slot batches, batches of other rows) is asked;
    otherwise mlx-lm's own attention runs (affine codes dequantized first where MLX lacks their
    kernels)."""
    def default(queries, keys, values, cache, scale, mask, sinks=None):  # noqa: ANN001
        if isinstance(keys, tuple) and getattr(cache, "bits", None) is not None and not reads_codes_directly():
            return affine_dequantized_attention(queries, keys, values, cache, scale, mask, sinks)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):  # noqa: ANN001
        attend = getattr(cache, "attend", None)
        if attend is None:
            return default(queries, keys, values, cache, scale, mask, sinks)
        return attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks,
                      dispatch=scaled_dot_product_attention, default=default)

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
