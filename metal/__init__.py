"""Hand-written kernels through MLX's custom-kernel API, each with a pure-MLX reference.

``paged_decode``: the fused paged KVarN decode attention (CUDA); ``paged_decode_metal``: its Metal
twin (Apple GPUs). Which decode path is in force is decided once per process by
``attention_path()``: ``"cuda-fused"`` or ``"metal-fused"`` where the backend has the kernel and a
self-check at first use (kernel against reference on a small random case) passes; otherwise the
reference, with one logged warning.

``commit``: the fused tile commit (the whole quantizer, CUDA); ``commit_metal``: its Metal twin.
``commit_path(reference=...)`` decides it the same way, once per layout; the caller passes the
pure-MLX quantizer it must match (``metal`` imports nothing of ``kvarn``).

The Metal twins were written and tested without an Apple GPU: their Metal text is run on Linux
CPUs by a g++ emulator (``tests/metal/metal_emulator.py``) and has never been compiled by Apple's
Metal compiler here. On an Apple GPU the self-checks above are what compiles and checks them
before use; a compile error or a failed check gives the reference (docs/kernels.md, "Metal twins").

``ragged_decode``: the fused ragged decode attention of the fp16 baseline (CUDA): every row of a
layer over its own slot of the shared ``[N, H, T_cap, D]`` buffers, float16 or bfloat16.
``ragged_decode_path()`` decides it like ``attention_path()``: once per process, the kernel where
MLX has a CUDA device and a self-check (kernel vs reference on a small random ragged case, both the
split and the one-item-a-row plans) passes, else the reference with one logged warning.
``decided_ragged_decode_path()`` reads the verdict without deciding.
"""

from __future__ import annotations

import logging

import mlx.core as mx

log = logging.getLogger(__name__)
_VERDICT: list[str] = []
SELF_CHECK_TOLERANCE = 2e-2  # max |kernel - reference| / max |reference|: float16 noise is ~1e-3


def _has_cuda() -> bool:
    return hasattr(mx, "cuda") and mx.cuda.is_available()


def _has_metal() -> bool:
    return hasattr(mx, "metal") and mx.metal.is_available()


def _self_check(kernel=None) -> float:
    """``kernel`` (``paged_decode_attention``'s signature; None: the CUDA one) vs the reference on
    a small random pool (records at scattered ids, ragged rows): the max relative error."""
    from metal.paged_decode import RECORD_FIELDS, RowLengths, paged_decode_attention, \
        reference_paged_decode_attention
    kernel = kernel or paged_decode_attention
    key = mx.random.key(11)
    H, NR, D, G, N = 2, 4, 128, 128, 6
    ks = mx.random.split(key, 12)
    records = {
        "k_codes": mx.random.randint(0, 2**31, (N, H, 1, D, G * 4 // 32), key=ks[0]).astype(mx.uint32),
        "v_codes": mx.random.randint(0, 2**31, (N, H, G, D * 2 // 32), key=ks[1]).astype(mx.uint32)}
    for i, (name, shape) in enumerate([("k_alpha", (N, H, 1, D)), ("k_beta", (N, H, 1, D)), ("k_r", (N, H, 1, G)),
                                       ("v_alpha", (N, H, G, 1)), ("v_beta", (N, H, G, 1)), ("v_c", (N, H, D))]):
        records[name] = (mx.random.uniform(0.05, 0.3, shape, key=ks[2 + i])).astype(mx.float16)
    win_k = mx.random.normal((4, H, 2 * G, D), key=ks[8]).astype(mx.float16)
    win_v = mx.random.normal((4, H, 2 * G, D), key=ks[9]).astype(mx.float16)
    queries = mx.random.normal((3, H * NR, 1, D), key=ks[10]).astype(mx.float16)
    table = mx.array([[3, 1, 5], [0, 0, 0], [2, 0, 0]], dtype=mx.int32)
    lengths = RowLengths(slots=(2, 1, 3), sink_len=(G, 7, G), tail_len=(5, 0, 0), num_tiles=(3, 0, 1))
    kw = dict(queries=queries, records={n: records[n] for n in RECORD_FIELDS}, win_k=win_k, win_v=win_v,
              table=table, lengths=lengths, scale=D ** -0.5, key_bits=4, value_bits=2)
    out = kernel(**kw).astype(mx.float32)
    ref = reference_paged_decode_attention(**kw).astype(mx.float32)
    return (mx.max(mx.abs(out - ref)) / mx.max(mx.abs(ref))).item()


def _decide() -> str:
    if _has_cuda():
        kind, kernel, verdict = "CUDA", None, "cuda-fused"
    elif _has_metal():
        from metal.paged_decode_metal import paged_decode_attention as kernel
        kind, verdict = "Metal", "metal-fused"
    else:
        log.warning("kvarn: no GPU backend with a fused decode kernel; KVarN decode runs the pure-MLX reference path")
        return "reference"
    try:
        err = _self_check(kernel)
    except Exception as exc:  # a compile or launch failure: the reference still works
        log.warning("kvarn: the fused %s decode kernel failed its self-check (%s); running the reference path", kind,
                    exc)
        return "reference"
    if not err <= SELF_CHECK_TOLERANCE:
        log.warning("kvarn: the fused %s decode kernel is off its reference by %.3g (max relative); running the "
                    "reference path", kind, err)
        return "reference"
    return verdict


def attention_path() -> str:
    """``"cuda-fused"`` | ``"metal-fused"`` | ``"reference"``: the KVarN decode attention in force,
    decided at first call (one warning when it is the reference) and fixed for the process."""
    if not _VERDICT:
        _VERDICT.append(_decide())
    return _VERDICT[0]


def decided_attention_path() -> str | None:
    """The verdict if ``attention_path()`` has run (on the engine thread, at the first paged decode
    step), else None; never runs the self-check itself (so other threads may ask)."""
    return _VERDICT[0] if _VERDICT else None


# ---- the tile commit ----
_COMMIT_VERDICTS: dict[tuple, str] = {}
_COMMIT_WARNED: list[bool] = []
COMMIT_SELF_CHECK_CODES = 0.99  # fraction of code words equal to the reference's
COMMIT_SELF_CHECK_FACTORS = 1e-2  # max |kernel - reference| / max |reference| per factor field (float16 ~1e-3)


def _commit_warning(msg: str, *args) -> None:
    """One warning per process, whatever the number of layouts that fall back."""
    if not _COMMIT_WARNED:
        _COMMIT_WARNED.append(True)
        log.warning(msg, *args)


def commit_self_check(reference, *, head_dim: int, tile_size: int, key_bits: int, value_bits: int,
                      iters: int, kernels: tuple | None = None) -> tuple[float, float]:
    """The kernel against ``reference`` on two random tiles of two heads (keys with uneven
    channels), given as tiles and as the tails of windows 2 and 0 of three-window buffers:
    (fraction of equal code words, worst relative factor difference; the worse of the two).
    ``kernels``: (quantize_tiles, quantize_window_tails) with ``metal.commit``'s signatures
    (None: the CUDA ones)."""
    if kernels is None:
        from metal.commit import quantize_tiles, quantize_window_tails
    else:
        quantize_tiles, quantize_window_tails = kernels
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
    for got in (quantize_tiles(**kw), quantize_window_tails(win_k=win_k, win_v=win_v, slots=slots, key_bits=key_bits,
                                                            value_bits=value_bits, iters=iters)):
        same, worst = _compare_records(got, want, same, worst)
    return same, worst


def _compare_records(got: dict, want: dict, same: float, worst: float) -> tuple[float, float]:
    import numpy as np

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


def _decide_commit(reference, key: tuple) -> str:
    head_dim, tile_size, key_bits, value_bits, iters = key
    if _has_cuda():
        from metal.commit import is_supported
        kind, kernels, verdict = "CUDA", None, "cuda-fused"
    elif _has_metal():
        from metal.commit_metal import is_supported, quantize_tiles, quantize_window_tails
        kind, kernels, verdict = "Metal", (quantize_tiles, quantize_window_tails), "metal-fused"
    else:
        _commit_warning("kvarn: no GPU backend with a fused commit kernel; KVarN commits run the pure-MLX quantizer")
        return "reference"
    if not is_supported(head_dim=head_dim, tile_size=tile_size, key_bits=key_bits, value_bits=value_bits):
        _commit_warning("kvarn: no fused %s commit kernel for head_dim %d, tile %d, k%dv%d; commits run the pure-MLX "
                        "quantizer", kind, head_dim, tile_size, key_bits, value_bits)
        return "reference"
    try:
        same, worst = commit_self_check(reference, head_dim=head_dim, tile_size=tile_size, key_bits=key_bits,
                                        value_bits=value_bits, iters=iters, kernels=kernels)
    except Exception as exc:  # a compile or launch failure: the reference still works
        _commit_warning("kvarn: the fused %s commit kernel failed its self-check (%s); commits run the pure-MLX "
                        "quantizer", kind, exc)
        return "reference"
    if not (same >= COMMIT_SELF_CHECK_CODES and worst <= COMMIT_SELF_CHECK_FACTORS):
        _commit_warning("kvarn: the fused %s commit kernel is off its reference (%.4f of code words equal, "
                        "factors off by %.3g); commits run the pure-MLX quantizer", kind, same, worst)
        return "reference"
    return verdict


def commit_path(*, reference, head_dim: int = 128, tile_size: int = 128, key_bits: int = 4, value_bits: int = 2,
                iters: int = 8) -> str:
    """``"cuda-fused"`` | ``"metal-fused"`` | ``"reference"``: the KVarN tile commit in force for
    this layout, decided at its first call and fixed for the process: the fused kernel where MLX
    has a CUDA device (``metal.commit``) or an Apple GPU (``metal.commit_metal``), the kernel has a
    template for the layout and it passes a self-check against ``reference`` (the pure-MLX
    quantizer: called as ``reference(keys=, values=, key_bits=, value_bits=, iters=)`` like
    ``metal.commit.quantize_tiles``, returning the same record fields); else the reference, with
    one logged warning. Without a GPU backend ``reference`` is not called."""
    key = (head_dim, tile_size, key_bits, value_bits, iters)
    if key not in _COMMIT_VERDICTS:
        _COMMIT_VERDICTS[key] = _decide_commit(reference, key)
    return _COMMIT_VERDICTS[key]


def decided_commit_path() -> str | None:
    """The first verdict ``commit_path()`` reached in this process, else None (never decides)."""
    return next(iter(_COMMIT_VERDICTS.values()), None)


# ---- the fp16 baseline's ragged decode ----
_RAGGED_VERDICT: list[str] = []


def ragged_self_check() -> float:
    """Kernel vs reference on a small random ragged batch (scattered slots, garbage past the rows'
    lengths, bfloat16 queries over float16 K/V), with rows split (the combine launch) and with one
    item a row (the FINAL launch): the worse max relative error."""
    from metal.ragged_decode import make_plan, ragged_decode_attention, reference_ragged_decode_attention
    ks = mx.random.split(mx.random.key(23), 3)
    H, NR, D, N, T_cap = 2, 4, 128, 6, 1100
    lengths, slots = (1, 300, 1000, 77), (4, 0, 2, 5)
    keys = mx.random.normal((N, H, T_cap, D), key=ks[0]).astype(mx.float16)
    values = mx.random.normal((N, H, T_cap, D), key=ks[1]).astype(mx.float16)
    queries = mx.random.normal((len(lengths), H * NR, 1, D), key=ks[2]).astype(mx.bfloat16)
    kw = dict(queries=queries, keys=keys, values=values, slots=slots, lengths=lengths, scale=D ** -0.5)
    ref = reference_ragged_decode_attention(**kw).astype(mx.float32)
    worst = 0.0
    for plan in (make_plan(slots, lengths, H, single=False), make_plan(slots, lengths, H, single=True)):
        out = ragged_decode_attention(**kw, plan=plan).astype(mx.float32)
        worst = max(worst, (mx.max(mx.abs(out - ref)) / mx.max(mx.abs(ref))).item())
    return worst


def _decide_ragged() -> str:
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        log.warning("kvarn: no CUDA backend with the fused ragged decode kernel; the fp16 baseline's batched decode "
                    "runs the pure-MLX reference path")
        return "reference"
    try:
        err = ragged_self_check()
    except Exception as exc:  # a compile or launch failure: the reference still works
        log.warning("kvarn: the fused CUDA ragged decode kernel failed its self-check (%s); running the reference "
                    "path", exc)
        return "reference"
    if not err <= SELF_CHECK_TOLERANCE:
        log.warning("kvarn: the fused CUDA ragged decode kernel is off its reference by %.3g (max relative); running "
                    "the reference path", err)
        return "reference"
    return "cuda-fused"


def ragged_decode_path() -> str:
    """``"cuda-fused"`` | ``"reference"``: the fp16 baseline's ragged decode attention in force
    (``metal.ragged_decode``), decided at first call (one warning when it is the reference) and
    fixed for the process; never raises."""
    if not _RAGGED_VERDICT:
        try:
            verdict = _decide_ragged()
        except Exception as exc:  # noqa: BLE001 (a verdict must come back whatever happened)
            log.warning("kvarn: deciding the ragged decode path failed (%s); running the reference path", exc)
            verdict = "reference"
        _RAGGED_VERDICT.append(verdict)
    return _RAGGED_VERDICT[0]


def decided_ragged_decode_path() -> str | None:
    """The verdict if ``ragged_decode_path()`` has run, else None; never decides (other threads may ask)."""
    return _RAGGED_VERDICT[0] if _RAGGED_VERDICT else None
