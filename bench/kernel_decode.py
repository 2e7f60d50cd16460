"""One layer's KVarN decode attention on the GPU: the fused paged kernel (metal/paged_decode.py)
vs fused fp16 SDPA on contiguous fp16 K/V vs the pure-MLX reference path (gather, dequantize, SDPA).

32 query heads, 8 KV heads, D = 128, G = 128, k4v2; B rows of T tokens each. Timing: ``n`` calls
queued, one mx.eval, mx.synchronize; median over ``reps`` (after warm-up). KVarN bytes = what the
kernel must read: the rows' record blocks + the valid sink and tail tokens (float16).

    python3 bench/kernel_decode.py --out bench/results/kernel-decode-h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvarn.layout import KVLayout  # noqa: E402
from kvarn.pool import block_nbytes, record_shapes  # noqa: E402
from metal import attention_path  # noqa: E402
from metal.paged_decode import RowLengths, make_plan, paged_decode_attention, \
    reference_paged_decode_attention  # noqa: E402

NQ, H, D, G = 32, 8, 128, 128
LAYOUT = KVLayout.kvarn("k4v2")
SHAPES = [(1, 4096), (16, 4096), (16, 32768), (64, 8192), (1, 32768), (32, 16384), (4, 4096 + 77)]
PEAK = 4.2e12


def timed(fn, n: int, reps: int) -> float:
    for _ in range(3):
        mx.eval(fn())
    mx.synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(n)])
        mx.synchronize()
        out.append((time.perf_counter() - t0) / n)
    return statistics.median(out)


def pool_case(B: int, T: int):
    """A pool layer holding B rows of T tokens (random codes and factors), blocks interleaved."""
    sink, rest = min(T, G), max(0, T - G)
    nt, tail = rest // G, rest % G
    n_blocks = B * nt + 1
    key = mx.random.key(0)
    records = {}
    record_shapes_ = record_shapes(LAYOUT, H, D)
    for i, (name, (shape, dt)) in enumerate(record_shapes_.items()):
        k = mx.random.split(key, len(record_shapes_))[i]
        if dt == mx.uint32:
            records[name] = mx.random.randint(0, 2**31, (n_blocks, *shape), key=k).astype(mx.uint32)
        else:
            records[name] = mx.random.uniform(0.02, 0.2, (n_blocks, *shape), key=k).astype(dt)
    win_k = mx.random.normal((B + 1, H, 2 * G, D)).astype(mx.float16)
    win_v = mx.random.normal((B + 1, H, 2 * G, D)).astype(mx.float16)
    ids = mx.arange(1, n_blocks, dtype=mx.int32).reshape(nt, B).T if nt else None  # row b: b+1, b+1+B, ...
    lengths = RowLengths(tuple(range(1, B + 1)), (sink,) * B, (tail,) * B, (nt,) * B)
    q = mx.random.normal((B, NQ, 1, D)).astype(mx.float16)
    mx.eval(records, win_k, win_v, q)
    kw = dict(queries=q, records=records, win_k=win_k, win_v=win_v, table=ids, lengths=lengths, scale=D ** -0.5,
              key_bits=4, value_bits=2)
    nbytes = B * (nt * block_nbytes(LAYOUT, H, D) + (sink + tail) * H * D * 2 * 2)
    return kw, nbytes


def run_shape(B: int, T: int, reps: int) -> dict:
    kw, nbytes = pool_case(B, T)
    L = kw["lengths"]
    plan = make_plan(L.slots, L.sink_len, L.tail_len, L.num_tiles, H)
    K = mx.random.normal((B, H, T, D)).astype(mx.float16)
    V = mx.random.normal((B, H, T, D)).astype(mx.float16)
    mx.eval(K, V)
    q = kw["queries"]
    n = max(3, min(50, int(2e9 // (K.nbytes + V.nbytes))))
    res = {"B": B, "T": T, "kvarn_bytes": nbytes, "fp16_bytes": K.nbytes + V.nbytes, "splits": plan.num_items}
    res["fused_ms"] = 1e3 * timed(lambda: paged_decode_attention(**kw, plan=plan), n, reps)
    res["fused_ms_by_blocks_per_sm"] = {}
    for bps in (4, 8, 32):  # the split policy's knob (the default is BLOCKS_PER_SM)
        p2 = make_plan(L.slots, L.sink_len, L.tail_len, L.num_tiles, H, blocks_per_sm=bps)
        res["fused_ms_by_blocks_per_sm"][bps] = 1e3 * timed(lambda: paged_decode_attention(**kw, plan=p2), n, reps)
    res["fp16_sdpa_ms"] = 1e3 * timed(lambda: mx.fast.scaled_dot_product_attention(q, K, V, scale=D ** -0.5), n, reps)
    del K, V
    res["reference_ms"] = 1e3 * timed(lambda: reference_paged_decode_attention(**kw), max(2, n // 4), max(3, reps // 3))
    res["fused_GBps"] = nbytes / res["fused_ms"] / 1e6
    res["fused_frac_of_4.2TBps"] = res["fused_GBps"] * 1e9 / PEAK
    res["fp16_GBps"] = res["fp16_bytes"] / res["fp16_sdpa_ms"] / 1e6
    res["speedup_vs_fp16"] = res["fp16_sdpa_ms"] / res["fused_ms"]
    res["speedup_vs_reference"] = res["reference_ms"] / res["fused_ms"]
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/kernel-decode.json")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    out = {"device": str(mx.default_device()), "mlx": mx.__version__, "attention_path": attention_path(),
           "heads": [NQ, H], "head_dim": D, "tile": G, "layout": "k4v2", "rows": []}
    for B, T in SHAPES:
        r = run_shape(B, T, args.reps)
        out["rows"].append(r)
        print(f"{B:3d} x {T:6d}  fused {r['fused_ms']:.4f} ms ({r['fused_GBps']:.0f} GB/s, "
              f"{r['fused_frac_of_4.2TBps']:.2f})  fp16 {r['fp16_sdpa_ms']:.4f} ms  ref {r['reference_ms']:.3f} ms  "
              f"x{r['speedup_vs_fp16']:.2f} vs fp16  splits {r['splits']}  by blocks/SM "
              f"{ {k: round(v, 4) for k, v in r['fused_ms_by_blocks_per_sm'].items()} }", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
