"""What a paged KVarN row must hold, worked out from the keys and values it was fed, and what it
does hold, read out of its pool: for asserting the one KVarN storage byte for byte.

A row fed tokens 0 .. n-1 (in any chunks, alone or in any decode batch) holds

    window slot   [ sink: tokens 0 .. min(n, G)-1 | tail: the tokens after the last full tile ]
    records       record r = tile r + 1 (tokens (r+1)G .. (r+2)G-1), quantized on its own

with keys and values rotated and rounded to float16; so its contents are a function of its
tokens alone (``expected_row``), which is what makes records byte-identical however the prompt
was chunked or batched. Decode attention over a row's stored contents has an independent float64
reference (``reference_decode``: ``tests/metal/cases.py``'s NumPy attention).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from kvarn.layout import KVLayout
from kvarn.paged import PagedLayer
from kvarn.pool import RECORD_FIELDS, quantize_blocks_reference
from kvarn.quantize import rotate
from metal.paged_plan import RowLengths
from tests.metal.cases import Case, numpy_attention

WINDOW_PARTS = ("sink_k", "sink_v", "tail_k", "tail_v")


class Fed:
    """The keys and values a row was fed so far (what it must hold)."""

    def __init__(self) -> None:
        self.keys: list[mx.array] = []
        self.values: list[mx.array] = []

    def add(self, k: mx.array, v: mx.array) -> None:
        self.keys.append(k)
        self.values.append(v)

    def all(self) -> tuple[mx.array, mx.array]:
        return mx.concatenate(self.keys, axis=2), mx.concatenate(self.values, axis=2)


def expected_counts(n: int, G: int) -> tuple[int, int, int]:
    """(offset, tail_len, num_tiles) of a row of ``n`` tokens."""
    rest = max(0, n - G)
    return n, rest % G, rest // G


def expected_row(keys: mx.array, values: mx.array, layout: KVLayout) -> dict[str, object]:
    """What a row fed ``keys``, ``values`` [1, H, n, D] (all its tokens, in order) holds: its
    counters, its sink and tail as float16, and its records as the pure-MLX quantizer makes
    each tile (block-major fields [num_tiles, ...])."""
    G = layout.tile_size
    _, H, n, D = keys.shape
    k16, v16 = (rotate(x.astype(mx.float32)).astype(mx.float16) for x in (keys, values))
    offset, tail_len, num_tiles = expected_counts(n, G)
    end = G + num_tiles * G  # where the tail starts
    out: dict[str, object] = {"counters": (offset, tail_len, num_tiles),
                              "sink_k": k16[0, :, : min(n, G)], "sink_v": v16[0, :, : min(n, G)],
                              "tail_k": k16[0, :, end: n], "tail_v": v16[0, :, end: n]}
    if num_tiles:
        tiles = [x[0, :, G: end].reshape(H, num_tiles, G, D).transpose(1, 0, 2, 3) for x in (k16, v16)]
        out.update(quantize_blocks_reference(*tiles, layout))
    return {name: np.array(x) if isinstance(x, mx.array) else x for name, x in out.items()}


def row_contents(view: PagedLayer) -> dict[str, object]:
    """What ``view``'s row holds in its layer: counters, sink and tail (as float16: a float32
    window holds float16 values), and the records of its table, block-major."""
    pool, row, G = view.row.pool, view.row, view.layout.tile_size
    a = pool.layers[view.l]
    window = {"sink_k": a.win_k[row.slot, :, : view.sink_len], "sink_v": a.win_v[row.slot, :, : view.sink_len],
              "tail_k": a.win_k[row.slot, :, G: G + view.tail_len], "tail_v": a.win_v[row.slot, :, G: G + view.tail_len]}
    out: dict[str, object] = {"counters": (view.offset, view.tail_len, view.num_tiles)}
    for name, x in window.items():
        held = np.array(x)
        assert np.array_equal(held.astype(np.float16).astype(held.dtype), held), f"{name} is not float16 values"
        out[name] = held.astype(np.float16)
    blocks = row.table[: view.num_tiles - row.first]
    if blocks:
        out.update({name: np.array(x) for name, x in
                    pool.gather_records(view.l, mx.array(blocks, dtype=mx.int32)).items()})
    return out


def assert_same_bytes(got: dict[str, object], want: dict[str, object]) -> None:
    """Two row contents (``expected_row`` / ``row_contents``) equal: counters, and every array's
    dtype, shape and bytes."""
    assert got["counters"] == want["counters"]
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for name in (*WINDOW_PARTS, *(n for n in RECORD_FIELDS if n in want)):
        x, y = got[name], want[name]
        assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), name


def assert_row_holds(view: PagedLayer, keys: mx.array, values: mx.array) -> None:
    """``view``'s row holds exactly what a row fed ``keys``, ``values`` must hold, and its bytes
    are what the layout prices for that many tokens."""
    assert_same_bytes(row_contents(view), expected_row(keys, values, view.layout))
    _, H, n, D = keys.shape
    assert view.nbytes == view.layout.sequence_bytes(n, D, H)


def reference_decode(queries: mx.array, views: Sequence[PagedLayer], scale: float) -> np.ndarray:
    """Float64 decode attention [B, n_q, 1, D] of each row over what it holds (sink, the records
    of its table, tail), read out of the pool (views of one layer of one pool, after the step's
    write)."""
    view0 = views[0]
    a, layout = view0.row.pool.layers[view0.l], view0.layout
    tables = [v.row.table[: v.num_tiles - v.row.first] for v in views]
    lengths = RowLengths(tuple(v.row.slot for v in views), tuple(v.sink_len for v in views),
                         tuple(v.tail_len for v in views), tuple(len(t) for t in tables))
    case = Case(queries=queries, records=a.records, win_k=a.win_k, win_v=a.win_v, table=None, lengths=lengths,
                scale=scale, key_bits=layout.key_bits, value_bits=layout.value_bits, tables=tables)
    return numpy_attention(case)


def paged_attention(queries: mx.array, cache: Any, scale: float, mask: Any) -> mx.array:
    """A paged cache's attention (one row's chunk or token, or a whole decode batch) after its
    ``update_and_fetch``, as the attention seam runs it inside a model's forward."""
    return cache.attend(queries, cache, cache, scale=scale, mask=mask, sinks=None, dispatch=None, default=None)
