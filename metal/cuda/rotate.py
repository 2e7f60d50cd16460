"""KVarN's rotation as one CUDA launch (``mx.fast.cuda_kernel``): ``x`` read in its own dtype, the
normalized Hadamard transform of each 128-channel slice (or of the whole head below 128) in
float32, the result rounded once to the dtype asked for, with the bits of
``mx.hadamard_transform(x.astype(float32)).astype(dtype)``.

MLX's path is three or four launches and as many passes over float32 copies (the cast up, its
transform, the cast down; a decode step's keys and values joined first); a decode step makes one
for its token's keys and values, a prompt chunk one for its queries, one for the attention's
output and one for its keys and values (``kvarn.quantize.rotate_to``).

**The same bits as MLX's transform.** MLX's CUDA kernel (``hadamard_n``) runs the butterfly
stages h = 1, 2, 4, ... in order, each element becoming a + b (the lower of its pair) or a - b
(the upper) in float32, then multiplies by the scale 1/sqrt(W) (a float32 constant). This kernel
runs the same stages in the same order: h = 1 and 2 between a lane's four values, the others
between lanes (``__shfl_xor_sync``, which moves values exactly), then the same product. Float32
addition is commutative bit for bit, so which lane holds a and which b does not change a result.
``metal.self_checks.rotate_mismatch_cuda`` checks it against MLX before the kernel is used.

Inputs are read in place through their strides (MLX hands the kernel each input's shape and
strides; a model's keys and values are transposed views of its projections), never copied. The output is
row-contiguous; ``rotate_pair`` writes two arrays of one shape as one ([2n, ...]: a decode step's
keys then values, the concatenation MLX's path makes first).
"""

from __future__ import annotations

import math
from functools import lru_cache

import mlx.core as mx

from metal.launch import minify
from metal.sources import source

THREADS = 256
SUPPORTED_WIDTHS = (32, 64, 128)
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
HEADER = source("cuda", "paged_decode.cuh")  # the paged decode's header: its loads (kv_f) and rounded stores (kv_store)
SOURCE = source("cuda", "rotate.cu")  # the body: x (and y) -> out
KERNEL_TEXT = (minify(HEADER), minify(SOURCE))  # what is compiled
INPUTS = ("x", "y", "scale")
OUTPUTS = ("out",)


def slice_width(head_dim: int) -> int:
    """The transform's width: 128-channel slices of wider heads (``kvarn.quantize.slice_width``)."""
    return min(head_dim, 128)


def is_supported(x: mx.array, dtype: mx.Dtype) -> bool:
    """Whether the kernel takes ``x`` (1 to 4 axes, a float dtype, a last axis that is a multiple of
    the slice width) and the output ``dtype``."""
    if x.ndim < 1 or x.ndim > 4 or x.dtype not in DTYPES or dtype not in DTYPES or x.size == 0:
        return False
    D = x.shape[-1]
    W = slice_width(D)
    return W in SUPPORTED_WIDTHS and D % W == 0


@lru_cache(maxsize=8)
def _scale(width: int) -> mx.array:
    """MLX's default scale of a transform of ``width``: 1/sqrt(width) in double, then float32."""
    return mx.array([1.0 / math.sqrt(width)], dtype=mx.float32)


@lru_cache(maxsize=None)
def _kernel():
    return mx.fast.cuda_kernel(name="kvarn_rotate", input_names=list(INPUTS), output_names=list(OUTPUTS),
                               source=KERNEL_TEXT[1], header=KERNEL_TEXT[0], ensure_row_contiguous=False)


def launch(x: mx.array, y: mx.array | None, dtype: mx.Dtype) -> tuple:
    """(inputs, template, grid, threadgroup, output shape) of a launch over ``x`` (and ``y``): both
    given four axes (unit axes in front: views, never copies), read through their strides."""
    D = x.shape[-1]
    W = slice_width(D)
    x4 = _four_axes(x)
    y4 = x4 if y is None else _four_axes(y)
    pair = 1 if y is None else 2
    vectors = pair * x.size // W
    grid = (-(-vectors * (W // 4) // THREADS) * THREADS, 1, 1)
    shape = x.shape if y is None else (2 * x.shape[0], *x.shape[1:])
    return [x4, y4, _scale(W)], [("W", W), ("PAIR", pair)], grid, (THREADS, 1, 1), shape


def _four_axes(a: mx.array) -> mx.array:
    return mx.expand_dims(a, tuple(range(4 - a.ndim))) if a.ndim < 4 else a


def rotate_cast(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """``mx.hadamard_transform`` of each slice of ``x`` in float32, rounded to ``dtype``."""
    return _run(x, None, dtype)


def rotate_pair(x: mx.array, y: mx.array, dtype: mx.Dtype) -> mx.array:
    """``rotate_cast`` of ``concatenate([x, y])`` without the concatenation (``x``, ``y`` of one
    shape and dtype)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        raise ValueError(f"a rotated pair of one shape and dtype, not {x.shape} {x.dtype} / {y.shape} {y.dtype}")
    return _run(x, y, dtype)


def _run(x: mx.array, y: mx.array | None, dtype: mx.Dtype) -> mx.array:
    if not is_supported(x, dtype):
        raise ValueError(f"no rotation kernel for {x.shape} {x.dtype} -> {dtype}")
    inputs, template, grid, threadgroup, shape = launch(x, y, dtype)
    (out,) = _kernel()(inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
                       output_shapes=[shape], output_dtypes=[dtype])
    return out
