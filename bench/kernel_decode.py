"""One layer's KVarN decode attention on the GPU: the fused paged kernel (metal/cuda/paged_decode.py; its
tensor-core body and variants, its scalar body) vs fused fp16 SDPA on contiguous fp16 K/V vs the
pure-MLX reference path (gather, dequantize, SDPA).

32 query heads, 8 KV heads, D = 128, G = 128, k4v2; B rows of T tokens each. Timing: 32 calls
queued (as a 32-layer decode step queues one a layer), one mx.eval, mx.synchronize; median over
``reps`` (after warm-up). KVarN bytes = what the
kernel must read: the rows' record blocks + the valid sink and tail tokens (float16). Every variant's
output is checked against the reference path on the same case (max |a - b| / max |b|).

    python3 bench/kernel_decode.py --out bench/results/kernel-decode-h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvarn.layout import KVLayout  # noqa: E402
from kvarn.pool import block_nbytes, record_shapes  # noqa: E402
from metal import KERNELS  # noqa: E402
from metal.cuda.paged_decode import Variant, paged_decode_attention  # noqa: E402
from metal.paged_plan import BLOCKS_PER_SM, RowLengths, make_plan  # noqa: E402
from metal.reference import reference_paged_decode_attention  # noqa: E402

NQ, H, D, G = 32, 8, 128, 128
LAYOUT = KVLayout.kvarn("k4v2")
SHAPES = [(1, 4096), (16, 4096), (16, 32768), (64, 8192), (1, 32768), (32, 16384), (4, 4096 + 77)]
PEAK = 4.2e12
VARIANTS = {  # name -> (variant, make_plan keywords)
    "mma": (Variant(), {}),                                      # the default plan policy
    "mma-split": (Variant(), {"single": False}),                 # always split (about one wave)
    "mma-single": (Variant(), {"single": True}),                 # always one work item a row, one launch
    "mma-fold": (Variant(fold_k=1, fold_v=1), {}),
    "scalar": (Variant(kind="scalar"), {"blocks_per_sm": 16, "single": False}),
}
CALLS = 32  # calls queued per mx.eval, as one decode step queues one per layer
ROTATE = 256 << 20  # each timed call reads other copies until this many bytes (4x the L2): no cache reuse


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


def pool_case(B: int, T: int, seed: int = 0):
    """A pool layer holding B rows of T tokens (random codes and factors), blocks interleaved."""
    sink, rest = min(T, G), max(0, T - G)
    nt, tail = rest // G, rest % G
    n_blocks = B * nt + 1
    key = mx.random.key(seed)
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


def rel_err(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.max(mx.abs(a - b)) / mx.max(mx.abs(b))).item()


def run_shape(B: int, T: int, reps: int, variants: dict) -> dict:
    kw, nbytes = pool_case(B, T)
    copies = [kw] + [pool_case(B, T, seed)[0] for seed in range(1, min(64, -(-ROTATE // nbytes)))]
    L = kw["lengths"]
    fp16_bytes = 2 * B * H * T * D * 2
    KV = [(mx.random.normal((B, H, T, D)).astype(mx.float16), mx.random.normal((B, H, T, D)).astype(mx.float16))
          for _ in range(min(64, -(-ROTATE // fp16_bytes)))]
    mx.eval(KV)
    q = kw["queries"]
    n = CALLS
    res = {"B": B, "T": T, "kvarn_bytes": nbytes, "fp16_bytes": fp16_bytes, "kvarn_copies": len(copies),
           "fp16_copies": len(KV), "variants": {}}
    it = iter(range(10**9))

    def sdpa():
        K, V = KV[next(it) % len(KV)]
        return mx.fast.scaled_dot_product_attention(q, K, V, scale=D ** -0.5)

    res["fp16_sdpa_ms"] = 1e3 * timed(sdpa, n, reps)
    del KV
    ref = reference_paged_decode_attention(**kw)
    mx.eval(ref)
    res["reference_ms"] = 1e3 * timed(lambda: reference_paged_decode_attention(**kw), 4, 3)
    for name, (variant, plan_kw) in variants.items():
        plan = make_plan(L.slots, L.sink_len, L.tail_len, L.num_tiles, H, **plan_kw)
        err = rel_err(paged_decode_attention(**kw, plan=plan, variant=variant), ref)

        def call():
            return paged_decode_attention(**copies[next(it) % len(copies)], plan=plan, variant=variant)

        ms = 1e3 * timed(call, n, reps)
        res["variants"][name] = {"ms": ms, "err_vs_reference": err, "splits": plan.num_items,
                                 "GBps": nbytes / ms / 1e6, "frac_of_4.2TBps": nbytes / ms / 1e-3 / PEAK,
                                 "vs_fp16": res["fp16_sdpa_ms"] / ms}
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/kernel-decode.json")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    variants = {k: VARIANTS[k] for k in args.variants.split(",")}
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"device": str(mx.default_device()), "mlx": mx.__version__, "attention_path": KERNELS.attention_path(),
           "git": git, "heads": [NQ, H], "head_dim": D, "tile": G, "layout": "k4v2",
           "default_blocks_per_sm": BLOCKS_PER_SM, "calls_per_eval": CALLS, "rows": []}
    for B, T in SHAPES:
        r = run_shape(B, T, args.reps, variants)
        out["rows"].append(r)
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(f"{B:3d} x {T:6d}  fp16 {r['fp16_sdpa_ms']:.4f} ms  ref {r['reference_ms']:.3f} ms  " + "  ".join(
            f"{k} {v['ms']:.4f} ({v['vs_fp16']:.2f}x, err {v['err_vs_reference']:.1e}, {v['splits']})"
            for k, v in r["variants"].items()), flush=True)
    print("\n| B x T | kernel ms | fp16 SDPA ms | vs fp16 | GB/s | of 4.2 TB/s | best variant (ms, vs fp16) | max err |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out["rows"]:
        v = r["variants"][next(iter(variants))]
        best = min(r["variants"].items(), key=lambda kv: kv[1]["ms"])
        err = max(x["err_vs_reference"] for x in r["variants"].values())
        print(f"| {r['B']} x {r['T']} | {v['ms']:.4f} | {r['fp16_sdpa_ms']:.4f} | {v['vs_fp16']:.2f}x | "
              f"{v['GBps']:.0f} | {v['frac_of_4.2TBps']:.2f} | {best[0]} ({best[1]['ms']:.4f}, "
              f"{best[1]['vs_fp16']:.2f}x) | {err:.1e} |")


if __name__ == "__main__":
    main()
