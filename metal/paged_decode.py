"""Fused paged decode attention over the KVarN block pool (CUDA, ``mx.fast.cuda_kernel``).

One launch attends every decoding row of one layer: split-K flash decoding over each row's tiles,
read in place from the pool (``kvarn/pool.py``: records block-major, windows one a row), K and V
dequantized in registers, online softmax in float32, the n_q/H query heads of a KV head folded into
one block so each tile is read once per KV head. A second tiny launch combines the splits and
rotates back. Design notes: docs/kernels.md.

A row's tiles, in sequence order, and how the work list cuts them into splits::

    tile  0      1 .. nt                 nt+1 (only if tail_len > 0)
          sink | record table[b][0] ... | tail
          win[slot, :, 0:sink_len]       win[slot, :, G:G+tail_len]
    work item = (row b, first tile, end tile); one block per (work item, KV head)

Scores use the factored keys K[g, d] = (code[d, g] * alpha[d] + beta[d]) * r[g]:
s[g] = sum_s r[s, g] * (sum_{d in s} (q[d] alpha[d]) code[d, g] + sum_{d in s} q[d] beta[d]); values
likewise: o[d] += c[d] * (sum_g (p[g] v_alpha[g]) code[g, d] + sum_g p[g] v_beta[g]) per tile.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from metal.paged_decode_mma import MMA_HEADER, MMA_SOURCE, mma_shared_bytes, mma_supported
from metal.paged_decode_source import ATTENTION_SOURCE, COMBINE_SOURCE, HEADER

NUM_THREADS = 128  # one block: 4 warps
NUM_SMS = 132  # H200; the split policy aims at a few blocks per multiprocessor
BLOCKS_PER_SM = 3  # the tensor-core body's resident blocks (58.7 KB of shared memory each at k4v2): one wave of splits
SCALAR_BLOCKS_PER_SM = 16  # the scalar body's split target (measured on the H200: 4 left the multiprocessors idle)
# one work item a row (one launch, no combine) when rows x KV heads fill a wave of blocks, or when no row has
# more tiles than SINGLE_MAX_TILES (the best of both plans at each shape measured on the H200: docs/benchmarks.md,
# "Kernels"). A few long rows are split: the kernel benchmark favoured one item a row for <= 32 row-heads
# (1 x 32k: 0.054 vs 0.073 ms), but through the engine one 16k row decoded in 11.8 ms a step split against
# 18.5 ms as one item (8B shape, same place): 8 blocks streaming 130 tiles each left the GPU waiting
SINGLE_MIN_BLOCKS = BLOCKS_PER_SM * NUM_SMS
SINGLE_MAX_TILES = 64
SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_TILE_SIZES = (64, 128)
MAX_REP = 8  # query heads per KV head folded into one block
MAX_SHARED = 227 * 1024  # dynamic shared memory one block may have (Hopper)
RECORD_FIELDS = ("k_codes", "k_alpha", "k_beta", "k_r", "v_codes", "v_alpha", "v_beta", "v_c")

ATTENTION_INPUTS = ["queries", "win_k", "win_v", *RECORD_FIELDS, "table", "rows", "work", "meta", "meta_f"]
ATTENTION_OUTPUTS = ["part_o", "part_ml"]
COMBINE_INPUTS = ["part_o", "part_ml", "row_work"]
COMBINE_OUTPUTS = ["out"]


def shared_bytes(head_dim: int, tile_size: int, key_bits: int, value_bits: int, n_rep: int) -> int:
    """Dynamic shared memory of the attention kernel (the layout at the top of ATTENTION_SOURCE)."""
    D, G, NR = head_dim, tile_size, n_rep
    S = max(1, D // 128)
    words = D * G * key_bits // 32 + G * D * value_bits // 32
    floats = 2 * D * NR + S * G + 2 * G * S + D + S * G * NR + 4 * S * NR + 4 * NR * (1 + S) + NR * D
    return 4 * (words + floats)


@dataclass(frozen=True)
class Variant:
    """Which attention body runs and its compile-time knobs (the benchmark compares them).

    ``kind``: "auto" (the tensor-core body where ``mma_supported``, else the scalar one), "mma" or
    "scalar"; ``stages``: cp.async stages of the tensor-core body; ``fold_k`` / ``fold_v``: keep the
    1024 offset of the int->half conversion in the product and subtract it from the float32 result
    (one instruction less per code pair) instead of converting to exact codes."""

    kind: str = "auto"
    stages: int = 2
    fold_k: int = 0
    fold_v: int = 0


DEFAULT_VARIANT = Variant()
_KERNELS: dict[tuple, object] = {}


def _kernel(name: str, header: str, source: str, input_names: list[str], output_names: list[str], smem: int):
    key = (name, smem)
    if key not in _KERNELS:
        _KERNELS[key] = mx.fast.cuda_kernel(name=name, input_names=input_names, output_names=output_names,
                                            source=source, header=header, shared_memory=smem)
    return _KERNELS[key]


_META: dict[tuple[int, float], tuple[mx.array, mx.array]] = {}


def _meta(nb: int, scale: float) -> tuple[mx.array, mx.array]:
    """A kernel's two scalar inputs (an int: the table width here, T_cap for ``metal.ragged_decode``;
    the softmax scale), made once per value."""
    key = (nb, float(scale))
    if key not in _META:
        if len(_META) > 256:
            _META.clear()
        _META[key] = (mx.array([nb], dtype=mx.int32), mx.array([scale], dtype=mx.float32))
    return _META[key]


@dataclass(frozen=True)
class RowLengths:
    """Per-row host ints of one decode step: window ``slots``, ``sink_len`` (<= G), ``tail_len``
    (< G) and ``num_tiles`` (records); row b attends sink_len + num_tiles*G + tail_len tokens."""

    slots: tuple[int, ...]
    sink_len: tuple[int, ...]
    tail_len: tuple[int, ...]
    num_tiles: tuple[int, ...]


@dataclass(frozen=True)
class DecodePlan:
    """One step's split of every row's tiles into work items (host lists and their device arrays).

    ``work`` [num_items, 3]: (row, first tile, end tile); ``row_work`` [B + 1]: row b's items are
    ``row_work[b]:row_work[b+1]``; ``rows`` [B, 4]: (window slot, sink_len, tail_len, num_tiles)."""

    work: mx.array
    row_work: mx.array
    rows: mx.array
    num_items: int
    memo: dict = field(default_factory=dict, compare=False)  # the scalar body's own plan, made once


def plan_splits(num_tiles: Sequence[int], tail_len: Sequence[int], n_kv_heads: int,
                num_sms: int = NUM_SMS, blocks_per_sm: int = BLOCKS_PER_SM,
                min_split: int = 1, single: bool | None = None) -> list[tuple[int, int, int]]:
    """Cut each row's tiles (sink, records, tail if non-empty) into work items.

    ``single`` (None: when rows x KV heads >= SINGLE_MIN_BLOCKS, or no row has more than
    SINGLE_MAX_TILES tiles): one item a row, so the attention launch writes the output itself.
    Else splits of about the same size: the batch's tiles over about blocks_per_sm x num_sms blocks,
    so one long row, many short rows and a mix all fill the GPU; a row gets round(its tiles / split
    size) splits, at least one (splits of at least ``min_split`` tiles)."""
    counts = [1 + n + (t > 0) for n, t in zip(num_tiles, tail_len)]
    if single is None:
        blocks = len(counts) * n_kv_heads
        single = blocks >= SINGLE_MIN_BLOCKS or max(counts, default=0) <= SINGLE_MAX_TILES
    if single:
        return [(b, 0, c) for b, c in enumerate(counts)]
    target_items = max(1, (blocks_per_sm * num_sms) // max(1, n_kv_heads))
    per_split = max(1, min_split, math.ceil(sum(counts) / target_items))
    work = []
    for b, count in enumerate(counts):
        n = max(1, min(count, round(count / per_split)))
        edges = [count * i // n for i in range(n + 1)]
        work.extend((b, lo, hi) for lo, hi in zip(edges, edges[1:]))
    return work


def make_plan(slots: Sequence[int], sink_len: Sequence[int], tail_len: Sequence[int],
              num_tiles: Sequence[int], n_kv_heads: int, blocks_per_sm: int = BLOCKS_PER_SM,
              min_split: int = 1, single: bool | None = None) -> DecodePlan:
    work = plan_splits(num_tiles, tail_len, n_kv_heads, blocks_per_sm=blocks_per_sm, min_split=min_split,
                       single=single)
    row_work = [0] * (len(slots) + 1)
    for b, _, _ in work:
        row_work[b + 1] += 1
    for b in range(len(slots)):
        row_work[b + 1] += row_work[b]
    i32 = mx.int32
    return DecodePlan(work=mx.array(work, dtype=i32).reshape(-1, 3), row_work=mx.array(row_work, dtype=i32),
                      rows=mx.array(list(zip(slots, sink_len, tail_len, num_tiles)), dtype=i32).reshape(-1, 4),
                      num_items=len(work))


def is_supported(*, head_dim: int, tile_size: int, key_bits: int, value_bits: int, n_rep: int) -> bool:
    """Whether the kernel has a template for this shape (else callers use the reference)."""
    return (head_dim in SUPPORTED_HEAD_DIMS and tile_size in SUPPORTED_TILE_SIZES and key_bits in SUPPORTED_BITS
            and value_bits in SUPPORTED_BITS and 1 <= n_rep <= MAX_REP)


def minify(source: str) -> str:
    """The CUDA text without comments, indentation and blank lines (MLX rebuilds and hashes the
    kernel's whole text on every call: the per-call host cost grows with its length)."""
    lines = []
    for line in source.splitlines():
        line = line.split("//", 1)[0].strip()
        if line:
            lines.append(line)
    return "\n".join(lines) + "\n"


_MMA_TEXT = (minify(HEADER + MMA_HEADER), minify(MMA_SOURCE))
_SCALAR_TEXT = (minify(HEADER), minify(ATTENTION_SOURCE))
_COMBINE_TEXT = (minify(HEADER), minify(COMBINE_SOURCE))


def mma_stages(variant: Variant, **shape) -> int:
    """The tensor-core body's cp.async stages for this shape (the variant's, fewer where the shared
    memory would pass MAX_SHARED), or 0: the scalar body runs."""
    if variant.kind == "scalar" or not mma_supported(**shape):
        if variant.kind == "mma":
            raise ValueError(f"the tensor-core body has no template for {shape}")
        return 0
    for stages in range(variant.stages, 1, -1):
        if mma_shared_bytes(**shape, stages=stages) <= MAX_SHARED:
            return stages
    return 0


@dataclass(frozen=True)
class Launch:
    """One kernel call: its source and arguments as ``mx.fast.cuda_kernel`` takes them (also what
    the tests' CPU emulator of the CUDA source takes)."""

    name: str
    final: bool  # the attention launch writes the output itself (every row one work item): no combine
    header: str
    source: str
    input_names: list
    output_names: list
    shared_memory: int
    inputs: list
    template: list
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list
    output_dtypes: list


@functools.lru_cache(maxsize=256)
def _attention_kernel(q_dtype: mx.Dtype, w_dtype: mx.Dtype, D: int, G: int, bits: tuple[int, int], NR: int,
                      variant: Variant, final: bool) -> tuple[str, tuple[str, str], tuple, int, bool]:
    """(name, (header, body), template, shared memory, final) of the attention launch for a shape."""
    shape = dict(head_dim=D, tile_size=G, key_bits=bits[0], value_bits=bits[1], n_rep=NR)
    stages = mma_stages(variant, **shape)
    template = (("QT", q_dtype), ("WT", w_dtype), ("D", D), ("G", G), ("KB", bits[0]), ("VB", bits[1]), ("NR", NR))
    if stages:
        template += (("NST", stages), ("FK", variant.fold_k), ("FV", variant.fold_v), ("FINAL", int(final)))
        return "kvarn_paged_decode_mma", _MMA_TEXT, template, mma_shared_bytes(**shape, stages=stages), final
    return "kvarn_paged_decode", _SCALAR_TEXT, template, shared_bytes(D, G, bits[0], bits[1], NR), False


def attention_launch(queries: mx.array, records: dict[str, mx.array], win_k: mx.array, win_v: mx.array,
                     table: mx.array | None, plan: DecodePlan, scale: float, bits: tuple[int, int],
                     variant: Variant = DEFAULT_VARIANT) -> Launch:
    """The attention launch: the tensor-core body where it has the shape (writing the output itself
    when every row is one work item), else the scalar body; both write per-split partials otherwise."""
    B, n_q, _, D = queries.shape
    H, G = win_k.shape[1], win_k.shape[2] // 2
    NR = n_q // H
    if table is None:
        table = mx.zeros((B, 1), dtype=mx.int32)
    name, text, template, smem, final = _attention_kernel(queries.dtype, win_k.dtype, D, G, tuple(bits), NR, variant,
                                                          plan.num_items == B)
    outputs = ([(B, n_q, D), (1,)], [queries.dtype, mx.float32]) if final else \
        ([(plan.num_items, H, NR, D), (plan.num_items, H, NR, 2)], [mx.float32, mx.float32])
    nb_arr, scale_arr = _meta(table.shape[1], scale)
    return Launch(
        name=name, final=final, header=text[0], source=text[1], input_names=ATTENTION_INPUTS,
        output_names=ATTENTION_OUTPUTS, shared_memory=smem,
        inputs=[queries.reshape(B, n_q, D), win_k, win_v, *(records[n] for n in RECORD_FIELDS), table, plan.rows,
                plan.work, nb_arr, scale_arr],
        template=list(template), grid=(plan.num_items * NUM_THREADS, H, 1), threadgroup=(NUM_THREADS, 1, 1),
        output_shapes=outputs[0], output_dtypes=outputs[1])


def combine_launch(part_o: mx.array, part_ml: mx.array, plan: DecodePlan, queries: mx.array) -> Launch:
    B, n_q, _, D = queries.shape
    NR = part_o.shape[2]
    return Launch(name="kvarn_paged_combine", final=True, header=_COMBINE_TEXT[0], source=_COMBINE_TEXT[1],
                  input_names=COMBINE_INPUTS,
                  output_names=COMBINE_OUTPUTS, shared_memory=0, inputs=[part_o, part_ml, plan.row_work],
                  template=[("QT", queries.dtype), ("D", D), ("NR", NR)], grid=(D, n_q, B), threadgroup=(D, 1, 1),
                  output_shapes=[(B, n_q, D)], output_dtypes=[queries.dtype])


def _run(call: Launch) -> list[mx.array]:
    kernel = _kernel(call.name, call.header, call.source, call.input_names, call.output_names, call.shared_memory)
    return kernel(inputs=call.inputs, template=call.template, grid=call.grid, threadgroup=call.threadgroup,
                  output_shapes=call.output_shapes, output_dtypes=call.output_dtypes)


def paged_decode_attention(*, queries: mx.array, records: dict[str, mx.array], win_k: mx.array, win_v: mx.array,
                           table: mx.array | None, lengths: RowLengths, scale: float,
                           key_bits: int, value_bits: int, plan: DecodePlan | None = None,
                           variant: Variant = DEFAULT_VARIANT) -> mx.array:
    """Decode attention of every row (queries [B, n_q, 1, D], unrotated) over its window and its
    records read in place from the pool; returns [B, n_q, 1, D] in the queries' dtype (unrotated).

    ``records``: one layer's record fields (``kvarn/pool.py`` shapes, block-major), ``win_k``/
    ``win_v`` [Nw, H, 2G, D]; ``table`` [B, nb] (pad-filled; None if no row has records);
    ``lengths``: per-row window slot, sink and tail lengths and record counts (host ints).
    ``plan``: the step's split plan (``make_plan``; built here when not given); ``variant``: which
    body (the tensor-core one where it has the shape, else the scalar one) and its knobs."""
    B, n_q, _, D = queries.shape
    H = win_k.shape[1]
    if plan is None:
        plan = make_plan(lengths.slots, lengths.sink_len, lengths.tail_len, lengths.num_tiles, H)
    if plan.num_items == B and not mma_stages(variant, head_dim=D, tile_size=win_k.shape[2] // 2, key_bits=key_bits,
                                              value_bits=value_bits, n_rep=n_q // H):
        if "scalar" not in plan.memo:  # the scalar body wants its rows split (the step's layers share this)
            L = lengths
            plan.memo["scalar"] = make_plan(L.slots, L.sink_len, L.tail_len, L.num_tiles, H,
                                            blocks_per_sm=SCALAR_BLOCKS_PER_SM, single=False)
        plan = plan.memo["scalar"]
    call = attention_launch(queries, records, win_k, win_v, table, plan, scale, (key_bits, value_bits), variant)
    part_o, part_ml = _run(call)
    if call.final:
        return part_o.reshape(B, n_q, 1, D)
    (out,) = _run(combine_launch(part_o, part_ml, plan, queries))
    return out.reshape(B, n_q, 1, D)


def _hadamard(x: mx.array) -> mx.array:
    """x @ H along the last axis, block-diagonal over 128-channel slices (``kvarn.quantize.rotate``)."""
    D = x.shape[-1]
    if D <= 128:
        return mx.hadamard_transform(x)
    return mx.hadamard_transform(x.reshape(*x.shape[:-1], D // 128, 128)).reshape(x.shape)


def _dequantize(fields: dict[str, mx.array], G: int, key_bits: int, value_bits: int,
                dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """Gathered record fields [B, nb, H, ...] -> rotated keys and values [B, H, nb*G, D]
    (``kvarn.pool.dequantize_blocks``, restated here: metal/ imports nothing of kvarn)."""
    B, nb, H, S, W, _ = fields["k_codes"].shape
    k = mx.dequantize(fields["k_codes"], fields["k_alpha"][..., None].astype(dtype),
                      fields["k_beta"][..., None].astype(dtype), group_size=G, bits=key_bits)
    k = (k * fields["k_r"][..., None, :].astype(dtype)).transpose(0, 2, 1, 5, 3, 4).reshape(B, H, nb * G, S * W)
    v = mx.dequantize(fields["v_codes"], fields["v_alpha"].astype(dtype), fields["v_beta"].astype(dtype),
                      group_size=W, bits=value_bits)
    v = (v * fields["v_c"][:, :, :, None, :].astype(dtype)).transpose(0, 2, 1, 3, 4).reshape(B, H, nb * G, S * W)
    return k, v


def reference_paged_decode_attention(*, queries: mx.array, records: dict[str, mx.array], win_k: mx.array,
                                     win_v: mx.array, table: mx.array | None, lengths: RowLengths, scale: float,
                                     key_bits: int, value_bits: int, plan: DecodePlan | None = None,
                                     variant: Variant = DEFAULT_VARIANT) -> mx.array:
    """The pure-MLX twin of ``paged_decode_attention`` (``plan`` and ``variant`` are ignored): the windows and the
    gathered, dequantized records as one operand, one SDPA under the rows' validity mask, in float16
    (float32 where the queries are float32), the gather+dequantize+SDPA path of
    ``kvarn.paged_batch``."""
    G = win_k.shape[2] // 2
    dtype = mx.float32 if queries.dtype == mx.float32 else mx.float16
    slots = mx.array(lengths.slots, dtype=mx.int32)
    keys, vals = win_k[slots].astype(dtype), win_v[slots].astype(dtype)
    i32 = mx.int32
    sl, tl, nt = (mx.array(x, dtype=i32)[:, None] for x in (lengths.sink_len, lengths.tail_len, lengths.num_tiles))
    w = mx.arange(2 * G, dtype=i32)[None]
    mask = (w < sl) | ((w >= G) & (w < G + tl))
    if table is not None:
        fields = {name: records[name][table] for name in RECORD_FIELDS}
        rec_k, rec_v = _dequantize(fields, G, key_bits, value_bits, dtype)
        keys, vals = mx.concatenate([keys, rec_k], axis=2), mx.concatenate([vals, rec_v], axis=2)
        mask = mx.concatenate([mask, (mx.arange(table.shape[1] * G, dtype=i32)[None] // G) < nt], axis=1)
    q = _hadamard(queries.astype(mx.float32)).astype(dtype)
    out = mx.fast.scaled_dot_product_attention(q, keys, vals, scale=scale, mask=mask[:, None, None, :])
    return _hadamard(out.astype(mx.float32)).astype(queries.dtype)
