"""Fused KVarN tile commit (CUDA, ``mx.fast.cuda_kernel``): the whole quantizer of
docs/kvarn.md ("The quantizer": two-axis log-domain normalization with the best-iterate rule,
min/max RTN, absorption, packing) for every tile given, all heads, K and V, in one launch.

Input: rotated float16 tiles ``keys``/``values`` [n, H, G, D]. Output: the block-major record
fields of ``kvarn/pool.py`` for n blocks::

    k_codes [n, H, S, W, G*kb/32] uint32   k_alpha, k_beta [n, H, S, W] f16   k_r [n, H, S, G] f16
    v_codes [n, H, G, D*vb/32]    uint32   v_alpha, v_beta [n, H, G, S] f16   v_c [n, H, D]    f16

One block per matrix (K or V of one tile, head and 128-channel slice; S = D / W slices), the
matrix held in registers (ROWS rows of 4 columns a thread) and shared memory.

**Same bytes as the pure-MLX quantizer on the GPU.** ``kvarn.pool.quantize_blocks_reference``
runs as MLX CUDA kernels whose float32 results depend on the order of their sums. The kernel repeats
them: every elementwise step is the same IEEE operation (``/`` and ``sqrt`` correctly rounded,
``expf``/``logf`` as MLX's ``cuda::std::exp``/``log``, no fused multiply-add: the ``_rn``
intrinsics forbid contraction), and every sum is added in MLX's order: a sum along the
contiguous axis (MLX's row reduce) adds runs of 4 consecutive values from 0 per thread, then
a 32-lane butterfly (xor 16, 8, 4, 2, 1); a sum along a strided axis (MLX's column reduce)
adds the values 32 apart in order, then the same butterfly over the 32 partial sums. Which axis
is contiguous follows from the layouts MLX gives the arrays (row-major after every fused
kernel; for a K tile quantized on its own when G != W, the first stds read a transposed view:
see ``SPECIAL`` in the source). Maxima and minima are exact in any order. Where MLX's own order
differs (another MLX version, the CPU backend), codes differ only where a value sits within
float noise of a rounding boundary: tests/metal/test_commit.py counts them.

The kernel's CUDA text is ``metal/cuda/src/commit.cuh`` (header) and ``commit.cu`` (body), read at
import (``metal.sources``) into ``HEADER`` and ``SOURCE``; the thread layout is described below the
constants. The module owns the launch arithmetic and the wrappers that run it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from functools import lru_cache

import mlx.core as mx

from metal.launch import minify, no_slots
from metal.records import RECORD_FIELDS, output_shapes
from metal.sources import source

log = logging.getLogger(__name__)
SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_HEAD_DIMS = (64, 128, 256)
SUPPORTED_TILE_SIZES = (64, 128)
DEFAULT_ROWS = 4  # rows a thread holds: 1,024 threads a block at G = W = 128 (H200, 32 tiles of one layer:
                  # 0.40 ms against 0.51 at 8 rows; 1 tile: 0.056 against 0.063 ms; bench/commit_cost.py)
INPUTS = ["keys", "values", "bits", "slots"]


# ---- the CUDA source: a shared header and the kernel body, as ``mx.fast.cuda_kernel`` takes them (MLX
# writes the signature from the input and output names and the template arguments). The algorithm and
# why each reduction runs in the order it does: the module docstring and docs/kernels.md.
#
# One block quantizes one matrix: K or V (blockIdx.y) of one tile, head and 128-channel slice
# (blockIdx.x = (tile * H + head) * S + slice). The matrix M is R x C (K: channels x tokens, V:
# tokens x channels); thread (unit u, column group cl) holds NR = TPU * KR rows of 4 consecutive
# columns 4cl..4cl+3: rows u*TPU + t + 32 k (t < TPU, k < KR). So a row's C/4 lanes sit in one warp
# (row sums: 4 values in order, then a butterfly, as MLX's row reduce), and the rows t + 32 k of a
# column are summed in k order by one thread (as MLX's column reduce), the 32 partials then by a
# butterfly over lanes.
HEADER = source("cuda", "commit.cuh")

# Template arguments: G (tile), D (head_dim), ITERS, ROWS (rows per thread), WIN, NH and MK (divisions by a
# row's or column's factor through its reciprocal: ``kc_divr``); the bits
# are an input (bits = [key_bits, value_bits], int32), so one compile serves every width.
# WIN = 0: inputs keys/values [n, H, G, D] float16 (NH = 1, ``slots`` unread). WIN = 1: keys/values
# are a pool's window buffers [Nw, NH, 2G, D] float16 and tile t is the tail (positions G .. 2G-1)
# of window slots[t], read in place (a decode step's commit: no gather, no copy).
# Outputs the record fields of kvarn/pool.py.
SOURCE = source("cuda", "commit.cu")


def _round16(x: int) -> int:
    return (x + 15) // 16 * 16


def shared_bytes(head_dim: int, tile_size: int) -> int:
    """Dynamic shared memory of one block (``KcSmem`` in the source)."""
    G, W = tile_size, min(head_dim, 128)
    cm = max(G, W)
    return _round16(2 * max(W * (G + 2), G * (W + 2))) + _round16(4 * 32 * (cm + 1)) + 7 * 4 * cm


def is_supported(*, head_dim: int, tile_size: int, key_bits: int, value_bits: int) -> bool:
    """Whether the kernel has a template for this layout (else callers use the reference)."""
    return (head_dim in SUPPORTED_HEAD_DIMS and tile_size in SUPPORTED_TILE_SIZES and key_bits in SUPPORTED_BITS
            and value_bits in SUPPORTED_BITS)


@dataclass(frozen=True)
class Launch:
    """One kernel call's arguments, as ``mx.fast.cuda_kernel`` takes them (also what the tests'
    CPU emulator of the CUDA source takes)."""

    inputs: list
    template: list
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_shapes: list
    output_dtypes: list


@lru_cache(maxsize=64)
def _bits(key_bits: int, value_bits: int) -> mx.array:
    """The kernel's bits input, made once per layout (not one array from host data per layer of
    every step that commits)."""
    return mx.array([key_bits, value_bits], dtype=mx.int32)


def commit_launch(keys: mx.array, values: mx.array, key_bits: int, value_bits: int, iters: int,
                  rows: int = DEFAULT_ROWS, slots: mx.array | None = None, *, reciprocal: bool = True) -> Launch:
    """The launch for tiles ``keys``/``values`` [n, H, G, D], or, with ``slots`` ([n] int32), for
    the tails of those windows of window buffers ``keys``/``values`` [Nw, H, 2G, D] (read in
    place: template WIN = 1). ``reciprocal`` (template MK): divide through reciprocals (``kc_divr``:
    the same IEEE quotients in fewer instructions); False: ``__fdiv_rn`` (``bench/commit_cost.py``
    times both)."""
    if slots is None:
        n, H, G, D = keys.shape
    else:
        (n,), (_, H, G2, D) = slots.shape, keys.shape
        G = G2 // 2
    template, grid, threadgroup, shapes, dtypes = _launch_shape(n, H, G, D, key_bits, value_bits, iters, rows,
                                                                slots is not None, int(reciprocal))
    return Launch(inputs=[keys.astype(mx.float16), values.astype(mx.float16), _bits(key_bits, value_bits),
                          no_slots() if slots is None else slots],
                  template=list(template), grid=grid, threadgroup=threadgroup, output_shapes=list(shapes),
                  output_dtypes=list(dtypes))


@lru_cache(maxsize=256)
def _launch_shape(n: int, H: int, G: int, D: int, key_bits: int, value_bits: int, iters: int, rows: int,
                  window: bool, mk: int = 1) -> tuple:
    """A launch's template, grid and outputs, made once per shape (a decode step asks once a layer)."""
    template = (("G", G), ("D", D), ("ITERS", iters), ("ROWS", rows), ("WIN", int(window)), ("NH", H if window else 1),
                ("MK", int(mk)))
    W = min(D, 128)
    threads = G * W // (4 * rows)
    shapes = output_shapes(n, H, G, D, key_bits, value_bits)
    dtypes = tuple(mx.uint32 if name.endswith("codes") else mx.float16 for name in RECORD_FIELDS)
    return (template, (n * H * (D // W) * threads, 2, 1), (threads, 1, 1),
            tuple(shapes[name] for name in RECORD_FIELDS), dtypes)


KERNEL_TEXT = (minify(HEADER), minify(SOURCE))  # what is compiled: MLX rehashes the text at every call


@lru_cache(maxsize=None)
def _kernel(smem: int):
    """The compiled kernel of one shared-memory size (MLX caches the templates under it)."""
    return mx.fast.cuda_kernel(name=f"kvarn_commit_{smem}", input_names=INPUTS, output_names=list(RECORD_FIELDS),
                               source=KERNEL_TEXT[1], header=KERNEL_TEXT[0], shared_memory=smem)


def quantize_tiles(*, keys: mx.array, values: mx.array, key_bits: int, value_bits: int, iters: int = 8,
                   rows: int = DEFAULT_ROWS, reciprocal: bool = True) -> dict[str, mx.array]:
    """Quantize rotated float16 tiles [n, H, G, D] into n blocks of record fields (the module
    docstring's shapes), the same bytes as ``kvarn.pool.quantize_blocks_reference`` with a layout
    of these bits, tile size G and ``iters``. ``rows``: 4 or 8 rows a thread; ``reciprocal``: how
    the kernel divides (``commit_launch``); both speed knobs only."""
    n, H, G, D = keys.shape
    if values.shape != keys.shape:
        raise ValueError(f"keys {keys.shape} and values {values.shape} differ")
    if not is_supported(head_dim=D, tile_size=G, key_bits=key_bits, value_bits=value_bits):
        raise ValueError(f"no commit kernel for head_dim {D}, tile {G}, bits k{key_bits}v{value_bits}")
    if n == 0:
        return {name: mx.zeros(shape, dtype) for (name, shape), dtype in zip(
            output_shapes(0, H, G, D, key_bits, value_bits).items(),
            [mx.uint32 if f.endswith("codes") else mx.float16 for f in RECORD_FIELDS])}
    call = commit_launch(keys, values, key_bits, value_bits, iters, rows, reciprocal=reciprocal)
    return _launch(call, D, G, (key_bits, value_bits))


def quantize_window_tails(*, win_k: mx.array, win_v: mx.array, slots: mx.array, key_bits: int, value_bits: int,
                          iters: int = 8, rows: int = DEFAULT_ROWS, reciprocal: bool = True) -> dict[str, mx.array]:
    """``quantize_tiles`` of the tails of windows ``slots`` ([n] int32) of a pool's float16 window
    buffers ``win_k``/``win_v`` [Nw, H, 2G, D] (a window is [sink: G tokens | tail: G tokens]),
    read in place: a decode step's commit with no gather or copy of the tiles. The same bytes as
    ``quantize_tiles(keys=win_k[slots][:, :, G:], ...)``."""
    _, H, G2, D = win_k.shape
    G = G2 // 2
    if win_v.shape != win_k.shape or win_k.dtype != mx.float16 or win_v.dtype != mx.float16:
        raise ValueError(f"window buffers {win_k.shape} {win_k.dtype} / {win_v.shape} {win_v.dtype}: "
                         "need two float16 [Nw, H, 2G, D]")
    if not is_supported(head_dim=D, tile_size=G, key_bits=key_bits, value_bits=value_bits):
        raise ValueError(f"no commit kernel for head_dim {D}, tile {G}, bits k{key_bits}v{value_bits}")
    call = commit_launch(win_k, win_v, key_bits, value_bits, iters, rows, slots=slots, reciprocal=reciprocal)
    return _launch(call, D, G, (key_bits, value_bits))


@lru_cache(maxsize=None)
def _blocks_start(template: tuple, threadgroup: tuple[int, int, int], D: int, G: int, bits: tuple[int, int]) -> bool:
    """Whether blocks of this template and size start on this device: a fact of the device and the
    driver, asked once per template by one small launch. The driver compiles the kernel's PTX
    itself, and where it needs more than 64 registers a thread (nvcc here gives 60 at 4 rows a
    thread), a 1,024-thread block cannot start ("too many resources requested for launch")."""
    t = dict(template)
    heads = t["NH"] if t["WIN"] else 1  # one tile: of window 1 of two (WIN = 1), else of one head
    shape = (2, heads, 2 * G, D) if t["WIN"] else (1, 1, G, D)
    slots = mx.ones((1,), mx.int32) if t["WIN"] else no_slots()
    probe = Launch(inputs=[mx.zeros(shape, mx.float16), mx.zeros(shape, mx.float16), _bits(*bits), slots],
                   template=list(template), grid=(heads * (D // min(D, 128)) * threadgroup[0], 2, 1),
                   threadgroup=threadgroup, output_shapes=list(output_shapes(1, heads, G, D, *bits).values()),
                   output_dtypes=[mx.uint32 if name.endswith("codes") else mx.float16 for name in RECORD_FIELDS])
    try:
        mx.eval(list(_run(probe, D, G).values()))
    except RuntimeError as exc:
        log.warning("kvarn: the commit kernel's %d-thread blocks do not start here (%s); using 8 rows a thread",
                    threadgroup[0], exc)
        return False
    return True


def _launch(call: Launch, D: int, G: int, bits: tuple[int, int]) -> dict[str, mx.array]:
    """Run ``call`` (of layout ``bits`` = (key_bits, value_bits)), re-cut to 8 rows a thread where
    its blocks do not start here."""
    if call.threadgroup[0] > 512 and not _blocks_start(tuple(call.template), call.threadgroup, D, G, bits):
        call = _with_rows(call, 8, D, G)
    return _run(call, D, G)


def _with_rows(call: Launch, rows: int, D: int, G: int) -> Launch:
    template = [(k, rows if k == "ROWS" else v) for k, v in call.template]
    threads = G * min(D, 128) // (4 * rows)
    blocks = call.grid[0] // call.threadgroup[0]
    return replace(call, template=template, grid=(blocks * threads, call.grid[1], call.grid[2]),
                   threadgroup=(threads, 1, 1))


def _run(call: Launch, D: int, G: int) -> dict[str, mx.array]:
    outs = _kernel(shared_bytes(D, G))(
        inputs=call.inputs, template=call.template, grid=call.grid, threadgroup=call.threadgroup,
        output_shapes=call.output_shapes, output_dtypes=call.output_dtypes)
    return dict(zip(RECORD_FIELDS, outs))
