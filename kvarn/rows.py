"""How the engine stores a row: one cache per layer, made, forked and released here.

- KVarN, when every layer of the model takes the layout (plain attention models): the layers are
  views of one ``PagedRow`` in the runner's ``KVarNPool`` (block tables; ``kvarn.paged``), so a
  decode batch runs one graph per layer for all rows.
- Models with layers of their own (sliding windows, recurrent state) keep single-stream rows
  (``kvarn.baselines.make_cache``): their prefix reuse is whole-row snapshots (the checkpoint
  tier), which needs each layer's own ``state``.
- fp16 / affine: the baselines of ``kvarn.baselines`` with exact reservations.
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

from kvarn.baselines import fork_cache, make_cache
from kvarn.layout import KVLayout
from kvarn.paged import PagedLayer, PagedRow, fork_rows
from kvarn.pool import KVarNPool


class RowStore:
    """The rows of one model under one layout (owned by the engine's model runner)."""

    def __init__(self, model: nn.Module, layout: KVLayout) -> None:
        self.model = model
        self.layout = layout
        base = make_prompt_cache(model)
        self.num_layers = len(base)
        paged = layout.scheme == "kvarn" and all(type(c) is KVCache for c in base)
        self.pool = KVarNPool(layout, self.num_layers) if paged else None

    @property
    def paged(self) -> bool:
        return self.pool is not None

    def new_row(self, capacity: int | None) -> list[Any]:
        """A fresh row (one cache per layer) reserving ``capacity`` tokens."""
        if self.pool is None:
            return make_cache(self.model, self.layout, capacity)
        row = PagedRow(self.pool, range(self.num_layers))
        return [row.layers[l] for l in range(self.num_layers)]

    def fork(self, cache: list[Any]) -> list[Any]:
        """A second row with the same history (``n > 1``): shared blocks, no re-quantization."""
        return fork_rows(cache) if self.pool is not None else fork_cache(cache)

    @staticmethod
    def release(cache: list[Any]) -> None:
        """Give a row's blocks back (rows of other kinds are freed with their arrays)."""
        for layer in cache:
            if isinstance(layer, PagedLayer):
                layer.release()

    def arrays(self) -> list[Any]:
        """The pool's arrays (what a prefill chunk's evaluation settles), empty without a pool."""
        if self.pool is None:
            return []
        return [a for layer in self.pool.layers for a in layer.arrays()]
