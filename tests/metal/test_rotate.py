"""The rotation kernel (metal/cuda/rotate.py): its CUDA source run by the CPU emulator against MLX's
``hadamard_transform`` in float32 and MLX's casts, bit for bit (every input and output dtype,
slices of 64 and 128, a pair, views read through their strides, vectors that end mid-block,
values past float16's range), the launch's shape rules, the kernel on a GPU, and the verdict."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from metal.cuda import rotate as rt
from metal.selector import Kernels, rotate_mismatch_cuda
from tests.metal import cuda_emulator

HAS_CUDA = hasattr(mx, "cuda") and mx.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU: the kernel runs only there")
needs_gxx = pytest.mark.skipif(not cuda_emulator.available(), reason="no g++ for the CUDA emulator")
DTYPES = (mx.float16, mx.bfloat16, mx.float32)


def want(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """MLX's path: each slice's transform in float32, then one cast."""
    D = x.shape[-1]
    W = rt.slice_width(D)
    f = x.astype(mx.float32)
    out = mx.hadamard_transform(f.reshape(*f.shape[:-1], D // W, W)).reshape(f.shape)
    return out.astype(dtype)


def emulated(x: mx.array, y: mx.array | None, dtype: mx.Dtype, views: dict | None = None) -> np.ndarray:
    """The kernel's launch run by the emulator. ``views``: input name -> (base array, element
    strides of the 4-axis view the kernel reads from it): the kernel then gets the base's memory
    with those strides, as MLX hands it a view."""
    inputs, template, grid, threadgroup, shape = rt.launch(x, y, dtype)
    views = views or {}
    arrays, names = [], []
    for name, a in zip(rt.INPUTS, inputs):
        base, strides = views.get(name, (a, None))
        data = cuda_emulator._np(base)
        shape_of = np.empty(a.shape, np.uint8) if strides is not None else data  # the view's shape, the base's memory
        arrays += [data, *cuda_emulator.shape_arrays(rt.SOURCE, name, shape_of, strides)]
        names.append((name, cuda_emulator._dt(a.dtype)))
    out = np.full(shape, 0xFFFF, np.uint16) if dtype == mx.bfloat16 else np.full(shape, np.nan, cuda_emulator._dt(dtype))
    lib = cuda_emulator.build("kvarn_rotate", rt.HEADER, rt.SOURCE, names, [("out", cuda_emulator._dt(dtype))],
                              [(n, v) for n, v in template])
    cuda_emulator.launch(lib, arrays + [out], (grid[0] // threadgroup[0], 1, 1), threadgroup[0])
    return out


def as_mx(out: np.ndarray, dtype: mx.Dtype) -> mx.array:
    return mx.array(out).view(mx.bfloat16) if dtype == mx.bfloat16 else mx.array(out)


def bits_equal(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b, equal_nan=True).item()


def sample(shape, dtype, seed=0, spread=4.0):
    x = mx.random.normal(shape, key=mx.random.key(seed)) * mx.linspace(0.1, spread, shape[-1])
    return x.astype(dtype)


@needs_gxx
@pytest.mark.parametrize("dtype_in", DTYPES)
@pytest.mark.parametrize("dtype_out", DTYPES)
def test_emulated_bits_every_dtype(dtype_in, dtype_out):
    x = sample((2, 3, 5, 128), dtype_in, seed=1)
    got = as_mx(emulated(x, None, dtype_out), dtype_out)
    assert bits_equal(got, want(x, dtype_out))


@needs_gxx
@pytest.mark.parametrize("shape", [(1, 8, 1, 256), (3, 2, 4, 64), (7, 64), (5, 32), (128,)])
def test_emulated_bits_slices_and_ranks(shape):
    """Two 128-channel slices a head, whole 64- and 32-channel heads, fewer axes, vector counts that
    end mid-block (5 x 32-wide slices: 40 threads of a 256-thread block)."""
    x = sample(shape, mx.float32, seed=2, spread=30.0)
    got = as_mx(emulated(x, None, mx.float16), mx.float16)
    assert bits_equal(got, want(x, mx.float16))


@needs_gxx
def test_emulated_pair_is_the_rotated_concatenation():
    keys, values = sample((3, 8, 1, 128), mx.bfloat16, seed=3), sample((3, 8, 1, 128), mx.bfloat16, seed=4)
    got = as_mx(emulated(keys, values, mx.float16), mx.float16)
    assert got.shape == (6, 8, 1, 128)
    assert bits_equal(got, want(mx.concatenate([keys, values]), mx.float16))


@needs_gxx
def test_emulated_reads_views_through_their_strides():
    """A model's keys: [B, L, H, D] projections seen as [B, H, L, D] (and, for the pair, values of
    another layout): the kernel reads the base memory through the view's strides."""
    B, L, H, D = 2, 5, 3, 128
    base_k = sample((B, L, H, D), mx.float16, seed=5)
    base_v = sample((B, H, D, L), mx.float16, seed=6)  # channels strided: the last axis is not contiguous
    keys, values = base_k.transpose(0, 2, 1, 3), base_v.transpose(0, 1, 3, 2)
    views = {"x": (base_k, (L * H * D, D, H * D, 1)), "y": (base_v, (H * D * L, D * L, 1, L))}
    got = as_mx(emulated(keys, values, mx.float16, views), mx.float16)
    assert bits_equal(got, want(mx.concatenate([keys, values]), mx.float16))
    single = as_mx(emulated(keys, None, mx.float32, {"x": views["x"]}), mx.float32)
    assert bits_equal(single, want(keys, mx.float32))


@needs_gxx
def test_emulated_past_float16_range():
    x = mx.concatenate([sample((2, 128), mx.float32, seed=7) * 30000.0, sample((2, 128), mx.float32, seed=8)])
    got = as_mx(emulated(x, None, mx.float16), mx.float16)
    assert bool(mx.any(mx.isinf(got)).item())
    assert bits_equal(got, want(x, mx.float16))


def test_shape_rules():
    assert rt.is_supported(mx.zeros((2, 8, 1, 128), mx.bfloat16), mx.float16)
    assert rt.is_supported(mx.zeros((2, 256), mx.float32), mx.bfloat16)
    assert not rt.is_supported(mx.zeros((2, 8, 1, 96), mx.float16), mx.float16)  # no power-of-two slice
    assert not rt.is_supported(mx.zeros((1, 2, 8, 1, 128), mx.float16), mx.float16)  # five axes
    assert not rt.is_supported(mx.zeros((2, 128), mx.int32), mx.float16)
    assert not rt.is_supported(mx.zeros((0, 128), mx.float16), mx.float16)
    with pytest.raises(ValueError, match="one shape and dtype"):
        rt.rotate_pair(mx.zeros((2, 128), mx.float16), mx.zeros((3, 128), mx.float16), mx.float16)
    with pytest.raises(ValueError, match="no rotation kernel"):
        rt.rotate_cast(mx.zeros((2, 96), mx.float16), mx.float16)


def test_launch_covers_every_vector():
    x = mx.zeros((3, 8, 7, 256), mx.bfloat16)
    inputs, template, grid, threadgroup, shape = rt.launch(x, x, mx.float16)
    assert dict(template) == {"W": 128, "PAIR": 2}
    assert shape == (6, 8, 7, 256)
    assert grid[0] % threadgroup[0] == 0 and grid[0] >= 2 * x.size // 4
    assert all(a.ndim == 4 for a in inputs[:2])


@needs_cuda
def test_kernel_bits_on_the_gpu():
    for x_dtype, dtype, width in ((mx.bfloat16, mx.float16, 128), (mx.bfloat16, mx.bfloat16, 128),
                                  (mx.float16, mx.float16, 64), (mx.float32, mx.float16, 128)):
        assert rotate_mismatch_cuda(None, x_dtype, dtype, width) == 0.0
    B, L, H, D = 2, 9, 8, 128
    keys = sample((B, L, H, D), mx.bfloat16, seed=9).transpose(0, 2, 1, 3)
    assert bits_equal(rt.rotate_pair(keys, keys * 2, mx.float16), want(mx.concatenate([keys, keys * 2]), mx.float16))


def test_verdict_without_a_gpu_is_the_reference():
    kernels = Kernels(backend=None)
    assert kernels.rotate(mx.bfloat16, mx.float16, 128) is None
    assert kernels.decided_rotate_path() == "reference"


def test_verdict_per_combination_from_the_check():
    """Each (input dtype, output dtype, width) is decided by its own check, once; a kernel off MLX's
    bits (here: one that rounds the wrong way) or one that raises is not used."""
    from metal.selector import Backend, RotateKernel

    calls = []

    def cast(x, dtype):
        calls.append(("cast", x.dtype, dtype))
        return want(x, dtype)

    def pair(x, y, dtype):
        return want(mx.concatenate([x, y]), dtype)

    good = Kernels(backend=Backend("Test", "cuda-fused", rotate=RotateKernel(cast, pair)))
    assert good.rotate(mx.bfloat16, mx.float16, 128) is not None
    assert good.rotate(mx.bfloat16, mx.float16, 128) is not None
    assert good.rotate(mx.float16, mx.float16, 64) is not None
    assert calls == [("cast", mx.bfloat16, mx.float16), ("cast", mx.float16, mx.float16)]
    off = Kernels(backend=Backend("Test", "cuda-fused", rotate=RotateKernel(
        lambda x, dtype: want(x, mx.bfloat16).astype(dtype), pair)))
    assert off.rotate(mx.bfloat16, mx.float16, 128) is None

    def broken(x, dtype):
        raise RuntimeError("no compiler")

    assert Kernels(backend=Backend("Test", "cuda-fused", rotate=RotateKernel(broken, pair))).rotate(
        mx.float16, mx.float16, 128) is None


def test_pinned_verdicts():
    kernels = Kernels(backend=None)
    kernels.pin_rotate_path("reference")
    assert kernels.rotate(mx.bfloat16, mx.float16, 128) is None
    with pytest.raises(ValueError, match="rotation path"):
        kernels.pin_rotate_path("cuda-fused")
