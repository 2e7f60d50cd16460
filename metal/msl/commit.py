"""Fused KVarN tile commit on Apple GPUs (``mx.fast.metal_kernel``): the Metal twin of
``metal.cuda.commit`` (the whole quantizer of docs/kvarn.md for every tile given,
all heads, K and V, in one launch), with the CUDA wrappers' signatures and outputs:
``quantize_tiles(keys=, values=, ...)`` over tiles [n, H, G, D] and ``quantize_window_tails(win_k=,
win_v=, slots=, ...)`` over the tails of a pool's float16 windows, read in place. Output: the
block-major record fields of ``kvarn/pool.py`` (``metal.records.output_shapes``).

Limits it is written to (Apple GPUs): one threadgroup per matrix, of G * W / (4 * ROWS) threads:
512 at G = W = 128 with the default 8 rows a thread (the CUDA kernel's 4 rows
would be 1,024, Metal's maximum, reachable only if the compiled kernel's registers allow it);
19,072 bytes of threadgroup memory at G = W = 128 (of 32 KB: ``threadgroup_bytes``); 32-lane
simdgroups. The comment above ``HEADER`` says what differs from the CUDA kernel and how the code
keeps the compiler from contracting products into fused multiply-adds.

**What was verified where** (docs/kernels.md, "Metal twins"): the Metal text run by a g++ emulator
of the Metal execution model on Linux CPUs (``tests/metal/metal_emulator.py``) against
``kvarn.pool.quantize_blocks_reference``; never compiled by Apple's Metal compiler on this
project's machines. On an Apple GPU the selector (``metal.selector.Kernels``) compiles it and checks it against
the pure-MLX quantizer per layout, and falls back to that quantizer if the check fails.

The kernel's Metal text is ``metal/msl/src/commit.h`` (header) and ``commit.metal`` (body), read at
import (``metal.sources``) into ``HEADER`` and ``SOURCE``. The module owns the launch arithmetic and
the wrappers that run it.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from metal.launch import minify, no_slots
from metal.msl.paged_decode import MAX_THREADGROUP_MEMORY, MetalLaunch
from metal.msl.paged_decode import run as _run
from metal.records import RECORD_FIELDS, output_shapes
from metal.sources import source

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_TILE_SIZES = (64, 128)
DEFAULT_ROWS = 8  # rows a thread: 512 threads a threadgroup at G = W = 128
MAX_THREADS = 1024
INPUTS = ["keys", "values", "bits", "slots"]


# ---- the Metal source: a shared header and the kernel body, as ``mx.fast.metal_kernel`` takes them.
# A port of the CUDA kernel (``metal/cuda/src/commit.cu*``): the same thread layout, the same operations in
# the same order (every sum added as MLX's CUDA reduce adds it: runs of 4 from 0, then a butterfly over
# lanes; strided sums in order, then a butterfly over 32 partials), so the same bytes wherever the
# elementwise operations round the same way. The algorithm and the reduction orders are described in
# ``metal/cuda/commit.py`` and docs/kernels.md.
#
# What differs from the CUDA kernel, and why:
#
# - Threadgroup memory. Apple GPUs give a threadgroup at most 32 KB; the CUDA layout needs 52 KB at
#   G = W = 128, 33 KB of it the float16 copy of the matrix. Here the matrix is not staged: a
#   thread reads its own ROWS x 4 values from device memory when it needs them (every iterate, and
#   the end), and the first stds of a K tile quantized on its own (``SPECIAL``) read the values
#   they need from device memory too. Left in threadgroup memory: the 32 x (CM + 1) column partials
#   (later the codes, one byte each: R x C <= 32 x (CM + 1) x 4 bytes) and five vectors of CM
#   floats, 19,072 bytes at CM = max(G, W) = 128 (``static_assert``: at most 32 KB).
# - Threads. ROWS = 8 rows a thread by default: 512 threads a threadgroup at G = W = 128 (ROWS = 4
#   would be 1,024, the most a threadgroup may have, and only if the compiled kernel's register use
#   allows it: ``maxTotalThreadsPerThreadgroup``, which only an Apple GPU can tell).
# - Butterflies: ``simd_shuffle_xor`` over the 32 lanes of a simdgroup (Apple GPUs' simdgroups are
#   32 wide); the threadgroup is one-dimensional, so simdgroup k holds threads 32k .. 32k+31, CUDA's
#   warp layout.
# - No contraction into fused multiply-adds. MLX compiles custom Metal kernels in its "safe" math
#   mode by default (MLX >= 0.32: ``MTLMathModeSafe``; before, ``fastMathEnabled = false``), which
#   is meant to forbid result-changing transformations; on top of that, every product that feeds an
#   addition goes through ``kc_mul``, which ORs its bits with a zero the compiler cannot see
#   (``bits[2]``, a kernel input): the sum's operand is no longer a multiplication, so no compiler
#   can fuse the two. ``exp`` / ``log`` / ``sqrt`` are ``metal::precise::`` (what MLX's own Exp, Log
#   and Sqrt ops call); divisions are ``/`` as in MLX's Divide op.
# - Byte identity with the pure-MLX quantizer *on Metal* is not claimed: MLX's Metal reductions add
#   in their own orders (``simd_sum`` among them) and Apple's ``exp`` / ``log`` are not glibc's; codes
#   move only where a value sits within float noise of a rounding boundary, which the self-check
#   (>= 99% of code words equal) and the tests' rules allow.
HEADER = source("msl", "commit.h")

# Template arguments: G (tile), D (head_dim), ITERS, ROWS (rows per thread), WIN and NH; the bits
# are an input (bits = [key_bits, value_bits, 0], int32: the third is kc_mul's opaque zero), so one
# compile serves every width. WIN = 0: inputs keys/values [n, H, G, D] float16 (NH = 1, ``slots``
# unread). WIN = 1: keys/values are a pool's window buffers [Nw, NH, 2G, D] float16 and tile t is
# the tail (positions G .. 2G-1) of window slots[t], read in place. Outputs the record fields of
# kvarn/pool.py. Grid: (matrices x threads, 2) threads; threadgroup y = 0 -> K, 1 -> V.
SOURCE = source("msl", "commit.metal")

KERNEL_TEXT = (minify(HEADER), minify(SOURCE))


def threadgroup_bytes(head_dim: int, tile_size: int) -> int:
    """Threadgroup memory of one threadgroup (``kc_p`` and ``kc_v`` in the source)."""
    cm = max(tile_size, min(head_dim, 128))
    return 4 * (32 * (cm + 1) + 5 * cm)


def threads(head_dim: int, tile_size: int, rows: int) -> int:
    return tile_size * min(head_dim, 128) // (4 * rows)


def is_supported(*, head_dim: int, tile_size: int, key_bits: int, value_bits: int, rows: int = DEFAULT_ROWS) -> bool:
    """Whether the Metal kernel has a template for this layout (else callers use the reference)."""
    return (head_dim in SUPPORTED_HEAD_DIMS and tile_size in SUPPORTED_TILE_SIZES and key_bits in SUPPORTED_BITS
            and value_bits in SUPPORTED_BITS and rows in (4, 8)
            and threads(head_dim, tile_size, rows) <= MAX_THREADS
            and threadgroup_bytes(head_dim, tile_size) <= MAX_THREADGROUP_MEMORY)


@lru_cache(maxsize=64)
def _bits(key_bits: int, value_bits: int) -> mx.array:
    """The kernel's bits input: [key_bits, value_bits, 0]; the 0 is the opaque zero of ``kc_mul``
    (it must come from outside the kernel, where no compiler can see it)."""
    return mx.array([key_bits, value_bits, 0], dtype=mx.int32)


@lru_cache(maxsize=256)
def _launch_shape(n: int, H: int, G: int, D: int, key_bits: int, value_bits: int, iters: int, rows: int,
                  window: bool) -> tuple:
    template = (("G", G), ("D", D), ("ITERS", iters), ("ROWS", rows), ("WIN", int(window)), ("NH", H if window else 1))
    W = min(D, 128)
    tg = threads(D, G, rows)
    shapes = output_shapes(n, H, G, D, key_bits, value_bits)
    dtypes = tuple(mx.uint32 if name.endswith("codes") else mx.float16 for name in RECORD_FIELDS)
    return (template, (n * H * (D // W) * tg, 2, 1), (tg, 1, 1), tuple(shapes[name] for name in RECORD_FIELDS), dtypes)


def commit_launch(keys: mx.array, values: mx.array, key_bits: int, value_bits: int, iters: int,
                  rows: int = DEFAULT_ROWS, slots: mx.array | None = None) -> MetalLaunch:
    """The launch for tiles ``keys``/``values`` [n, H, G, D], or, with ``slots`` ([n] int32), for
    the tails of those windows of window buffers ``keys``/``values`` [Nw, H, 2G, D] (WIN = 1)."""
    if slots is None:
        n, H, G, D = keys.shape
    else:
        (n,), (_, H, G2, D) = slots.shape, keys.shape
        G = G2 // 2
    template, grid, tg, shapes, dtypes = _launch_shape(n, H, G, D, key_bits, value_bits, iters, rows,
                                                       slots is not None)
    return MetalLaunch(name="kvarn_commit", header=KERNEL_TEXT[0], source=KERNEL_TEXT[1], input_names=INPUTS,
                       output_names=list(RECORD_FIELDS),
                       inputs=[keys.astype(mx.float16), values.astype(mx.float16), _bits(key_bits, value_bits),
                               no_slots() if slots is None else slots.astype(mx.int32)],
                       template=list(template), grid=grid, threadgroup=tg, output_shapes=list(shapes),
                       output_dtypes=list(dtypes))


def _check(D: int, G: int, key_bits: int, value_bits: int, rows: int) -> None:
    if not is_supported(head_dim=D, tile_size=G, key_bits=key_bits, value_bits=value_bits, rows=rows):
        raise ValueError(f"no Metal commit kernel for head_dim {D}, tile {G}, bits k{key_bits}v{value_bits}, "
                         f"{rows} rows a thread")


def quantize_tiles(*, keys: mx.array, values: mx.array, key_bits: int, value_bits: int, iters: int = 8,
                   rows: int = DEFAULT_ROWS) -> dict[str, mx.array]:
    """``metal.cuda.commit.quantize_tiles`` on an Apple GPU: rotated float16 tiles [n, H, G, D] -> n
    blocks of record fields. ``rows``: 8 or 4 rows a thread (512 or 1,024 threads at G = W = 128)."""
    n, H, G, D = keys.shape
    if values.shape != keys.shape:
        raise ValueError(f"keys {keys.shape} and values {values.shape} differ")
    _check(D, G, key_bits, value_bits, rows)
    if n == 0:
        return {name: mx.zeros(shape, mx.uint32 if name.endswith("codes") else mx.float16)
                for name, shape in output_shapes(0, H, G, D, key_bits, value_bits).items()}
    return dict(zip(RECORD_FIELDS, _run(commit_launch(keys, values, key_bits, value_bits, iters, rows))))


def quantize_window_tails(*, win_k: mx.array, win_v: mx.array, slots: mx.array, key_bits: int, value_bits: int,
                          iters: int = 8, rows: int = DEFAULT_ROWS) -> dict[str, mx.array]:
    """``metal.cuda.commit.quantize_window_tails`` on an Apple GPU: ``quantize_tiles`` of the tails of
    windows ``slots`` ([n] int32) of float16 window buffers [Nw, H, 2G, D], read in place."""
    _, H, G2, D = win_k.shape
    G = G2 // 2
    if win_v.shape != win_k.shape or win_k.dtype != mx.float16 or win_v.dtype != mx.float16:
        raise ValueError(f"window buffers {win_k.shape} {win_k.dtype} / {win_v.shape} {win_v.dtype}: "
                         "need two float16 [Nw, H, 2G, D]")
    _check(D, G, key_bits, value_bits, rows)
    return dict(zip(RECORD_FIELDS, _run(commit_launch(win_k, win_v, key_bits, value_bits, iters, rows,
                                                      slots=slots))))
