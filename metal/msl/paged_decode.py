"""Fused paged decode attention over the KVarN block pool on Apple GPUs (``mx.fast.metal_kernel``).

The Metal twin of the CUDA scalar body (``metal.cuda.paged_decode``): the same split-K plan
(``metal.paged_plan``), the same
two launches (attention: one threadgroup of 128 threads per (work item, KV head), online softmax
in float32, K and V dequantized from the pool read in place; combine: the splits merged, inverse
Hadamard, cast), the same inputs and outputs. ``paged_decode_attention`` has the CUDA wrapper's
signature and semantics; every plan runs both launches (a plan of one work item a row too: the
combine then only normalizes and rotates back).

Limits it is written to (Apple GPUs): 128 threads a threadgroup (of at most 1,024), at most
29.3 KB of threadgroup memory (of 32 KB; ``threadgroup_bytes``), 32-lane simdgroups. The comment
above the Metal source (``HEADER``) says what differs from the CUDA body.

**What was verified where** (docs/kernels.md, "Metal twins"): the Metal text run by a g++ emulator
of the Metal execution model on Linux CPUs (``tests/metal/metal_emulator.py``); it was never
compiled by Apple's Metal compiler on this project's machines. On an Apple GPU
the selector (``metal.selector.Kernels``) compiles it and checks it against the reference at first use, and
falls back to the reference if that fails.

The kernel's Metal text is ``metal/msl/src/paged_decode.h`` (header), ``paged_decode.metal``
(attention body) and ``paged_decode_combine.metal`` (combine body), read at import
(``metal.sources``) into ``HEADER``, ``ATTENTION_SOURCE`` and ``COMBINE_SOURCE``. The module owns the
launches, the ``run`` that the commit twin shares, and the wrapper.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx

from metal.launch import minify, scalar_inputs
from metal.paged_plan import DecodePlan, RowLengths, make_plan
from metal.records import RECORD_FIELDS
from metal.sources import source

NUM_THREADS = 128  # one threadgroup: 4 simdgroups of 32
MAX_THREADGROUP_MEMORY = 32 * 1024  # Apple GPUs
SUPPORTED_BITS = (2, 3, 4, 8)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_TILE_SIZES = (64, 128)
MAX_REP = 8
COMPILE_OPTIONS = {"math_mode": "safe"}  # MLX's default (IEEE: exp2(-inf) == 0 is relied on)

ATTENTION_INPUTS = ["queries", "win_k", "win_v", *RECORD_FIELDS, "table", "rows", "work", "meta", "meta_f"]
ATTENTION_OUTPUTS = ["part_o", "part_ml"]
COMBINE_INPUTS = ["part_o", "part_ml", "row_work"]
COMBINE_OUTPUTS = ["out"]


# ---- the Metal source: a shared header, the split-K attention body and the combine body, as
# ``mx.fast.metal_kernel`` takes them (bodies only: MLX writes the signature from the input and output
# names, the template arguments and the thread attributes the body names). A port of the CUDA scalar
# body (``metal/cuda/src/paged_decode_scalar.cu``); the algorithm is described in
# ``metal/cuda/paged_decode.py`` and docs/kernels.md.
#
# What differs from the CUDA body, and why:
#
# - Apple GPUs give a threadgroup at most 32 KB of threadgroup memory, so the codes of a record tile
#   are not staged: each thread reads its code words straight from device memory (the QK lanes of a
#   simdgroup read consecutive tokens of one channel, the PV lanes consecutive channels of one
#   token: neighbouring words). The query scratch (``s_o``) shares its space with ``s_qa`` (it is
#   used before the first tile and after the last). What is left is ``TG`` floats, at most
#   7,328 (29.3 KB) at D = 256, G = 128, 8 query heads per KV head (``static_assert``).
# - Warp reductions are ``simd_sum`` / ``simd_max`` (32-lane simdgroups, as on every Apple GPU);
#   the order of their sums is the hardware's (attention does not need a fixed order).
# - Small inputs (``rows``, ``work``, ``table``, ``meta``... of fewer than 8 elements) come in the
#   ``constant`` address space, larger ones in ``device`` (MLX's rule): the body indexes them
#   directly and passes only the large record and window arrays to helpers, through templates that
#   take any pointer type.
HEADER = source("msl", "paged_decode.h")
ATTENTION_SOURCE = source("msl", "paged_decode.metal")
COMBINE_SOURCE = source("msl", "paged_decode_combine.metal")


def threadgroup_bytes(head_dim: int, tile_size: int, n_rep: int) -> int:
    """Threadgroup memory of the attention body (``TG`` floats in the source)."""
    D, G, NR = head_dim, tile_size, n_rep
    S = max(1, D // 128)
    return 4 * (2 * D * NR + S * G + 2 * G * S + D + S * G * NR + 4 * S * NR + 4 * NR * (1 + S))


def is_supported(*, head_dim: int, tile_size: int, key_bits: int, value_bits: int, n_rep: int) -> bool:
    """Whether the Metal body has this shape (else callers use the reference)."""
    return (head_dim in SUPPORTED_HEAD_DIMS and tile_size in SUPPORTED_TILE_SIZES and key_bits in SUPPORTED_BITS
            and value_bits in SUPPORTED_BITS and 1 <= n_rep <= MAX_REP
            and threadgroup_bytes(head_dim, tile_size, n_rep) <= MAX_THREADGROUP_MEMORY)


@dataclass(frozen=True)
class MetalLaunch:
    """One kernel call: its source and arguments as ``mx.fast.metal_kernel`` takes them (also what
    the tests' CPU emulator of the Metal source takes). ``grid`` counts threads, as MLX's does."""

    name: str
    header: str
    source: str
    input_names: list
    output_names: list
    inputs: list
    template: list
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list
    output_dtypes: list


_ATTENTION_TEXT = (minify(HEADER), minify(ATTENTION_SOURCE))
_COMBINE_TEXT = (minify(HEADER), minify(COMBINE_SOURCE))


def attention_launch(queries: mx.array, records: dict[str, mx.array], win_k: mx.array, win_v: mx.array,
                     table: mx.array | None, plan: DecodePlan, scale: float, bits: tuple[int, int]) -> MetalLaunch:
    """The attention launch: per-split partials (o [items, H, NR, D], (m, l) [items, H, NR, 2])."""
    B, n_q, _, D = queries.shape
    H, G = win_k.shape[1], win_k.shape[2] // 2
    NR = n_q // H
    if table is None:
        table = mx.zeros((B, 1), dtype=mx.int32)
    nb_arr, scale_arr = scalar_inputs(table.shape[1], float(scale))
    template = [("QT", queries.dtype), ("WT", win_k.dtype), ("D", D), ("G", G), ("KB", bits[0]), ("VB", bits[1]),
                ("NR", NR)]
    return MetalLaunch(
        name="kvarn_paged_decode", header=_ATTENTION_TEXT[0], source=_ATTENTION_TEXT[1],
        input_names=ATTENTION_INPUTS, output_names=ATTENTION_OUTPUTS,
        inputs=[queries.reshape(B, n_q, D), win_k, win_v, *(records[n] for n in RECORD_FIELDS), table, plan.rows,
                plan.work, nb_arr, scale_arr],
        template=template, grid=(plan.num_items * NUM_THREADS, H, 1), threadgroup=(NUM_THREADS, 1, 1),
        output_shapes=[(plan.num_items, H, NR, D), (plan.num_items, H, NR, 2)],
        output_dtypes=[mx.float32, mx.float32])


def combine_launch(part_o: mx.array, part_ml: mx.array, plan: DecodePlan, queries: mx.array) -> MetalLaunch:
    B, n_q, _, D = queries.shape
    NR = part_o.shape[2]
    return MetalLaunch(name="kvarn_paged_combine", header=_COMBINE_TEXT[0], source=_COMBINE_TEXT[1],
                       input_names=COMBINE_INPUTS, output_names=COMBINE_OUTPUTS,
                       inputs=[part_o, part_ml, plan.row_work],
                       template=[("QT", queries.dtype), ("D", D), ("NR", NR)], grid=(D, n_q, B),
                       threadgroup=(D, 1, 1), output_shapes=[(B, n_q, D)], output_dtypes=[queries.dtype])


@functools.lru_cache(maxsize=8)
def _kernel(name: str, header: str, source: str, input_names: tuple, output_names: tuple):
    kw = dict(name=name, input_names=list(input_names), output_names=list(output_names), source=source, header=header)
    try:
        return mx.fast.metal_kernel(**kw, compile_options=COMPILE_OPTIONS)
    except TypeError:  # an MLX without compile options: fast math is off there
        return mx.fast.metal_kernel(**kw)


def run(call: MetalLaunch) -> list[mx.array]:
    kernel = _kernel(call.name, call.header, call.source, tuple(call.input_names), tuple(call.output_names))
    return kernel(inputs=call.inputs, template=call.template, grid=call.grid, threadgroup=call.threadgroup,
                  output_shapes=call.output_shapes, output_dtypes=call.output_dtypes)


def paged_decode_attention(*, queries: mx.array, records: dict[str, mx.array], win_k: mx.array, win_v: mx.array,
                           table: mx.array | None, lengths: RowLengths, scale: float,
                           key_bits: int, value_bits: int, plan: DecodePlan | None = None,
                           variant=None) -> mx.array:
    """``metal.cuda.paged_decode.paged_decode_attention`` on an Apple GPU: every row's decode
    attention (queries [B, n_q, 1, D], unrotated) over its window and its records read in place;
    returns [B, n_q, 1, D] in the queries' dtype (unrotated). ``plan``: the step's split plan
    (``metal.paged_plan.make_plan``; built here when not given); ``variant`` is accepted for the
    CUDA wrapper's signature and ignored (there is one Metal body)."""
    B, n_q, _, D = queries.shape
    H, G = win_k.shape[1], win_k.shape[2] // 2
    if not is_supported(head_dim=D, tile_size=G, key_bits=key_bits, value_bits=value_bits, n_rep=n_q // H):
        raise ValueError(f"no Metal decode kernel for D {D}, G {G}, k{key_bits}v{value_bits}, {n_q // H} heads a KV head")
    if plan is None:
        plan = make_plan(lengths.slots, lengths.sink_len, lengths.tail_len, lengths.num_tiles, H)
    part_o, part_ml = run(attention_launch(queries, records, win_k, win_v, table, plan, scale, (key_bits, value_bits)))
    (out,) = run(combine_launch(part_o, part_ml, plan, queries))
    return out.reshape(B, n_q, 1, D)
