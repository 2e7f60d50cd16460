"""Random paged decode cases (a pool layer with scattered blocks, windows, ragged rows) and an
independent float64 NumPy attention over them (``tests/kvarn/reference.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kvarn.layout import KVLayout
from kvarn.pool import RECORD_FIELDS, quantize_blocks
from metal.paged_plan import RowLengths
from tests.kvarn.reference import reference_attention, unpack


@dataclass
class Case:
    queries: mx.array
    records: dict[str, mx.array]
    win_k: mx.array
    win_v: mx.array
    table: mx.array | None
    lengths: RowLengths
    scale: float
    key_bits: int
    value_bits: int
    tables: list[list[int]]

    def kwargs(self) -> dict:
        return dict(queries=self.queries, records=self.records, win_k=self.win_k, win_v=self.win_v,
                    table=self.table, lengths=self.lengths, scale=self.scale, key_bits=self.key_bits,
                    value_bits=self.value_bits)


def row_parts(num_tokens: int, G: int) -> tuple[int, int, int]:
    """(sink_len, num_tiles, tail_len) of a decoding row of ``num_tokens`` (tails < G commit)."""
    sink = min(num_tokens, G)
    rest = max(0, num_tokens - G)
    return sink, rest // G, rest % G


def make_case(tokens: list[int], *, n_kv_heads: int, n_rep: int, head_dim: int, tile_size: int, key_bits: int,
              value_bits: int, dtype=mx.float16, window_dtype=mx.float16, seed: int = 0) -> Case:
    """Rows of ``tokens`` tokens; blocks and windows at shuffled ids (id 0 is the pad); window
    positions past a row's lengths hold large garbage that must stay masked."""
    rng = np.random.default_rng(seed)
    H, D, G = n_kv_heads, head_dim, tile_size
    parts = [row_parts(t, G) for t in tokens]
    total_tiles = sum(p[1] for p in parts)
    layout = KVLayout.kvarn((key_bits, value_bits), tile_size=G)
    n_blocks = total_tiles + 3
    ids = list(rng.permutation(np.arange(1, n_blocks))[:total_tiles])
    records = {}
    if total_tiles:
        scale_ch = rng.uniform(0.2, 3.0, size=(1, H, 1, D))  # uneven channels, as after rotation
        keys = (rng.standard_normal((total_tiles, H, G, D)) * scale_ch).astype(np.float16)
        vals = rng.standard_normal((total_tiles, H, G, D)).astype(np.float16)
        fields = quantize_blocks(mx.array(keys), mx.array(vals), layout)
        for name in RECORD_FIELDS:
            arr = np.array(fields[name])
            full = np.zeros((n_blocks, *arr.shape[1:]), arr.dtype)
            full[ids] = arr
            records[name] = mx.array(full)
    else:
        from kvarn.pool import record_shapes
        for name, (shape, dt) in record_shapes(layout, H, D).items():
            records[name] = mx.zeros((1, *shape), dt)
    n_win = len(tokens) + 2
    slots = [int(s) for s in rng.permutation(np.arange(1, n_win))[:len(tokens)]]
    win_k = (rng.standard_normal((n_win, H, 2 * G, D)) * 30).astype(np.float16)
    win_v = (rng.standard_normal((n_win, H, 2 * G, D)) * 30).astype(np.float16)
    for slot, (sink, _, tail) in zip(slots, parts):  # the valid part: ordinary magnitudes
        win_k[slot, :, :sink] = (rng.standard_normal((H, sink, D)) * 2).astype(np.float16)
        win_v[slot, :, :sink] = rng.standard_normal((H, sink, D)).astype(np.float16)
        win_k[slot, :, G:G + tail] = (rng.standard_normal((H, tail, D)) * 2).astype(np.float16)
        win_v[slot, :, G:G + tail] = rng.standard_normal((H, tail, D)).astype(np.float16)
    tables, at = [], 0
    for _, n, _ in parts:
        tables.append([int(i) for i in ids[at:at + n]])
        at += n
    nb = max(p[1] for p in parts)
    table = mx.array([t + [0] * (nb - len(t)) for t in tables], dtype=mx.int32) if nb else None
    q = rng.standard_normal((len(tokens), H * n_rep, 1, D)).astype(np.float32)
    return Case(queries=mx.array(q).astype(dtype), records=records, win_k=mx.array(win_k).astype(window_dtype),
                win_v=mx.array(win_v).astype(window_dtype), table=table,
                lengths=RowLengths(tuple(slots), tuple(p[0] for p in parts), tuple(p[2] for p in parts),
                                   tuple(p[1] for p in parts)),
                scale=D ** -0.5, key_bits=key_bits, value_bits=value_bits, tables=tables)


def _f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def dequantize_block(case: Case, block: int, h: int) -> tuple[np.ndarray, np.ndarray]:
    """Rotated K and V [G, D] of one block and head, in float64, from the stored fields."""
    r = case.records
    S, W, _ = r["k_codes"].shape[2:]
    G = r["k_r"].shape[-1]
    D = S * W
    kc = unpack(np.array(r["k_codes"][block, h]), case.key_bits, G).astype(np.float64)  # [S, W, G]
    k = (kc * _f64(r["k_alpha"][block, h])[..., None] + _f64(r["k_beta"][block, h])[..., None])
    k = k * _f64(r["k_r"][block, h])[:, None, :]
    keys = np.moveaxis(k, -1, 0).reshape(G, D)  # [G, S, W] -> [G, D]
    vc = unpack(np.array(r["v_codes"][block, h]), case.value_bits, D).astype(np.float64)  # [G, D]
    va = np.repeat(_f64(r["v_alpha"][block, h]), W, axis=-1)  # [G, S] -> [G, D]
    vb = np.repeat(_f64(r["v_beta"][block, h]), W, axis=-1)
    vals = (vc * va + vb) * _f64(r["v_c"][block, h])[None]
    return keys, vals


def numpy_attention(case: Case) -> np.ndarray:
    """[B, n_q, 1, D] float64: each row and KV head through ``reference_attention``."""
    q = _f64(case.queries)
    B, n_q, _, D = q.shape
    H = case.win_k.shape[1]
    G = case.win_k.shape[2] // 2
    n_rep = n_q // H
    wk, wv = _f64(case.win_k), _f64(case.win_v)
    out = np.zeros_like(q)
    L = case.lengths
    for b in range(B):
        s, sink, tail = L.slots[b], L.sink_len[b], L.tail_len[b]
        for h in range(H):
            recs = [dequantize_block(case, blk, h) for blk in case.tables[b]]
            out[b, h * n_rep:(h + 1) * n_rep] = reference_attention(
                q[b, h * n_rep:(h + 1) * n_rep], wk[s, h, :sink], wv[s, h, :sink], recs,
                wk[s, h, G:G + tail], wv[s, h, G:G + tail], case.scale)
    return out


def max_rel_error(a, b) -> float:
    """max |a - b| / max |b| over the whole output."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
