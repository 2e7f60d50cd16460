"""Hand-written kernels through MLX's custom-kernel API, each with a pure-MLX reference.

``paged_decode``: the fused paged KVarN decode attention (CUDA). Which decode path is in force is
decided once per process by ``attention_path()``: the fused kernel where the backend has it and a
self-check at first use (kernel against reference on a small random case) passes; otherwise the
reference, with one logged warning.
"""

from __future__ import annotations

import logging

import mlx.core as mx

log = logging.getLogger(__name__)
_VERDICT: list[str] = []
SELF_CHECK_TOLERANCE = 2e-2  # max |kernel - reference| / max |reference|: float16 noise is ~1e-3


def _self_check() -> float:
    """Kernel vs reference on a small random pool (records at scattered ids, ragged rows)."""
    from metal.paged_decode import RECORD_FIELDS, RowLengths, paged_decode_attention, \
        reference_paged_decode_attention
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
    out = paged_decode_attention(**kw).astype(mx.float32)
    ref = reference_paged_decode_attention(**kw).astype(mx.float32)
    return (mx.max(mx.abs(out - ref)) / mx.max(mx.abs(ref))).item()


def _decide() -> str:
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        if hasattr(mx, "metal") and mx.metal.is_available():
            log.warning("kvarn: no fused Metal decode kernel yet; KVarN decode runs the pure-MLX reference path")
        else:
            log.warning("kvarn: no GPU backend with a fused decode kernel; KVarN decode runs the pure-MLX reference path")
        return "reference"
    try:
        err = _self_check()
    except Exception as exc:  # a compile or launch failure: the reference still works
        log.warning("kvarn: the fused CUDA decode kernel failed its self-check (%s); running the reference path", exc)
        return "reference"
    if not err <= SELF_CHECK_TOLERANCE:
        log.warning("kvarn: the fused CUDA decode kernel is off its reference by %.3g (max relative); running the "
                    "reference path", err)
        return "reference"
    return "cuda-fused"


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
