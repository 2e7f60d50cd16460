"""How the engine stores a row: one cache per layer, made, forked and released here.

- KVarN, when every layer of the model takes the layout (plain attention models): the layers are
  views of one ``PagedRow`` in the runner's ``KVarNPool`` (block tables; ``kvarn.paged``), so a
  decode batch runs one graph per layer for all rows.
- Models with layers of their own (sliding windows, recurrent state) keep single-stream rows
  (``kvarn.baselines.make_cache``): their prefix reuse is whole-row snapshots (the checkpoint
  tier), which needs each layer's own ``state``.
- fp16 / affine: every plain attention layer's rows share one slot buffer per layer
  (``kvarn.slots``), so a decode batch runs one fused attention per layer; other layers keep
  their model's own caches. With ``--max-kv-size`` they are rotating caches of their own
  (``kvarn.rotating``, as mlx-lm's ``max_kv_size``), batched row by row.
- Without a capacity (rows made outside the engine) the per-row caches of ``kvarn.baselines``.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from kvarn.baselines import fork_cache, make_cache
from kvarn.layout import KVLayout
from kvarn.paged import PagedLayer, PagedRow, fork_rows
from kvarn.pool import KVarNPool
from kvarn.slots import SlotRow, make_row_cache, make_stores


class RowStore:
    """The rows of one model under one layout (owned by the engine's model runner)."""

    def __init__(self, model: nn.Module, layout: KVLayout) -> None:
        self.model = model
        self.layout = layout
        base = make_prompt_cache(model)
        self.num_layers = len(base)
        paged = layout.scheme == "kvarn" and all(type(c) is KVCache for c in base)
        self.pool = KVarNPool(layout, self.num_layers) if paged else None
        if layout.scheme == "kvarn" and layout.max_kv_size is not None and not paged:
            raise ValueError("--max-kv-size with kvarn needs a model whose every layer is plain attention "
                             "(its rows in the block pool); this model has layers of its own (sliding windows, "
                             "recurrent state): use --kv-scheme fp16 or affine")
        # windowed fp16 / affine rows are rotating caches of their own (``kvarn.rotating``), not slots
        windowed = layout.max_kv_size is not None
        self.slots = make_stores(model, layout) if layout.scheme != "kvarn" and not windowed else None

    @property
    def paged(self) -> bool:
        return self.pool is not None

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
        row = PagedRow(self.pool, range(self.num_layers), self.layout.max_kv_size)
        return [row.layers[l] for l in range(self.num_layers)]

    @staticmethod
    def settle(cache: list[Any]) -> None:
        """After a prompt chunk was evaluated: a windowed paged row drops the records its next
        token will not attend (every layer has read them by now)."""
        if cache and isinstance(cache[0], PagedLayer):
            cache[0].row.evict()

    def fork(self, cache: list[Any]) -> list[Any]:
        """A second row with the same history (``n > 1``): shared blocks, no re-quantization."""
        return fork_rows(cache) if self.pool is not None else fork_cache(cache)

    @staticmethod
    def release(cache: list[Any]) -> None:
        """Give a row's blocks back (rows of other kinds are freed with their arrays)."""
        for layer in cache:
            if isinstance(layer, (PagedLayer, SlotRow)):
                layer.release()
