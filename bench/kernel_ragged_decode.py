"""One layer's fp16-baseline decode attention on the GPU: the fused ragged kernel
(metal/cuda/ragged_decode.py) over the slot buffers vs fused SDPA with no mask over contiguous stacked
[B, 8, T, 128] K/V (the best fp16 path MLX has: it needs every row at one length) vs the pure-MLX
reference (gather the slots, float32 SDPA under the validity mask).

32 query heads (bfloat16), 8 KV heads (float16 or bfloat16), D = 128; B rows of T tokens each, and
a ragged batch (32 rows of lengths spread over 1k..16k; SDPA then reads every row at the longest
length, unmasked: what padding the batch to one length costs). The slot buffers are [B, 8, T_cap,
128] with row b in slot b, so one array is both the kernel's store and SDPA's operand. Timing: 32
calls queued (as a 32-layer decode step queues one a layer), each over another copy of the data
(copies until ROTATE bytes: the 50 MB L2 cannot serve a call from the previous one), one mx.eval,
mx.synchronize; median over ``--reps`` (after warm-up). Bytes = what the kernel must read: the rows'
valid K and V. Every plan variant's output is checked against the reference (max |a - b| / max |b|).

    python3 bench/kernel_ragged_decode.py --out bench/results/kernel-ragged-h200.json
    python3 bench/kernel_ragged_decode.py --kv-dtypes float16,bfloat16
    python3 bench/kernel_ragged_decode.py --smoke       # tiny shapes; the kernel is skipped without CUDA
    python3 bench/kernel_ragged_decode.py --compile     # nvcc's register report per template (no GPU needed)
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metal import KERNELS  # noqa: E402
from metal.cuda import ragged_decode as rd  # noqa: E402
from metal.device import planning_sms  # noqa: E402
from metal.reference import reference_ragged_decode_attention  # noqa: E402

NQ, H, D = 32, 8, 128
Q_DTYPE = mx.bfloat16
SHAPES = [(1, 4096), (1, 16384), (16, 4096), (32, 4096), (32, 16384), (16, 32768), (64, 8192), "ragged"]
RAGGED = [int(1024 + i * (16384 - 1024) / 31) for i in range(32)]  # 32 rows, 1k..16k
SMOKE_SHAPES = [(1, 64), (3, 200), "ragged-smoke"]
SMOKE_RAGGED = [5, 40, 300, 129]
PEAK = 4.2e12  # H200 HBM3e, bytes/s (nominal 4.8)
VARIANTS = {  # name -> make_plan keywords
    "default": {},                    # the policy (split to TARGET_WAVES waves, never below MIN_SPLIT)
    "single": {"single": True},       # one item a row: one launch, no combine
    "waves4": {"waves": 4},           # twice the blocks
}
CALLS = 32
ROTATE = 256 << 20  # each timed call reads other copies until this many bytes (4-5x the L2)
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16}


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


def rel_err(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.max(mx.abs(a - b)) / mx.max(mx.abs(b))).item()


def make_copy(B: int, t_cap: int, kv_dtype: mx.Dtype, seed: int) -> dict:
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    keys = mx.random.normal((B, H, t_cap, D), key=k1).astype(kv_dtype)
    values = mx.random.normal((B, H, t_cap, D), key=k2).astype(kv_dtype)
    queries = mx.random.normal((B, NQ, 1, D), key=k3).astype(Q_DTYPE)
    mx.eval(keys, values, queries)
    return dict(queries=queries, keys=keys, values=values, sdpa_q=queries.astype(kv_dtype))


def run_shape(shape, kv_dtype: mx.Dtype, reps: int, calls: int, variants: dict, kernel: bool) -> dict:
    if isinstance(shape, str):
        lengths = RAGGED if shape == "ragged" else SMOKE_RAGGED
        B, name = len(lengths), f"ragged {len(lengths)} x {min(lengths)}..{max(lengths)}"
    else:
        B, T = shape
        lengths, name = [T] * B, f"{B} x {T}"
    t_cap = max(lengths)
    itemsize = 2
    nbytes = 2 * sum(lengths) * H * D * itemsize
    store_bytes = 2 * B * H * t_cap * D * itemsize
    copies = [make_copy(B, t_cap, kv_dtype, seed) for seed in range(max(1, min(64, -(-ROTATE // store_bytes))))]
    slots = tuple(range(B))
    scale = D ** -0.5
    res = {"name": name, "B": B, "lengths": lengths if isinstance(shape, str) else None, "T": t_cap,
           "kv_dtype": str(kv_dtype), "bytes": nbytes, "sdpa_bytes": store_bytes, "copies": len(copies),
           "variants": {}}
    it = iter(range(10**12))

    def sdpa():
        c = copies[next(it) % len(copies)]
        return mx.fast.scaled_dot_product_attention(c["sdpa_q"], c["keys"], c["values"], scale=scale)

    res["sdpa_ms"] = 1e3 * timed(sdpa, calls, reps)
    res["sdpa_GBps"] = store_bytes / res["sdpa_ms"] / 1e6
    kw0 = {k: copies[0][k] for k in ("queries", "keys", "values")}
    ref = reference_ragged_decode_attention(**kw0, slots=slots, lengths=lengths, scale=scale)
    mx.eval(ref)
    res["reference_ms"] = 1e3 * timed(
        lambda: reference_ragged_decode_attention(**kw0, slots=slots, lengths=lengths, scale=scale),
        min(4, calls), min(3, reps))
    if not isinstance(shape, str):  # rows of one length: the unmasked SDPA is the same attention
        res["sdpa_err_vs_reference"] = rel_err(
            mx.fast.scaled_dot_product_attention(copies[0]["sdpa_q"], kw0["keys"], kw0["values"], scale=scale), ref)
    if not kernel:
        return res
    for vname, policy in variants.items():
        plan = rd.make_plan(slots, lengths, H, **policy)
        err = rel_err(rd.ragged_decode_attention(**kw0, slots=slots, lengths=lengths, scale=scale, plan=plan), ref)

        def call():
            c = copies[next(it) % len(copies)]
            return rd.ragged_decode_attention(queries=c["queries"], keys=c["keys"], values=c["values"], slots=slots,
                                              lengths=lengths, scale=scale, plan=plan)

        ms = 1e3 * timed(call, calls, reps)
        res["variants"][vname] = {"ms": ms, "GBps": nbytes / ms / 1e6, "frac_of_4.2TBps": nbytes / ms / 1e-3 / PEAK,
                                  "vs_sdpa": res["sdpa_ms"] / ms, "err_vs_reference": err, "items": plan.num_items,
                                  "blocks": plan.num_items * H, "final": plan.final}
    return res


# ---- --compile: the templates through nvcc the way MLX wraps a cuda_kernel body ----
CTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}


def compile_report(QT: str, KT: str, Dh: int, NR: int, final: int) -> str:
    from metal.cuda.ragged_decode import ATTENTION_SOURCE, HEADER
    from metal.launch import minify
    types = {"queries": CTYPES[QT], "keys": CTYPES[KT], "values": CTYPES[KT], "rows": "int32_t", "work": "int32_t",
             "meta": "int32_t", "meta_f": "float"}
    params = [f"const {types[n]}* {n}" for n in rd.ATTENTION_INPUTS]
    params += [f"{CTYPES[QT] if final else 'float'}* part_o", "float* part_ml"]
    consts = (f"  using QT = {CTYPES[QT]};\n  using KT = {CTYPES[KT]};\n  constexpr int D = {Dh};\n"
              f"  constexpr int NR = {NR};\n  constexpr int FINAL = {final};\n")
    text = ("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cstdint>\n" + minify(HEADER) +
            "__global__ void kernel(" + ", ".join(params) + ") {\n" + consts + minify(ATTENTION_SOURCE) + "}\n")
    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / "k.cu"
        cu.write_text(text)
        done = subprocess.run(["nvcc", "-gencode=arch=compute_90a,code=sm_90a", "-cubin", "-Xptxas", "-v",
                               "-std=c++17", "-o", str(Path(tmp) / "k.cubin"), str(cu)], capture_output=True, text=True)
    if done.returncode:
        return "FAILED\n" + done.stderr[-4000:]
    return " ".join(re.findall(r"(Used \d+ registers.*|\d+ bytes stack frame.*)", done.stderr))


def compile_all() -> None:
    if not shutil.which("nvcc"):
        sys.exit("no nvcc")
    for Dh in rd.SUPPORTED_HEAD_DIMS:
        for NR in (1, 2, 4, 8):
            for QT, KT in (("bfloat16", "float16"), ("bfloat16", "bfloat16")):
                for final in (0, 1):
                    print(f"QT={QT} KT={KT} D={Dh} NR={NR} FINAL={final}: {compile_report(QT, KT, Dh, NR, final)}",
                          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/kernel-ragged-decode.json")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--kv-dtypes", default="float16")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, 2 calls, 1 rep (the CPU check)")
    ap.add_argument("--compile", action="store_true", help="only print nvcc's register report per template")
    args = ap.parse_args()
    if args.compile:
        compile_all()
        return
    shapes, calls, reps = (SMOKE_SHAPES, 2, 1) if args.smoke else (SHAPES, CALLS, args.reps)
    variants = {k: VARIANTS[k] for k in args.variants.split(",")}
    kernel = hasattr(mx, "cuda") and mx.cuda.is_available()
    if not kernel:
        print("no CUDA device: the kernel is skipped (SDPA and the reference only)", flush=True)
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"device": str(mx.default_device()), "mlx": mx.__version__,
           "ragged_decode_path": KERNELS.ragged_decode_path(),
           "git": git, "heads": [NQ, H], "head_dim": D, "q_dtype": str(Q_DTYPE), "calls_per_eval": calls,
           "smoke": args.smoke, "policy": {"num_sms": planning_sms(), "resident_blocks": rd.RESIDENT_BLOCKS,
                                           "target_waves": rd.TARGET_WAVES, "min_split": rd.MIN_SPLIT,
                                           "split_align": rd.SPLIT_ALIGN}, "rows": []}
    for kv_name in args.kv_dtypes.split(","):
        for shape in shapes:
            r = run_shape(shape, DTYPES[kv_name], reps, calls, variants, kernel)
            out["rows"].append(r)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(out, indent=1))
            print(f"{kv_name:8s} {r['name']:22s} sdpa {r['sdpa_ms']:.4f} ms ({r['sdpa_GBps']:.0f} GB/s)  "
                  f"ref {r['reference_ms']:.3f} ms  " + "  ".join(
                      f"{k} {v['ms']:.4f} ({v['GBps']:.0f} GB/s, {v['vs_sdpa']:.2f}x, err {v['err_vs_reference']:.1e}, "
                      f"{v['items']} items)" for k, v in r["variants"].items()), flush=True)
    if not kernel:
        return
    print("\n| K/V | B x T | kernel ms | GB/s | of 4.2 TB/s | SDPA ms | vs SDPA | reference ms | best plan (ms) "
          "| max err |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in out["rows"]:
        v = r["variants"][next(iter(variants))]
        best = min(r["variants"].items(), key=lambda kv: kv[1]["ms"])
        err = max(x["err_vs_reference"] for x in r["variants"].values())
        print(f"| {r['kv_dtype'].split('.')[-1]} | {r['name']} | {v['ms']:.4f} | {v['GBps']:.0f} | "
              f"{v['frac_of_4.2TBps']:.2f} | {r['sdpa_ms']:.4f} | {v['vs_sdpa']:.2f}x | {r['reference_ms']:.3f} | "
              f"{best[0]} ({best[1]['ms']:.4f}) | {err:.1e} |")


if __name__ == "__main__":
    main()
