"""The KVarN quantizer (docs/kvarn.md, "The quantizer"): rotate, normalize, round, absorb, pack.

All math is float32 and vectorized over any leading axes (tiles, heads, layers, rows). A tile
is G tokens x W channels (W = 128-channel slice, or the whole head when head_dim <= 128).

    K tile  M = x^T  (W x G): rows = channels d, columns = tokens g  -> RTN per channel
    V tile  M = x    (G x W): rows = tokens g,  columns = channels d -> RTN per token
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from metal import KERNELS

SLICE_WIDTH = 128
STD_MIN, STD_MAX = 1e-3, 1e3
LOG_MIN, LOG_MAX = -0.3, 10.0
IMBALANCE_FLOOR = 1e-8
STEP_MIN = 1e-10
SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)


def slice_width(head_dim: int) -> int:
    """Channels per record: the head itself up to 128, else 128-channel slices."""
    if head_dim in (64, 128):
        return head_dim
    if head_dim in (256, 512):
        return SLICE_WIDTH
    raise ValueError(f"KVarN supports head_dim 64, 128, 256 and 512, not {head_dim}")


def rotate(x: mx.array, *, half: bool = False) -> mx.array:
    """x @ H along the last axis (normalized Sylvester Hadamard, block-diagonal over 128-channel
    slices for heads wider than 128). H is symmetric and H @ H = I, so this is also the inverse.
    On the CPU, float32 goes through the CPU kernels' rotation where they run (the same bits as
    ``mx.hadamard_transform``, whose CPU kernel is a scalar loop). ``half`` (float32 ``x``): the
    result rounded to float16 and held as float32 (``.astype(mx.float16).astype(mx.float32)``'s
    bits; the CPU kernels round in the same pass)."""
    head_dim = x.shape[-1]
    width = slice_width(head_dim)
    if half and x.dtype != mx.float32:
        raise ValueError(f"a rotation rounded to float16 takes float32, not {x.dtype}")
    kernels = KERNELS.cpu() if x.dtype == mx.float32 else None
    if kernels is not None:
        return kernels.rotate(x, width, half=half)
    if width == head_dim:
        out = mx.hadamard_transform(x)
    else:
        out = mx.hadamard_transform(x.reshape(*x.shape[:-1], head_dim // width, width)).reshape(x.shape)
    return out.astype(mx.float16).astype(mx.float32) if half else out


def rotate_to(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """``rotate(x.astype(float32)).astype(dtype)``, the same bits: where the GPU's rotation kernel
    runs (``metal.KERNELS.rotate``) one launch reading ``x`` in place, else MLX's operations."""
    kernel = _rotation_kernel(x, dtype)
    if kernel is not None:
        return kernel.cast(x, dtype)
    return rotate(x.astype(mx.float32)).astype(dtype)


def rotate_pair_to(x: mx.array, y: mx.array, dtype: mx.Dtype) -> mx.array:
    """``rotate_to(concatenate([x, y]), dtype)`` ([2n, ...]: a step's keys then values); on the GPU
    one launch and no concatenation."""
    kernel = _rotation_kernel(x, dtype) if x.shape == y.shape and x.dtype == y.dtype else None
    if kernel is not None:
        return kernel.pair(x, y, dtype)
    return rotate_to(mx.concatenate([x, y]), dtype)


def _rotation_kernel(x: mx.array, dtype: mx.Dtype) -> Any:
    """The GPU's rotation kernel where it takes ``x`` and ``dtype`` and its verdict is fused, else None."""
    if mx.default_device() == mx.cpu:
        return None
    from metal.cuda.rotate import is_supported, slice_width  # a GPU's kernel: imported where one may run
    if not is_supported(x, dtype):
        return None
    return KERNELS.rotate(x.dtype, dtype, slice_width(x.shape[-1]))


def _std(m: mx.array, axis: int) -> mx.array:
    return mx.sqrt(mx.var(m, axis=axis, ddof=1))


def _balanced(m: mx.array, log_row: mx.array, log_col: mx.array) -> mx.array:
    return m / mx.exp(log_col)[..., None, :] / mx.exp(log_row)[..., :, None]


def _imbalance(col_std: mx.array, row_std: mx.array) -> mx.array:
    col = mx.max(col_std, axis=-1) / mx.maximum(mx.min(col_std, axis=-1), IMBALANCE_FLOOR)
    row = mx.max(row_std, axis=-1) / mx.maximum(mx.min(row_std, axis=-1), IMBALANCE_FLOOR)
    return col + row


def _step(log_scale: mx.array, std: mx.array) -> mx.array:
    return mx.clip(log_scale + mx.log(mx.clip(std, STD_MIN, STD_MAX)), LOG_MIN, LOG_MAX)


def normalize(m: mx.array, iters: int) -> tuple[mx.array, mx.array]:
    """Two-axis log-domain normalization of ``m`` [..., R, C]; returns (log_row [..., R],
    log_col [..., C]) of the iterate with the lowest imbalance, the start (zeros) included.
    Ties go to the later iterate, as in the reference kernel.

    On the CPU the stds come from float64 moments (``_normalize_moments``: two small matrix
    products an iteration instead of ~11 passes over the balanced matrix, the same iterates to
    ~1e-7 in the log domain); elsewhere (GPUs: no float64) from the balanced matrix itself."""
    if mx.default_device() == mx.cpu:
        return _normalize_moments(m, iters)
    return _normalize_direct(m, iters)


def _normalize_direct(m: mx.array, iters: int) -> tuple[mx.array, mx.array]:
    """``normalize`` with each std taken over the balanced matrix (float32)."""
    m = m.astype(mx.float32)
    log_row = mx.zeros(m.shape[:-1], dtype=mx.float32)
    log_col = mx.zeros(m.shape[:-2] + m.shape[-1:], dtype=mx.float32)
    col_std, row_std = _std(m, -2), _std(m, -1)
    best = (_imbalance(col_std, row_std), log_row, log_col)
    for _ in range(iters):
        log_col = _step(log_col, col_std)
        log_row = _step(log_row, _std(_balanced(m, log_row, log_col), -1))
        balanced = _balanced(m, log_row, log_col)
        col_std, row_std = _std(balanced, -2), _std(balanced, -1)
        best = _keep_best(best, _imbalance(col_std, row_std), log_row, log_col)
    return best[1], best[2]


def _normalize_moments(m: mx.array, iters: int) -> tuple[mx.array, mx.array]:
    """``normalize`` from the moments of ``m``: the balanced matrix is m_ij / e_i / f_j
    (e = exp(log_row), f = exp(log_col)), so its std along a row is std_j(m_ij / f_j) / e_i and
    along a column std_i(m_ij / e_i) / f_j, and each of those comes from the weighted sums
    sum x w and sum x^2 w^2 of x = m and m^2: one batched float64 matrix-vector product a
    direction (float64 so that sum x^2 - (sum x)^2 / n keeps a channel with a large offset
    exact: the reference's stds are float64 too). The row std after the row step reuses the
    row sums of the column step (same column scales)."""
    m = m.astype(mx.float32)
    x = m.astype(mx.float64)
    moments = mx.stack([x, x * x])  # [2, ..., R, C]
    log_row = mx.zeros(m.shape[:-1], dtype=mx.float32)
    log_col = mx.zeros(m.shape[:-2] + m.shape[-1:], dtype=mx.float32)
    col_std = _moment_std(moments, log_row, axis=-2).astype(mx.float32)
    row_std = _moment_std(moments, log_col, axis=-1).astype(mx.float32)
    best = (_imbalance(col_std, row_std), log_row, log_col)
    for _ in range(iters):
        log_col = _step(log_col, col_std)
        row_unscaled = _moment_std(moments, log_col, axis=-1)  # std_j(m_ij / f_j), float64
        log_row = _step(log_row, (row_unscaled / mx.exp(log_row.astype(mx.float64))).astype(mx.float32))
        col_std = (_moment_std(moments, log_row, axis=-2) / mx.exp(log_col.astype(mx.float64))).astype(mx.float32)
        row_std = (row_unscaled / mx.exp(log_row.astype(mx.float64))).astype(mx.float32)
        best = _keep_best(best, _imbalance(col_std, row_std), log_row, log_col)
    return best[1], best[2]


def _moment_std(moments: mx.array, log_scale: mx.array, axis: int) -> mx.array:
    """Sample std (float64) of m_ij / exp(log_scale) along ``axis`` (-1: along each row, scales
    per column; -2: along each column, scales per row), from ``moments`` = [m, m^2]."""
    w = mx.exp(-log_scale.astype(mx.float64))
    weights = mx.stack([w, w * w])  # [2, ..., n]
    n = moments.shape[axis]
    if axis == -1:
        sums = (moments @ weights[..., None])[..., 0]
    else:
        sums = (weights[..., None, :] @ moments)[..., 0, :]
    var = (sums[1] - sums[0] * sums[0] / n) / (n - 1)
    return mx.sqrt(mx.maximum(var, 0.0))


def _keep_best(best: tuple[mx.array, mx.array, mx.array], imbalance: mx.array, log_row: mx.array,
               log_col: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """(imbalance, log_row, log_col) of the better iterate; ties go to the later one."""
    better = imbalance <= best[0]
    return (mx.where(better, imbalance, best[0]), mx.where(better[..., None], log_row, best[1]),
            mx.where(better[..., None], log_col, best[2]))


def round_rows(balanced: mx.array, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """Asymmetric min/max RTN of each row: (codes uint32, step a, zero z)."""
    levels = (1 << bits) - 1
    lo = mx.min(balanced, axis=-1)
    hi = mx.max(balanced, axis=-1)
    step = mx.maximum((hi - lo) / levels, STEP_MIN)
    codes = mx.clip(mx.round((balanced - lo[..., None]) / step[..., None]), 0, levels)
    return codes.astype(mx.uint32), step, lo


def pack(codes: mx.array, bits: int) -> mx.array:
    """Pack b-bit codes [..., n] into MLX's affine layout [..., n*b/32] (a little-endian bit
    stream of b-bit values, for every width; ``mx.dequantize`` reads it)."""
    n = codes.shape[-1]
    if (n * bits) % 32:
        raise ValueError(f"{n} codes of {bits} bits do not fill whole 32-bit words")
    codes = codes.astype(mx.uint32)
    if 32 % bits == 0:
        per_word = 32 // bits
        shifts = mx.arange(per_word, dtype=mx.uint32) * bits
        grouped = codes.reshape(*codes.shape[:-1], n // per_word, per_word)
        return mx.sum(grouped << shifts, axis=-1).astype(mx.uint32)
    bit_idx = mx.arange(bits, dtype=mx.uint32)
    stream = ((codes[..., None] >> bit_idx) & 1).reshape(*codes.shape[:-1], n * bits // 32, 32)
    return mx.sum(stream << mx.arange(32, dtype=mx.uint32), axis=-1).astype(mx.uint32)


@dataclass(frozen=True)
class KeyTiles:
    """Quantized K tiles: codes packed along tokens, per-channel alpha/beta, per-token r (fp16).

    K_rot[g, d] = (q[d, g] * alpha[d] + beta[d]) * r[g]
    """

    codes: mx.array  # [..., W, G*bk/32] uint32
    alpha: mx.array  # [..., W]
    beta: mx.array  # [..., W]
    r: mx.array  # [..., G]


@dataclass(frozen=True)
class ValueTiles:
    """Quantized V tiles: codes packed along channels, per-token alpha/beta, per-channel c (fp16).

    V_rot[g, d] = (q[g, d] * alpha[g] + beta[g]) * c[d]
    """

    codes: mx.array  # [..., G, W*bv/32] uint32
    alpha: mx.array  # [..., G]
    beta: mx.array  # [..., G]
    c: mx.array  # [..., W]


def quantize_keys(k_rot: mx.array, bits: int, iters: int) -> KeyTiles:
    """Quantize rotated key tiles [..., G, W] (one slice)."""
    m = mx.swapaxes(k_rot.astype(mx.float32), -1, -2)
    log_row, log_col = normalize(m, iters)
    codes, step, zero = round_rows(_balanced(m, log_row, log_col), bits)
    s_chan, s_tok = mx.exp(log_row), mx.exp(log_col)
    f16 = mx.float16
    return KeyTiles(pack(codes, bits), (s_chan * step).astype(f16), (s_chan * zero).astype(f16), s_tok.astype(f16))


def quantize_values(v_rot: mx.array, bits: int, iters: int) -> ValueTiles:
    """Quantize rotated value tiles [..., G, W] (one slice)."""
    m = v_rot.astype(mx.float32)
    log_row, log_col = normalize(m, iters)
    codes, step, zero = round_rows(_balanced(m, log_row, log_col), bits)
    s_tok, s_chan = mx.exp(log_row), mx.exp(log_col)
    f16 = mx.float16
    return ValueTiles(pack(codes, bits), (s_tok * step).astype(f16), (s_tok * zero).astype(f16), s_chan.astype(f16))


def dequantize_keys(tiles: KeyTiles, bits: int) -> mx.array:
    """Rebuild rotated keys [..., G, W] (float32) from quantized tiles."""
    g = tiles.r.shape[-1]
    q = mx.dequantize(tiles.codes, mx.ones(tiles.alpha.shape + (1,), mx.float32),
                      mx.zeros(tiles.alpha.shape + (1,), mx.float32), group_size=g, bits=bits)
    k = (q * tiles.alpha[..., None].astype(mx.float32) + tiles.beta[..., None].astype(mx.float32))
    return mx.swapaxes(k * tiles.r[..., None, :].astype(mx.float32), -1, -2)


def dequantize_values(tiles: ValueTiles, bits: int) -> mx.array:
    """Rebuild rotated values [..., G, W] (float32) from quantized tiles."""
    w = tiles.c.shape[-1]
    q = mx.dequantize(tiles.codes, mx.ones(tiles.alpha.shape + (1,), mx.float32),
                      mx.zeros(tiles.alpha.shape + (1,), mx.float32), group_size=w, bits=bits)
    v = q * tiles.alpha[..., None].astype(mx.float32) + tiles.beta[..., None].astype(mx.float32)
    return v * tiles.c[..., None, :].astype(mx.float32)


def quantize_keys_values(k_rot: mx.array, v_rot: mx.array, key_bits: int, value_bits: int,
                         iters: int) -> tuple[KeyTiles, ValueTiles]:
    """``quantize_keys`` and ``quantize_values`` of tiles [..., G, W] in one pass when G == W: the
    K matrices (x^T) and the V matrices (x) are then both W x W and go through one stacked
    normalization and rounding (half the operations: what costs on a GPU is their number, not
    their size). The same math on the same matrices, so the same bytes (tested)."""
    if k_rot.shape[-1] != k_rot.shape[-2] or k_rot.shape != v_rot.shape:
        return quantize_keys(k_rot, key_bits, iters), quantize_values(v_rot, value_bits, iters)
    m = mx.stack([mx.swapaxes(k_rot.astype(mx.float32), -1, -2), v_rot.astype(mx.float32)])
    log_row, log_col = normalize(m, iters)
    balanced = _balanced(m, log_row, log_col)
    levels = mx.array([(1 << key_bits) - 1, (1 << value_bits) - 1], dtype=mx.float32)
    levels = levels.reshape(2, *([1] * (m.ndim - 2)))
    lo = mx.min(balanced, axis=-1)
    hi = mx.max(balanced, axis=-1)
    step = mx.maximum((hi - lo) / levels, STEP_MIN)
    codes = mx.clip(mx.round((balanced - lo[..., None]) / step[..., None]), 0, levels[..., None]).astype(mx.uint32)
    row_scale, col_scale = mx.exp(log_row), mx.exp(log_col)
    f16 = mx.float16
    keys = KeyTiles(pack(codes[0], key_bits), (row_scale[0] * step[0]).astype(f16), (row_scale[0] * lo[0]).astype(f16),
                    col_scale[0].astype(f16))
    values = ValueTiles(pack(codes[1], value_bits), (row_scale[1] * step[1]).astype(f16),
                        (row_scale[1] * lo[1]).astype(f16), col_scale[1].astype(f16))
    return keys, values
