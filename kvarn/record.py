"""Committed records of one layer: quantized tiles laid out for MLX-native attention.

For B rows, H KV heads, S slices of W channels (D = S*W), G tokens per tile, n tiles:

    keys   codes [B,H,S,W, n*G*bk/32]  quantized along tokens, group G = one channel of one tile
           alpha, beta [B,H,S,W,n]     (MLX scales/biases of those groups)   r [B,H,S, n*G]
    values codes [B,H,n,G, D*bv/32]    quantized along channels, group W = one slice of one token
           alpha, beta [B,H,n,G,S]                                            c [B,H,n, D]

Storage holds exactly the committed tiles; arrays are never written in place (see RecordStore).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from kvarn.layout import KVLayout
from kvarn.quantize import quantize_keys, quantize_values

_FIELDS = ("k_codes", "k_alpha", "k_beta", "k_r", "v_codes", "v_alpha", "v_beta", "v_c")
# axis along which each field grows with the number of tiles
TILE_AXIS = {"k_codes": 4, "k_alpha": 4, "k_beta": 4, "k_r": 3, "v_codes": 2, "v_alpha": 2, "v_beta": 2, "v_c": 2}


@dataclass
class RecordArrays:
    """The record fields, each sliced or allocated along its tile axis."""

    k_codes: mx.array
    k_alpha: mx.array
    k_beta: mx.array
    k_r: mx.array
    v_codes: mx.array
    v_alpha: mx.array
    v_beta: mx.array
    v_c: mx.array


def quantize_tiles(keys: mx.array, values: mx.array, layout: KVLayout) -> RecordArrays:
    """Quantize rotated tiles [B,H,n,G,D] into record fields for those n tiles."""
    B, H, n, G, D = keys.shape
    W = layout.slice_width(D)
    S = D // W
    k = keys.reshape(B, H, n, G, S, W).transpose(0, 1, 2, 4, 3, 5)  # [B,H,n,S,G,W]
    v = values.reshape(B, H, n, G, S, W).transpose(0, 1, 2, 4, 3, 5)
    kt = quantize_keys(k, layout.key_bits, layout.iters)
    vt = quantize_values(v, layout.value_bits, layout.iters)
    words_k = G * layout.key_bits // 32
    return RecordArrays(
        k_codes=kt.codes.transpose(0, 1, 3, 4, 2, 5).reshape(B, H, S, W, n * words_k),
        k_alpha=kt.alpha.transpose(0, 1, 3, 4, 2),
        k_beta=kt.beta.transpose(0, 1, 3, 4, 2),
        k_r=kt.r.transpose(0, 1, 3, 2, 4).reshape(B, H, S, n * G),
        v_codes=vt.codes.transpose(0, 1, 2, 4, 3, 5).reshape(B, H, n, G, -1),
        v_alpha=vt.alpha.transpose(0, 1, 2, 4, 3),
        v_beta=vt.beta.transpose(0, 1, 2, 4, 3),
        v_c=vt.c.reshape(B, H, n, D),
    )


def _tile_len(name: str, tiles: int, layout: KVLayout) -> int:
    """Length along the tile axis of ``tiles`` tiles of field ``name``."""
    if name == "k_codes":
        return tiles * layout.tile_size * layout.key_bits // 32
    if name == "k_r":
        return tiles * layout.tile_size
    return tiles


class RecordStore:
    """Committed records of one layer, append-only and never written in place.

    Each commit makes new arrays (old records + new tiles), so the arrays a store hands out are
    immutable: a fork of a row (``n > 1``), a snapshot or the prefix cache may share them and
    nothing they hold ever changes. Storage is exactly the committed tiles (no slack), which is
    what capacity pricing charges; the copy per commit is one layer's records every G tokens.
    """

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.num_tiles = 0
        self.arrays: RecordArrays | None = None

    def append(self, new: RecordArrays, num_new: int) -> None:
        if self.arrays is None:
            self.arrays = new
        else:
            self.arrays = RecordArrays(**{name: mx.concatenate([getattr(self.arrays, name), getattr(new, name)],
                                                               axis=TILE_AXIS[name]) for name in _FIELDS})
        self.num_tiles += num_new

    def drop_front(self, n: int) -> None:
        """Forget the ``n`` oldest records (a windowed row's evicted ones): the arrays become
        slices of the newer ones (the next commit's concatenation copies them out)."""
        if not 0 <= n <= self.num_tiles:
            raise ValueError(f"cannot drop {n} of {self.num_tiles} records")
        if n == 0:
            return
        self.num_tiles -= n
        if self.num_tiles == 0:
            self.arrays = None
            return
        assert self.arrays is not None
        self.arrays = RecordArrays(**{name: getattr(self.arrays, name)[
            (slice(None),) * TILE_AXIS[name] + (slice(_tile_len(name, n, self.layout), None),)] for name in _FIELDS})

    def fork(self) -> RecordStore:
        """A store sharing these records (safe: they are never written in place)."""
        other = RecordStore(self.layout)
        other.num_tiles, other.arrays = self.num_tiles, self.arrays
        return other

    def tile(self, index: int) -> RecordArrays:
        """Record ``index`` alone (slices of the stored arrays: nothing is copied or re-quantized)."""
        if not 0 <= index < self.num_tiles:
            raise IndexError(f"record {index} of {self.num_tiles}")
        assert self.arrays is not None
        fields = {}
        for name in _FIELDS:
            axis = TILE_AXIS[name]
            start, end = _tile_len(name, index, self.layout), _tile_len(name, index + 1, self.layout)
            fields[name] = getattr(self.arrays, name)[(slice(None),) * axis + (slice(start, end),)]
        return RecordArrays(**fields)

    def view(self) -> RecordArrays | None:
        """The committed records, or None when there are none."""
        return self.arrays if self.num_tiles else None

    @property
    def nbytes(self) -> int:
        """Bytes of the committed records (exactly what they hold in memory)."""
        return 0 if self.arrays is None else sum(getattr(self.arrays, name).nbytes for name in _FIELDS)
