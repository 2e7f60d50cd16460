"""Host cost of dispatching the pieces of a decode step's tile commit (on a GPU): for 32
"layers", each piece built, then ``mx.async_eval`` (where MLX walks the graph and launches the
kernels) and the wait timed apart, against a plain elementwise op as the floor.

    PYTHONPATH=. python3 bench/commit_dispatch.py --out $OUT/commit-dispatch.json

Pieces (one tile of 8 heads x 128 x 128 per layer, as a lone row commits): ``quantize`` (the
fused commit kernel, ``metal.cuda.commit.quantize_tiles``), ``gather`` (the tail read out of a window
buffer of 64 windows), ``records`` (the 8 scatters into record arrays of 2,048 blocks),
``decode_kernel`` (``metal.cuda.paged_decode`` on one row of 32 tiles), ``add`` (x + 1 on the tile).
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
from kvarn.pool import RECORD_FIELDS, record_shapes  # noqa: E402
from metal.cuda.commit import quantize_tiles  # noqa: E402

L, H, G, D = 32, 8, 128, 128


def timed(build, reps: int = 7) -> dict[str, float]:
    rows = []
    for _ in range(reps):
        t0 = time.perf_counter()
        outs = build()
        t1 = time.perf_counter()
        mx.async_eval(outs)
        t2 = time.perf_counter()
        mx.eval(outs)
        t3 = time.perf_counter()
        rows.append((t1 - t0, t2 - t1, t3 - t2))
    med = [statistics.median(r[i] for r in rows[1:]) for i in range(3)]
    return {"build_ms": med[0] * 1e3, "async_eval_ms": med[1] * 1e3, "wait_ms": med[2] * 1e3,
            "per_layer_dispatch_us": med[1] / L * 1e6}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    layout = KVLayout.kvarn((4, 2))
    tiles = [mx.random.normal((1, H, G, D)).astype(mx.float16) for _ in range(L)]
    windows = [mx.random.normal((64, H, 2 * G, D)).astype(mx.float16) for _ in range(L)]
    records = [{n: mx.zeros((2048, *shape), dt) for n, (shape, dt) in record_shapes(layout, H, D).items()}
               for _ in range(L)]
    mx.eval(tiles, windows, records)
    cuda = hasattr(mx, "cuda") and mx.cuda.is_available()
    fields = quantize_tiles(keys=tiles[0], values=tiles[0], key_bits=4, value_bits=2) if cuda else \
        {n: mx.zeros((1, *shape), dt) for n, (shape, dt) in record_shapes(layout, H, D).items()}
    mx.eval(fields)
    slot = mx.array([5], dtype=mx.int32)
    ids = mx.array([77], dtype=mx.int32)
    mx.eval(slot, ids)

    def quantize():
        return [v for t in tiles for v in quantize_tiles(keys=t, values=t, key_bits=4, value_bits=2).values()]

    def gather():
        return [w[slot][:, :, G:].astype(mx.float16) for w in windows]

    def write():
        out = []
        for rec in records:
            for n in RECORD_FIELDS:
                rec[n][ids] = fields[n]
                out.append(rec[n])
        return out

    def add():
        return [t + 1 for t in tiles]

    report = {"mlx": mx.__version__, "device": str(mx.default_device()), "layers": L,
              "pieces": {name: timed(fn) for name, fn in
                         (("add", add), ("quantize", quantize), ("gather", gather), ("records", write))
                         if cuda or name != "quantize"}}
    for name, r in report["pieces"].items():
        print(f"{name:10s} build {r['build_ms']:.2f} ms  async_eval {r['async_eval_ms']:.2f} ms "
              f"({r['per_layer_dispatch_us']:.0f} us a layer)  wait {r['wait_ms']:.2f} ms", flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
