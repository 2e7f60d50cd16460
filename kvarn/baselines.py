"""The baselines' per-row caches outside the engine's slots: fp16 (mlx-lm ``KVCache``) and affine
(mlx-lm ``QuantizedKVCache``, bits and group size), as ``kvarn.rows.make_cache`` makes them.

A row given a ``capacity`` (its reservation: prompt + max_tokens) allocates exactly that many
token slots at its first update instead of mlx-lm's 256-token steps, whose final size depends on
how the prompt was chunked; so its bytes are known up front (capacity pricing, ``engine.pricing``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache, QuantizedKVCache


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


def fork_other(layer: Any) -> Any:
    """A fork of any other mlx-lm cache (sliding window, recurrent state): a shallow copy whose arrays are
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
