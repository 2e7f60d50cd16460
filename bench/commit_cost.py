"""Cost of committing KVarN tiles (quantizing K and V of G tokens) per layer.

CPU mode (default; shapes of the bundled model: 2 KV heads, head_dim 128), from the repo root:
``python3 bench/commit_cost.py`` (OpenBLAS is not needed: no matmuls).

Device mode (a CUDA GPU; the issue-11 shape: one layer of the 8B model, 8 KV heads, D = G = 128,
k4v2): ``python3 bench/commit_cost.py --device [--out FILE.json]``. Times the fused commit kernel
(metal/cuda/commit.py, 8 and 4 rows a thread) against ``kvarn.pool.quantize_blocks`` (the mx.compile'd
pure-MLX quantizer) for 32 tiles (every row of a 32-row batch commits) and 1, counts how many code
words and factors of the kernel differ from the reference's on the same tiles, and reports the
first calls (MLX's JIT compiles: tens of seconds on a fresh machine) apart. Timing: ``n`` calls queued, one mx.eval,
mx.synchronize; median over ``reps`` (after warm-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from kvarn.layout import KVLayout  # noqa: E402


def time_commit(layout: KVLayout, num_tiles: int, repeats: int = 20) -> float:
    from kvarn.pool import quantize_blocks
    keys = mx.random.normal((num_tiles, 2, layout.tile_size, 128)).astype(mx.float16)
    values = mx.random.normal((num_tiles, 2, layout.tile_size, 128)).astype(mx.float16)
    mx.eval(keys, values)
    mx.eval(quantize_blocks(keys, values, layout))
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(quantize_blocks(keys, values, layout))
    return (time.perf_counter() - start) / repeats


def cpu_table() -> None:
    print(f"device {mx.default_device()}; one layer, 2 KV heads, head_dim 128\n")
    print("| layout | 1 tile (decode commit) | 16 tiles at once (prefill), per tile |")
    print("|---|---|---|")
    for preset in ("k4v2", "k4v4", "k8v8", "k3v3", "k2v2"):
        for tile in (128, 64):
            layout = KVLayout.kvarn(preset, tile_size=tile)
            one = time_commit(layout, 1)
            many = time_commit(layout, 16, repeats=5) / 16
            print(f"| {layout.name} | {one * 1e3:.2f} ms | {many * 1e3:.2f} ms |")


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


def device_table(out_path: str | None) -> None:
    import numpy as np

    from kvarn.pool import quantize_blocks_reference as quantize_blocks  # the pure-MLX quantizer, never the kernel
    from metal import KERNELS
    from metal.cuda import commit as C
    H, D, G, kb, vb = 8, 128, 128, 4, 2
    layout = KVLayout.kvarn("k4v2")
    say = lambda *a: print(*a, flush=True)  # noqa: E731 - a run cut short keeps what it printed
    say(f"device {mx.default_device()}; one layer, {H} KV heads, D = G = {D}, k4v2")
    say("| tiles | quantize_blocks | kernel (8 rows/thread) | kernel (4 rows/thread) | kernel (4 rows, IEEE "
        "divisions) | ratio (best kernel) | code words differing | factors differing | same bytes as IEEE "
        "divisions | first calls (JIT): reference, kernel |")
    say("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    for n in (32, 1):
        k1, k2 = mx.random.split(mx.random.key(n))
        keys = (mx.random.normal((n, H, G, D), key=k1) * mx.linspace(0.2, 3.0, D)).astype(mx.float16)
        values = mx.random.normal((n, H, G, D), key=k2).astype(mx.float16)
        mx.eval(keys, values)
        t0 = time.perf_counter()
        ref = quantize_blocks(keys, values, layout)
        mx.eval(list(ref.values()))
        t1 = time.perf_counter()
        got = C.quantize_tiles(keys=keys, values=values, key_bits=kb, value_bits=vb, iters=layout.iters)
        mx.eval(list(got.values()))
        t2 = time.perf_counter()
        codes = sum(int((np.array(got[f]) != np.array(ref[f])).sum()) for f in ("k_codes", "v_codes"))
        factors = sum(int((np.array(got[f]) != np.array(ref[f])).sum()) for f in got if not f.endswith("codes"))
        t_ref = timed(lambda: list(quantize_blocks(keys, values, layout).values()), 5, 7)
        t_k = {}
        for r, mk in ((8, 1), (4, 1), (4, 0)):
            try:
                t_k[(r, mk)] = timed(lambda: list(C.quantize_tiles(keys=keys, values=values, key_bits=kb,
                                                                   value_bits=vb, iters=layout.iters, rows=r,
                                                                   reciprocal=bool(mk)).values()), 20, 7)
            except Exception as exc:  # noqa: BLE001 - a launch failure of one variant is a result too
                say(f"rows={r} mk={mk}: {exc}")
                t_k[(r, mk)] = float("nan")
        old = C.quantize_tiles(keys=keys, values=values, key_bits=kb, value_bits=vb, iters=layout.iters,
                               reciprocal=False)
        same_as_ieee = all(bool(mx.array_equal(old[f], got[f]).item()) for f in got)
        best = min(v for v in t_k.values() if v == v)
        say(f"| {n} | {t_ref * 1e3:.3f} ms | {t_k[(8, 1)] * 1e3:.3f} ms | {t_k[(4, 1)] * 1e3:.3f} ms | "
            f"{t_k[(4, 0)] * 1e3:.3f} ms | {t_ref / best:.1f}x | {codes} | {factors} | {same_as_ieee} | "
            f"{t1 - t0:.1f} s, {t2 - t1:.1f} s |")
        rows.append({"tiles": n, "reference_ms": t_ref * 1e3, "kernel_rows8_ms": t_k[(8, 1)] * 1e3,
                     "kernel_rows4_ms": t_k[(4, 1)] * 1e3, "kernel_rows4_ieee_div_ms": t_k[(4, 0)] * 1e3,
                     "bytes_equal_to_ieee_div": same_as_ieee, "speedup": t_ref / best, "code_words_differing": codes,
                     "factors_differing": factors, "first_call_reference_s": t1 - t0, "first_call_kernel_s": t2 - t1})

    def reference(*, keys, values, key_bits, value_bits, iters):
        return quantize_blocks(keys, values, KVLayout(scheme="kvarn", key_bits=key_bits, value_bits=value_bits,
                                                      tile_size=keys.shape[2], iters=iters))

    verdict = KERNELS.commit_path(reference=reference, head_dim=D, tile_size=G, key_bits=kb, value_bits=vb,
                          iters=layout.iters)
    say(f"commit_path: {verdict}")
    if out_path:
        Path(out_path).write_text(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__,
                                              "commit_path": verdict, "H": H, "D": D, "G": G, "layout": "k4v2",
                                              "rows": rows}, indent=2))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", action="store_true", help="time the fused kernel against quantize_blocks (CUDA)")
    ap.add_argument("--out", help="device mode: write the results as JSON here")
    args = ap.parse_args()
    if args.device:
        device_table(args.out)
    else:
        cpu_table()
