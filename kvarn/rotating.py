"""Windowed fp16 and affine rows (``--max-kv-size N``): mlx-lm's rotating cache.

fp16 rows are mlx-lm's own ``RotatingKVCache(max_size=N, keep=4)``, exactly what
``mlx_lm.generate(..., max_kv_size=N)`` makes, so greedy tokens match mlx-lm's (tested): a
decode token attends the first 4 tokens and the newest N - 4 (itself included); a prompt chunk
attends with mlx-lm's sliding-window mask over the last N - 1 tokens and the chunk. The one
change is allocation: a row allocates ``min(capacity, N)`` token slots at once (its reservation)
instead of growing by 256, so its bytes are known up front (the same tokens, the same values).

mlx-lm has no quantized rotating cache (``RotatingKVCache.to_quantized`` raises). The affine
window is the smallest honest one: each token is quantized as mlx-lm's ``QuantizedKVCache``
does (``mx.quantize``, group size, bits) and its codes, scales and biases rotate in three
rotating caches that move in lockstep (one per part), so it attends the same tokens as the
fp16 window, read through mlx-lm's quantized attention (``bits``/``group_size`` on the cache).

Bytes: ``min(T, N)`` tokens once decoding; a prompt chunk that runs past the window holds up to
N - 1 + chunk tokens until the next token trims it (mlx-lm keeps every chunk token's context).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache, _BaseCache

from kvarn.layout import ROTATING_KEEP, KVLayout


class FP16RotatingKVCache(RotatingKVCache):
    """mlx-lm's ``RotatingKVCache`` (keep 4) allocating ``min(capacity, max_size)`` slots at
    once; ``capacity`` None grows as mlx-lm does."""

    def __init__(self, max_size: int, keep: int = ROTATING_KEEP, capacity: int | None = None) -> None:
        super().__init__(max_size=max_size, keep=keep)
        self.capacity = capacity

    def _update_in_place(self, keys: mx.array, values: mx.array) -> Any:
        if self.capacity is not None:  # the first (and only) growth reaches the reservation or the window
            self.step = max(min(self.capacity, self.max_size) - self.offset, 1)
        return super()._update_in_place(keys, values)

    def fork(self) -> FP16RotatingKVCache:
        """A copy sharing the buffers through new array handles (a write of either copies)."""
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__)
        if self.keys is not None:
            other.keys, other.values = self.keys[...], self.values[...]
        return other


class AffineRotatingKVCache(_BaseCache):
    """An affine window: codes, scales and biases of keys and values in three rotating caches
    (``legs``) that rotate identically (the same token counts along the same axis). Speaks
    mlx-lm's quantized cache protocol: ``update_and_fetch`` returns (codes, scales, biases)
    triples, ``bits`` and ``group_size`` select mlx-lm's quantized attention."""

    def __init__(self, max_size: int, group_size: int, bits: int, capacity: int | None = None,
                 keep: int = ROTATING_KEEP) -> None:
        self.group_size, self.bits = group_size, bits
        self.legs = [FP16RotatingKVCache(max_size, keep, capacity) for _ in range(3)]

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[tuple, tuple]:
        qk = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        qv = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        out = [leg.update_and_fetch(k, v) for leg, k, v in zip(self.legs, qk, qv, strict=True)]
        return tuple(k for k, _ in out), tuple(v for _, v in out)

    @property
    def offset(self) -> int:
        return self.legs[0].offset

    @property
    def max_size(self) -> int:
        return self.legs[0].max_size

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return self.legs[0].make_mask(*args, **kwargs)

    def size(self) -> int:
        return self.legs[0].size()

    def empty(self) -> bool:
        return self.legs[0].empty()

    def is_trimmable(self) -> bool:
        return self.legs[0].is_trimmable()

    def trim(self, n: int) -> int:
        return [leg.trim(n) for leg in self.legs][0]

    @property
    def nbytes(self) -> int:
        return sum(leg.nbytes for leg in self.legs)

    def fork(self) -> AffineRotatingKVCache:
        other = type(self).__new__(type(self))
        other.group_size, other.bits = self.group_size, self.bits
        other.legs = [leg.fork() for leg in self.legs]
        return other

    # --- whole-row snapshots (the checkpoint tier: ``apc.reuse``) ---
    def snapshot(self) -> tuple[list[dict[str, int]], list[mx.array]]:
        """(each leg's indices, its keys and values part): what ``restore`` takes back."""
        metas = [{"offset": leg.offset, "keep": leg.keep, "max_size": leg.max_size, "idx": leg._idx}
                 for leg in self.legs]
        return metas, [a for leg in self.legs for a in (leg.keys, leg.values)]

    def restore(self, metas: list[dict[str, int]], arrays: list[mx.array]) -> None:
        for i, (leg, meta) in enumerate(zip(self.legs, metas, strict=True)):
            leg.keys, leg.values = arrays[2 * i], arrays[2 * i + 1]
            leg.offset, leg.keep, leg.max_size, leg._idx = meta["offset"], meta["keep"], meta["max_size"], meta["idx"]


WINDOW_CACHES = (FP16RotatingKVCache, AffineRotatingKVCache)


def make_window_cache(layout: KVLayout, capacity: int | None = None) -> Any:
    """One layer's windowed row for an fp16 or affine layout with ``max_kv_size``."""
    if layout.max_kv_size is None or layout.scheme == "kvarn":
        raise ValueError("rotating caches hold windowed fp16 / affine rows")
    if layout.scheme == "fp16":
        return FP16RotatingKVCache(layout.max_kv_size, capacity=capacity)
    return AffineRotatingKVCache(layout.max_kv_size, layout.group_size, layout.key_bits, capacity)
