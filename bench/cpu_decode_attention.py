"""One layer's decode attention on the CPU at depth: KVarN k4v2 (``kvarn.attention.decode_attention_over``
over the pool's records and windows, as the compiled decode step calls it) against fp16 slots (float32 slots
under one validity mask through ``kvarn.cpu_attention.attention``, as the seam attends them on the CPU).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 flock /tmp/kvarn-bench.lock \
        python3 bench/cpu_decode_attention.py --json-out bench/results/cpu-decode-attention.json

The bundled model's shape: 4 query / 2 KV heads, head_dim 128, tiles of 128. Each case is B rows
of T tokens (KVarN: a sink, (T - 128) // 128 records, the rest in the tail; 16 x 190, a short
chat's rows, has no records yet; the block table
padded to a multiple of 8 blocks, fp16: slots of T rounded up to 256 tokens, as the compiled
steps pad them). Arms: ``kvarn`` (the CPU's kernel, ``metal/cpu``: the records' codes read in
place), ``kvarn-mlx`` (the pure-MLX path where no kernel runs: the codes unpacked to float32 for
OpenBLAS products) and ``fp16`` (whose softmax's exp is the CPU kernel's too). Every arm is
compiled (``mx.compile``, as the decode step is) and has ``--layers`` copies of its arrays (a
step's layers: each its own memory, as in a model); one timing = one call a copy queued, one
``mx.eval``, divided by ``--layers``. The arms alternate; medians of ``--rounds`` rounds of
``--reps``. The engine's CPU buffer cache (1 GiB, ``engine.memory.keep_cpu_buffers``) is set
first. Both KVarN arms are compared with the dequantized reference path on the same records
(max |difference|).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.memory import keep_cpu_buffers  # noqa: E402
from kvarn import attention, cpu_attention  # noqa: E402
from kvarn.layout import KVLayout  # noqa: E402
from kvarn.pool import RECORD_FIELDS, LayerArrays, quantize_blocks  # noqa: E402

N_Q, H, D, G = 4, 2, 128, 128
SCALE = D ** -0.5
LAYOUT = KVLayout.kvarn("k4v2")
CASES = ((1, 3000), (16, 190), (16, 1024), (16, 2000), (64, 1000), (64, 2000))
TABLE_STEP = 8
DISTINCT_TILES = 64


def kvarn_case(B: int, T: int, seed: int = 0) -> list[mx.array]:
    """One layer's KVarN inputs: queries, windows [B + 1, H, 2G, D] (window 0 the pool's pad),
    block table, validity mask, then the record fields (``DISTINCT_TILES`` random rotated tiles
    quantized, repeated over the pool's blocks)."""
    mx.random.seed(seed)
    nb = max(0, T - G) // G
    nbp = -(-nb // TABLE_STEP) * TABLE_STEP
    num_blocks = 1 + B * nb
    tiles = quantize_blocks(mx.random.normal((DISTINCT_TILES, H, G, D)).astype(mx.float16),
                            mx.random.normal((DISTINCT_TILES, H, G, D)).astype(mx.float16), LAYOUT)
    copies = -(-num_blocks // DISTINCT_TILES)
    records = [mx.concatenate([tiles[name]] * copies)[:num_blocks] for name in RECORD_FIELDS]
    ids = mx.arange(1, num_blocks, dtype=mx.int32).reshape(B, nb)
    table = mx.concatenate([ids, mx.zeros((B, nbp - nb), mx.int32)], axis=1)
    cols = mx.arange(2 * G + nbp * G)
    valid = (cols < T - nb * G) | ((cols >= 2 * G) & (cols < 2 * G + nb * G))
    mask = mx.broadcast_to(valid, (B, 2 * G + nbp * G)).reshape(B, 1, 1, -1)
    arrays = [mx.random.normal((B, N_Q, 1, D)), mx.random.normal((B + 1, H, 2 * G, D)),
              mx.random.normal((B + 1, H, 2 * G, D)), table, mask, *records]
    mx.eval(arrays)
    return arrays


def kvarn_attention(queries, win_k, win_v, table, mask, *fields):  # noqa: ANN001
    """``decode_attention_over`` as the compiled step calls it (windows 1 .. B read as a slice)."""
    a = LayerArrays(records=dict(zip(RECORD_FIELDS, fields)), win_k=win_k, win_v=win_v)
    B = queries.shape[0]
    return attention.decode_attention_over(queries, a, LAYOUT, SCALE, windows=(1, B + 1), win_len=2 * G,
                                           table=table if table.shape[1] else None, mask=mask)


def kvarn_mlx_attention(*arrays):  # noqa: ANN002
    """``kvarn_attention`` without the CPU's kernel (traced with it off): the pure-MLX path."""
    with mock.patch.object(attention, "_native", lambda layout, a, head_dim: None):
        return kvarn_attention(*arrays)


def reference_attention(queries, win_k, win_v, table, mask, *fields):  # noqa: ANN001
    """The dequantized reference path on the same inputs."""
    a = LayerArrays(records=dict(zip(RECORD_FIELDS, fields)), win_k=win_k, win_v=win_v)
    index = attention.Attended((1, queries.shape[0] + 1), 2 * G, table if table.shape[1] else None, mask)
    return attention._dequantized_attention(queries, a, index, LAYOUT, SCALE)


def fp16_case(B: int, T: int, seed: int = 0) -> list[mx.array]:
    """One layer's fp16 inputs: queries, float32 slots [B, H, Tb, D] (Tb: T rounded up to 256),
    the validity mask [B, 1, 1, Tb]."""
    mx.random.seed(seed)
    Tb = -(-T // 256) * 256
    mask = mx.broadcast_to(mx.arange(Tb) < T, (B, Tb)).reshape(B, 1, 1, Tb)
    arrays = [mx.random.normal((B, N_Q, 1, D)), mx.random.normal((B, H, Tb, D)), mx.random.normal((B, H, Tb, D)),
              mask]
    mx.eval(arrays)
    return arrays


def fp16_attention(queries, keys, values, mask):  # noqa: ANN001
    """The slots' attention as the seam runs it on the CPU (``kvarn.cpu_attention.attention``)."""
    return cpu_attention.attention(queries, keys, values, SCALE, mask)


def time_arm(fn, layers: list[list[mx.array]], reps: int) -> float:
    """Median ms a layer: one call a layer's arrays queued, one evaluation."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval([fn(*arrays) for arrays in layers])
        times.append((time.perf_counter() - t0) / len(layers) * 1e3)
    return statistics.median(times)


def run_case(B: int, T: int, args: argparse.Namespace) -> dict:
    kv = [kvarn_case(B, T, seed=i) for i in range(args.layers)]
    arms = {"kvarn": (mx.compile(kvarn_attention), kv), "kvarn-mlx": (mx.compile(kvarn_mlx_attention), kv),
            "fp16": (mx.compile(fp16_attention), [fp16_case(B, T, seed=i) for i in range(args.layers)])}
    want = reference_attention(*kv[0])
    row: dict = {"rows": B, "tokens": T, "records_per_row": max(0, T - G) // G}
    for name in ("kvarn", "kvarn-mlx"):
        row[f"{name}_max_abs_diff"] = mx.max(mx.abs(arms[name][0](*kv[0]) - want)).item()
    for fn, layers in arms.values():
        mx.eval(fn(*layers[0]))  # trace and warm
    rounds: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, (fn, layers) in arms.items():
            rounds[name].append(time_arm(fn, layers, args.reps))
    row.update({f"{name}_ms": statistics.median(v) for name, v in rounds.items()})
    row["kvarn_over_fp16"] = row["kvarn_ms"] / row["fp16_ms"]
    row["kvarn_over_mlx"] = row["kvarn_ms"] / row["kvarn-mlx_ms"]
    row["rounds_ms"] = rounds
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(f"{b}x{t}" for b, t in CASES), help="BxT,...")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)
    keep_cpu_buffers()
    results = []
    for case in args.cases.split(","):
        B, T = (int(x) for x in case.split("x"))
        row = run_case(B, T, args)
        results.append(row)
        print(f"{B:>3} x {T:>5}: kvarn {row['kvarn_ms']:7.2f}  kvarn-mlx {row['kvarn-mlx_ms']:7.2f}  fp16 "
              f"{row['fp16_ms']:7.2f} ms  kvarn/fp16 {row['kvarn_over_fp16']:.2f}  kvarn/mlx {row['kvarn_over_mlx']:.2f}"
              f"  |diff| {row['kvarn_max_abs_diff']:.1e} / {row['kvarn-mlx_max_abs_diff']:.1e}", flush=True)
        if args.json_out:
            args.json_out.write_text(json.dumps({"layers": args.layers, "rounds": args.rounds, "reps": args.reps,
                                                 "cases": results}, indent=1))


if __name__ == "__main__":
    main()
