"""Fused paged decode attention over the KVarN block pool (CUDA, ``mx.fast.cuda_kernel``).

One launch attends every decoding row of one layer: split-K flash decoding over each row's tiles,
read in place from the pool (``kvarn/pool.py``: records block-major, windows one a row), K and V
dequantized in registers, online softmax in float32, the n_q/H query heads of a KV head folded into
one block so each tile is read once per KV head. A second tiny launch combines the splits and
rotates back. Design notes: docs/kernels.md.

A row's tiles, in sequence order, and how the work list cuts them into splits (the plan is
``metal.paged_plan``'s, shared with the Metal twin)::

    tile  0      1 .. nt                 nt+1 (only if tail_len > 0)
          sink | record table[b][0] ... | tail
          win[slot, :, 0:sink_len]       win[slot, :, G:G+tail_len]
    work item = (row b, first tile, end tile); one block per (work item, KV head)

Scores use the factored keys K[g, d] = (code[d, g] * alpha[d] + beta[d]) * r[g]:
s[g] = sum_s r[s, g] * (sum_{d in s} (q[d] alpha[d]) code[d, g] + sum_{d in s} q[d] beta[d]); values
likewise: o[d] += c[d] * (sum_g (p[g] v_alpha[g]) code[g, d] + sum_g p[g] v_beta[g]) per tile.

Two attention bodies: a tensor-core one (``mma.sync``, for the shapes ``mma_supported`` names) and
a scalar one (every shape the kernel takes). Their CUDA text lives in ``metal/cuda/src``, read at
import (``metal.sources``): the header both bodies and the combine share (``paged_decode.cuh``), the
tensor-core body's header and its two halves (``paged_decode_mma.cuh``, ``paged_decode_mma_setup.cu``,
``paged_decode_mma_tiles.cu``), the scalar body (``paged_decode_scalar.cu``) and the combine
(``paged_decode_combine.cu``). The module owns the shape rules, the shared-memory sizes, the
launches and the wrapper.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from metal.launch import minify, scalar_inputs
from metal.paged_plan import SCALAR_BLOCKS_PER_SM, DecodePlan, RowLengths, make_plan
from metal.records import RECORD_FIELDS
from metal.sources import source

NUM_THREADS = 128  # one block: 4 warps
SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_TILE_SIZES = (64, 128)
MAX_REP = 8  # query heads per KV head folded into one block
MAX_SHARED = 227 * 1024  # dynamic shared memory one block may have (Hopper)

ATTENTION_INPUTS = ["queries", "win_k", "win_v", *RECORD_FIELDS, "table", "rows", "work", "meta", "meta_f"]
ATTENTION_OUTPUTS = ["part_o", "part_ml"]
COMBINE_INPUTS = ["part_o", "part_ml", "row_work"]
COMBINE_OUTPUTS = ["out"]


# ---- the CUDA source: a shared header, the scalar split-K attention body and the combine body, as
# ``mx.fast.cuda_kernel`` takes them (bodies only: MLX writes the signature from the input and output
# names and the template arguments). The layout and the algorithm: the module docstring and
# docs/kernels.md.
HEADER = source("cuda", "paged_decode.cuh")
ATTENTION_SOURCE = source("cuda", "paged_decode_scalar.cu")
COMBINE_SOURCE = source("cuda", "paged_decode_combine.cu")

# ---- the tensor-core body (``mma.sync.m16n8k16``, f16 x f16 -> f32): D = 128, key bits 2/4/8 with
# G * key_bits >= 256, value bits 2/4/8, up to 8 query heads per KV head (``mma_supported``).
#
# Fragments come straight from the packed codes. One 32-bit word holds 32/b codes of one channel
# (keys: consecutive tokens) or one token (values: consecutive channels); ``(w & mask) | 0x6400_6400``
# turns the codes i and i + 16/b (same bit offset o in the word's two 16-bit halves) into the half2
# (1024 + 2^o c_i, 1024 + 2^o c_{i+16/b}), and one ``fma.f16x2`` makes it the exact codes (FOLD = 1
# keeps the 1024 offset and takes it out of the float32 product instead). The two halves belong to
# two *slots*: for QK, two tokens of one channel; for PV, two channels of one token. The B operand
# puts each slot's query heads in its own four columns (the other slot's entries zero), so one
# m16n8k16 computes 16 rows x 2 slots x 4 heads over 8 channels (QK) or 8 tokens (PV):
#
#     QK  A[m, 2kk+s] = code[chan kk, token(m, s)]      B[2kk+s, n] = (n/4 == s) q'[chan kk, head n%4]
#         C[m, n] = sum_c q'[c, head] code[c, token(m, n/4)]              (q' = q * k_alpha)
#     PV  A[m, 2kk+s] = code[token kk, chan(m, s)]       B[2kk+s, n] = (n/4 == s) p'[token kk, head n%4]
#         C[m, n] = sum_g p'[g, head] code[g, chan(m, n/4)]               (p' = p * v_alpha)
#
# Each lane reads whole words (one per channel and lane for K, b/2 per token and lane for V) from a
# shared-memory stage filled by ``cp.async`` (16-byte chunks; 8-word groups of a row XOR-swizzled so
# that the four rows a load instruction touches fall in distinct banks), NST stages deep. The
# block's 4 warps split each tile's tokens (WG = G*kb/256 warps a tile, TPS = 4/WG tiles a step);
# every warp keeps its own online-softmax state (m, l, o) and the block merges the four at the end.
# The float16 sink and tail tiles (if the work item has them) are split across the 4 warps by tokens
# and run scalar (lane = token for QK; the o layout of the record path for PV).
#
# The body comes in two halves, one file each: the setup and the sink/tail tiles (MMA_SETUP), then
# the record tiles and the merge of the block's four warps, per-split partials or the row's output
# when it is its only work item (MMA_TILES). MMA_TILES continues MMA_SETUP's scope: its names (lane,
# g, t, warp, the stage layout constants, the state mrun / lrun / oacc, issue, s_qp, qreg, wscr) are
# defined there.
MMA_HEADER = source("cuda", "paged_decode_mma.cuh")
MMA_SETUP = source("cuda", "paged_decode_mma_setup.cu")
MMA_TILES = source("cuda", "paged_decode_mma_tiles.cu")
MMA_SOURCE = MMA_SETUP + MMA_TILES


def shared_bytes(head_dim: int, tile_size: int, key_bits: int, value_bits: int, n_rep: int) -> int:
    """Dynamic shared memory of the attention kernel (the layout at the top of ATTENTION_SOURCE)."""
    D, G, NR = head_dim, tile_size, n_rep
    S = max(1, D // 128)
    words = D * G * key_bits // 32 + G * D * value_bits // 32
    floats = 2 * D * NR + S * G + 2 * G * S + D + S * G * NR + 4 * S * NR + 4 * NR * (1 + S) + NR * D
    return 4 * (words + floats)


def mma_supported(*, head_dim: int, tile_size: int, key_bits: int, value_bits: int, n_rep: int) -> bool:
    """Whether the tensor-core body has this shape (one K word per lane and channel: G * kb >= 256)."""
    return (head_dim == 128 and key_bits in (2, 4, 8) and value_bits in (2, 4, 8) and tile_size in (64, 128)
            and tile_size * key_bits >= 256 and 1 <= n_rep <= 8)


def mma_shared_bytes(*, head_dim: int, tile_size: int, key_bits: int, value_bits: int, n_rep: int,
                     stages: int) -> int:
    """Dynamic shared memory of MMA_SOURCE (its layout: stages, q pairs, scratch)."""
    D, G, NR = head_dim, tile_size, n_rep
    nrp = 4 * ((NR + 3) // 4)
    wg = G * key_bits // 256
    tile = 4 * D * G * key_bits // 32 + 4 * G * D * value_bits // 32 + 6 * D + 6 * G
    stage = (4 // wg) * tile
    pbs = G // wg // 2 + 4
    scrw = max(nrp * pbs, NR * G // 4)
    scr = max(4 * scrw, NR * D)
    return stages * stage + 4 * nrp * (D // 2 + 4) + 4 * scr


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


@functools.cache
def _kernel(name: str, header: str, source: str, input_names: tuple[str, ...], output_names: tuple[str, ...],
            smem: int):
    """The compiled kernel of one text and shared-memory size (MLX caches the templates under it)."""
    return mx.fast.cuda_kernel(name=name, input_names=list(input_names), output_names=list(output_names),
                               source=source, header=header, shared_memory=smem)


def is_supported(*, head_dim: int, tile_size: int, key_bits: int, value_bits: int, n_rep: int) -> bool:
    """Whether the kernel has a template for this shape (else callers use the reference)."""
    return (head_dim in SUPPORTED_HEAD_DIMS and tile_size in SUPPORTED_TILE_SIZES and key_bits in SUPPORTED_BITS
            and value_bits in SUPPORTED_BITS and 1 <= n_rep <= MAX_REP)


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
    nb_arr, scale_arr = scalar_inputs(table.shape[1], float(scale))
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
    kernel = _kernel(call.name, call.header, call.source, tuple(call.input_names), tuple(call.output_names),
                     call.shared_memory)
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
    ``plan``: the step's split plan (``metal.paged_plan.make_plan``; built here when not given;
    a compiled step passes one of fixed size, ``static_plan``, and no ``lengths``);
    ``variant``: which body (the tensor-core one where it has the shape, else the scalar one) and
    its knobs."""
    B, n_q, _, D = queries.shape
    H = win_k.shape[1]
    if plan is None:
        plan = make_plan(lengths.slots, lengths.sink_len, lengths.tail_len, lengths.num_tiles, H)
    if lengths is not None and plan.num_items == B and not mma_stages(
            variant, head_dim=D, tile_size=win_k.shape[2] // 2, key_bits=key_bits, value_bits=value_bits,
            n_rep=n_q // H):  # (a plan made ahead, ``lengths`` None, runs as it is: a compiled step's)
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
