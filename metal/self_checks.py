"""The self-checks the selector (``metal.selector.Kernels``) runs before it trusts a kernel: each
kernel against its pure-MLX reference on a small random case, or, for the operations that must
give MLX's own bits (the rotation, RoPE, SwiGLU, the masked exp), bit for bit. Each returns an
error (or a mismatch: 0.0 or infinity) that the selector compares with its tolerances."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from metal.paged_plan import RowLengths
from metal.records import RECORD_FIELDS
from metal.reference import reference_paged_decode_attention, reference_ragged_decode_attention

if TYPE_CHECKING:  # annotations only: the selector imports this module
    from metal.cpu.kernels import CpuKernels
    from metal.selector import CommitKernel, RotateKernel


def _max_rel_error(out: mx.array, ref: mx.array) -> float:
    out, ref = out.astype(mx.float32), ref.astype(mx.float32)
    return (mx.max(mx.abs(out - ref)) / mx.max(mx.abs(ref))).item()


def paged_decode_self_check(kernel: Callable[..., mx.array], dtype: mx.Dtype = mx.float16) -> float:
    """``kernel`` (``paged_decode_attention``'s signature) vs the reference on a small random pool
    (records at scattered ids, ragged rows), queries and windows in ``dtype``: the max relative error."""
    H, NR, D, G, N = 2, 4, 128, 128, 6
    ks = mx.random.split(mx.random.key(11), 12)
    records = {
        "k_codes": mx.random.randint(0, 2**31, (N, H, 1, D, G * 4 // 32), key=ks[0]).astype(mx.uint32),
        "v_codes": mx.random.randint(0, 2**31, (N, H, G, D * 2 // 32), key=ks[1]).astype(mx.uint32)}
    for i, (name, shape) in enumerate([("k_alpha", (N, H, 1, D)), ("k_beta", (N, H, 1, D)), ("k_r", (N, H, 1, G)),
                                       ("v_alpha", (N, H, G, 1)), ("v_beta", (N, H, G, 1)), ("v_c", (N, H, D))]):
        records[name] = (mx.random.uniform(0.05, 0.3, shape, key=ks[2 + i])).astype(mx.float16)
    win_k = mx.random.normal((4, H, 2 * G, D), key=ks[8]).astype(dtype)
    win_v = mx.random.normal((4, H, 2 * G, D), key=ks[9]).astype(dtype)
    queries = mx.random.normal((3, H * NR, 1, D), key=ks[10]).astype(dtype)
    table = mx.array([[3, 1, 5], [0, 0, 0], [2, 0, 0]], dtype=mx.int32)
    lengths = RowLengths(slots=(2, 1, 3), sink_len=(G, 7, G), tail_len=(5, 0, 0), num_tiles=(3, 0, 1))
    kw = dict(queries=queries, records={n: records[n] for n in RECORD_FIELDS}, win_k=win_k, win_v=win_v,
              table=table, lengths=lengths, scale=D ** -0.5, key_bits=4, value_bits=2)
    return _max_rel_error(kernel(**kw), reference_paged_decode_attention(**kw))


def cpu_self_check(kernels: CpuKernels) -> float:
    """The CPU kernels against their references in float32: the decode attention on
    ``paged_decode_self_check``'s pool (float32 queries), the rotation bit for bit
    (``rotate_mismatch``), the softmax's exp on random scores (masked ones too) against ``exp``:
    the larger max relative error."""
    err = paged_decode_self_check(lambda **kw: kernels.paged_decode_attention(**kw), dtype=mx.float32)
    err = max(err, rotate_mismatch(kernels))
    scores = mx.random.normal((3, 5, 300), key=mx.random.key(5)) * 6
    scores = mx.where(mx.arange(300) % 7 == 3, -mx.inf, scores)
    weights, sums, _ = kernels.exp_rows(scores)
    want = mx.exp(scores - mx.max(scores, axis=-1, keepdims=True))
    err = max(err, _max_rel_error(weights, want), _max_rel_error(sums, mx.sum(want, axis=-1, keepdims=True)))
    return max(err, masked_exp_mismatch(kernels))


def masked_exp_mismatch(kernels: CpuKernels) -> float:
    """0.0 where the kernels' softmax parts with the mask added in their pass (and a floor under
    each row's top) give the bits of the mask added by MLX first, else infinity."""
    k1, k2, k3 = mx.random.split(mx.random.key(17), 3)
    scores = mx.random.normal((2, 3, 5, 300), key=k1) * 6
    mask = mx.where(mx.random.uniform(shape=(5, 300), key=k2) < 0.3, -mx.inf, 0.0)
    floor = mx.where(mx.arange(30).reshape(2, 3, 5, 1) % 4 == 1, 9.0, -mx.inf) + mx.random.normal((2, 3, 5, 1), key=k3)
    x = scores + mask
    top = mx.maximum(mx.max(x, axis=-1, keepdims=True), floor)
    got = kernels.exp_rows(scores, mask=mask, floor=floor)
    want = kernels.exp_rows(x, top)
    same = all(mx.array_equal(a, b).item() for a, b in zip(got, (*want[:2], top)))
    return 0.0 if same else float("inf")


def rotate_mismatch(kernels: CpuKernels) -> float:
    """0.0 where the kernels' rotation gives ``mx.hadamard_transform``'s bits over each slice of
    random rows (widths 128 and 64, several slices a row; row-contiguous and a transposed view),
    and rounded to float16 those of MLX's conversions after it (values past float16's range
    too), else infinity: the windows and records must not depend on which of the two rotated them."""
    x = mx.random.normal((3, 5, 256), key=mx.random.key(11)) * mx.linspace(0.1, 30.0, 256)
    x = mx.concatenate([x, x[:1] * 3000.0])  # past float16's range once rotated
    for width in (128, 64):
        for view in (x, x.transpose(1, 0, 2)):  # row-contiguous, and read in place as a model's keys are
            want = mx.hadamard_transform(view.reshape(*view.shape[:2], 256 // width, width)).reshape(view.shape)
            if not mx.array_equal(kernels.rotate(view, width), want).item():
                return float("inf")
            if not mx.array_equal(kernels.rotate(view, width, half=True), want.astype(mx.float16).astype(mx.float32)).item():
                return float("inf")
    return 0.0


def rotate_mismatch_cuda(kernel: RotateKernel | None = None, x_dtype: mx.Dtype = mx.bfloat16,
                         dtype: mx.Dtype = mx.float16, width: int = 128) -> float:
    """0.0 where the rotation kernel (``metal.cuda.rotate``'s by default) gives the bits of MLX's
    ``hadamard_transform`` in float32 and its casts for inputs of ``x_dtype`` rotated in slices of
    ``width`` and rounded to ``dtype`` (a head of two slices where ``width`` is 128; a transposed
    view, as a model's keys are; a pair; values past float16's range), else infinity: windows and
    records must not depend on which one rotated."""
    if kernel is None:
        from metal.cuda import rotate
        cast, pair = rotate.rotate_cast, rotate.rotate_pair
    else:
        cast, pair = kernel.cast, kernel.pair

    def want(x: mx.array) -> mx.array:
        f = x.astype(mx.float32)
        return mx.hadamard_transform(f.reshape(*f.shape[:-1], f.shape[-1] // width, width)).reshape(f.shape).astype(dtype)

    D = 2 * width if width == 128 else width
    k1, k2 = mx.random.split(mx.random.key(31))
    base = mx.random.normal((2, 5, 4, D), key=k1) * mx.linspace(0.1, 30.0, D)
    base = mx.concatenate([base, base[:1] * 3000.0])  # past float16's range once rotated
    x = base.transpose(0, 2, 1, 3).astype(x_dtype)  # a view, as a model's keys
    y = mx.random.normal((3, 4, 5, D), key=k2).astype(x_dtype)
    same = mx.array_equal(cast(x, dtype), want(x), equal_nan=True).item() and mx.array_equal(
        pair(x, y, dtype), want(mx.concatenate([x, y])), equal_nan=True).item()
    return 0.0 if same else float("inf")


def rope_mismatch(kernels: CpuKernels) -> float:
    """0.0 where the kernels' rope gives ``mx.fast.rope``'s bits (queries as the model passes them,
    a transposed view; one offset and one a row; a prompt chunk and a decode token; all channels
    and a part), else infinity: a model's logits must not depend on which of the two ran."""
    for B, T, N, D, dims, base in ((3, 1, 4, 128, 128, 10000.0), (2, 37, 3, 64, 32, 500000.0)):
        x = mx.random.normal((B, T, N, D), key=mx.random.key(13)) * 4
        x = x.transpose(0, 2, 1, 3)
        for offset in (mx.array(4093, dtype=mx.int32), mx.array([0, 130, 70001][:B], dtype=mx.int32)):
            want = mx.fast.rope(x, dims, traditional=False, base=base, scale=0.5 if T > 1 else 1.0, offset=offset)
            got = kernels.rope(x, offset, dims=dims, base=base, scale=0.5 if T > 1 else 1.0)
            if not mx.array_equal(got, want).item():
                return float("inf")
    return 0.0


def swiglu_mismatch(kernels: CpuKernels) -> float:
    """0.0 where the kernels' SwiGLU gives the bits of MLX's ``nn.silu(gate) * up`` (a decode
    row and a prompt chunk; gates over exp's whole range and past it both ways, NaN and infinities;
    a transposed view), else infinity: a model's logits must not depend on which of the two ran."""
    special = mx.array([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 88.0, -88.0, 88.5, -89.0, 1e-30])
    for shape, spread in (((3, 1536), 8.0), ((2, 37, 512), 120.0)):
        k1, k2 = mx.random.split(mx.random.key(29))
        gate = mx.random.normal(shape, key=k1) * spread
        gate = mx.concatenate([special, gate.reshape(-1)[special.size:]]).reshape(shape)
        up = mx.random.normal(shape, key=k2)
        for g, u in ((gate, up), (gate.swapaxes(-1, -2), up.swapaxes(-1, -2))):
            want = nn.silu(g) * u
            if not mx.array_equal(kernels.swiglu(g, u), want, equal_nan=True).item():
                return float("inf")
    return 0.0


def commit_self_check(reference: Callable[..., dict[str, mx.array]], kernel: CommitKernel, *, head_dim: int,
                      tile_size: int, key_bits: int, value_bits: int, iters: int) -> tuple[float, float]:
    """``kernel`` against ``reference`` on two random tiles of two heads (keys with uneven
    channels), given as tiles and as the tails of windows 2 and 0 of three-window buffers:
    (fraction of equal code words, worst relative factor difference; the worse of the two)."""
    k1, k2, k3 = mx.random.split(mx.random.key(17), 3)
    shape = (2, 2, tile_size, head_dim)
    keys = (mx.random.normal(shape, key=k1) * mx.linspace(0.2, 3.0, head_dim)).astype(mx.float16)
    values = mx.random.normal(shape, key=k2).astype(mx.float16)
    kw = dict(keys=keys, values=values, key_bits=key_bits, value_bits=value_bits, iters=iters)
    want = reference(**kw)
    noise = mx.random.normal((3, 2, 2 * tile_size, head_dim), key=k3).astype(mx.float16)
    win_k, win_v = mx.array(noise), mx.array(noise)
    slots = mx.array([2, 0], dtype=mx.int32)
    win_k[slots, :, tile_size:], win_v[slots, :, tile_size:] = keys, values
    same, worst = 1.0, 0.0
    for got in (kernel.tiles(**kw), kernel.window_tails(win_k=win_k, win_v=win_v, slots=slots, key_bits=key_bits,
                                                        value_bits=value_bits, iters=iters)):
        same, worst = _compare_records(got, want, same, worst)
    return same, worst


def _compare_records(got: dict, want: dict, same: float, worst: float) -> tuple[float, float]:
    for name, g in got.items():
        a, b = np.array(g), np.array(want[name])
        if a.shape != b.shape:
            return 0.0, float("inf")
        if name.endswith("codes"):
            same = min(same, float((a == b).mean()))
        else:
            a, b = a.astype(np.float32), b.astype(np.float32)
            worst = max(worst, float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)))
    return same, worst


def ragged_decode_self_check(kernel: Callable[..., mx.array], make_plan: Callable) -> float:
    """``kernel`` (``ragged_decode_attention``'s signature) vs the reference on a small random
    ragged batch (scattered slots, garbage past the rows' lengths, bfloat16 queries over float16
    K/V), with rows split (the combine launch) and with one item a row (the FINAL launch), the
    plans made by ``make_plan``: the worse max relative error."""
    ks = mx.random.split(mx.random.key(23), 3)
    H, NR, D, N, T_cap = 2, 4, 128, 6, 1100
    lengths, slots = (1, 300, 1000, 77), (4, 0, 2, 5)
    keys = mx.random.normal((N, H, T_cap, D), key=ks[0]).astype(mx.float16)
    values = mx.random.normal((N, H, T_cap, D), key=ks[1]).astype(mx.float16)
    queries = mx.random.normal((len(lengths), H * NR, 1, D), key=ks[2]).astype(mx.bfloat16)
    kw = dict(queries=queries, keys=keys, values=values, slots=slots, lengths=lengths, scale=D ** -0.5)
    ref = reference_ragged_decode_attention(**kw)
    return max(_max_rel_error(kernel(**kw, plan=make_plan(slots, lengths, H, single=single)), ref)
               for single in (False, True))
