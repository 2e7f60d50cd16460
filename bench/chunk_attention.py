"""One layer of KVarN prompt-chunk attention on the GPU: the masked single call of
``kvarn.attention.chunk_attention_over`` against the tile-by-tile version it replaced.

    PYTHONPATH=. python3 bench/chunk_attention.py --out $OUT/chunk-attention.json

Shape: 32 query / 8 KV heads, D = 128, G = 128, queries in bfloat16 (the 8B shape), history in
float16 (the sink, the dequantized records, the chunk's float16 window), as
``kvarn.paged.PagedLayer.attend`` hands them over. Each case is a chunk of C tokens starting
at position ``start`` (the records then cover every full tile before the chunk's end). Timing: 32
calls queued per ``mx.eval`` (one a layer, as a prompt chunk of a 32-layer model), on 4 copies of
the data in turn, median of 7 repetitions after a warm-up; ``build_ms`` is the Python time to
queue the 32 calls (graph building, no evaluation). Both outputs are compared (max |difference|).

The tile-by-tile version (``tiles_attention`` below, a copy of the code that ran until this
script was written) attends one tile at a time with MLX's causal mask: it joins the history
once a tile, so its copies grow with the square of the prompt's length.
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

from kvarn.attention import Chunk, chunk_attention_over  # noqa: E402
from kvarn.quantize import rotate  # noqa: E402

G = 128


def tiles_attention(queries, sink_k, sink_v, rec_k, rec_v, chunk, G, scale):  # noqa: ANN001, N803
    """The previous ``chunk_attention_over``: one fused causal SDPA per tile of the chunk."""
    dtype = sink_k.dtype
    start, end = chunk.start, chunk.start + queries.shape[2]
    q = rotate(queries.astype(mx.float32)).astype(queries.dtype)
    pieces = []

    def attend(lo, hi, keys, values, mask):  # noqa: ANN001
        pieces.append(mx.fast.scaled_dot_product_attention(q[:, :, lo - start: hi - start], keys.astype(q.dtype),
                                                           values.astype(q.dtype), scale=scale, mask=mask))

    p = start
    while p < end:
        t = p // G
        if t == 0:
            hi = min(G, end)
            attend(p, hi, sink_k[..., :hi, :], sink_v[..., :hi, :], "causal" if hi - p > 1 else None)
            p = hi
            continue
        last = (t + 1) * G - 1
        hi = min(last, end)
        if p < hi:
            w0, w1 = t * G - chunk.window_start, hi - chunk.window_start
            parts_k, parts_v = [sink_k], [sink_v]
            if t > 1:
                parts_k.append(rec_k[..., : (t - 1) * G, :])
                parts_v.append(rec_v[..., : (t - 1) * G, :])
            parts_k.append(chunk.window_k[..., w0: w1, :].astype(dtype))
            parts_v.append(chunk.window_v[..., w0: w1, :].astype(dtype))
            attend(p, hi, mx.concatenate(parts_k, axis=2), mx.concatenate(parts_v, axis=2),
                   "causal" if hi - p > 1 else None)
        if hi == last and last < end:
            keys = mx.concatenate([sink_k, rec_k[..., : t * G, :]], axis=2)
            values = mx.concatenate([sink_v, rec_v[..., : t * G, :]], axis=2)
            attend(last, last + 1, keys, values, None)
            hi = last + 1
        p = hi
    out = pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=2)
    return rotate(out.astype(mx.float32)).astype(queries.dtype)


def case_inputs(start: int, C: int, seed: int, qdtype: mx.Dtype = mx.bfloat16) -> tuple:
    """Queries and history of a chunk [start, start + C) with the first G tokens in the sink."""
    mx.random.seed(seed)
    end = start + C
    Hq, Hk, D = 32, 8, 128
    q = mx.random.normal((1, Hq, C, D)).astype(qdtype)
    sink_len = min(end, G)
    sk, sv = (mx.random.normal((1, Hk, sink_len, D)).astype(mx.float16) for _ in range(2))
    n_rec = max(0, end // G - 1)  # every full tile past the sink is a record once the chunk is in
    rk = rv = None
    if n_rec:
        rk, rv = (mx.random.normal((1, Hk, n_rec * G, D)).astype(mx.float16) for _ in range(2))
    if end <= G:
        chunk = Chunk(start=start)
    else:
        window_start = max(G, (start // G) * G)  # the tail before the chunk starts at a tile
        W = end - window_start
        wk, wv = (mx.random.normal((1, Hk, W, D)).astype(mx.float16) for _ in range(2))
        chunk = Chunk(start=start, window_start=window_start, window_k=wk, window_v=wv)
    arrays = [q, sk, sv] + ([rk, rv] if rk is not None else []) + ([chunk.window_k, chunk.window_v] if chunk.window_k is not None else [])
    mx.eval(*arrays)
    return q, sk, sv, rk, rv, chunk


def timed(fn, copies: list[tuple], layers: int, reps: int = 7) -> tuple[float, float]:  # noqa: ANN001
    """(median ms for ``layers`` queued calls, median Python build ms)."""
    def once() -> tuple[float, float]:
        t0 = time.perf_counter()
        outs = [fn(*copies[i % len(copies)], G, 0.088) for i in range(layers)]
        t1 = time.perf_counter()
        mx.eval(*outs)
        return (time.perf_counter() - t0) * 1e3, (t1 - t0) * 1e3
    once()
    runs = [once() for _ in range(reps)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default="0:512,3584:512,8192:512,15872:512,0:2048,2048:2048,14336:2048,0:4096")
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--layers", type=int, default=32, help="calls queued per evaluation")
    ap.add_argument("--dtype", default="bfloat16", help="query dtype (float32 for a CPU smoke run)")
    args = ap.parse_args()
    qdtype = getattr(mx, args.dtype)
    rows = []
    for spec in args.cases.split(","):
        start, C = map(int, spec.split(":"))
        copies = [case_inputs(start, C, seed, qdtype) for seed in range(args.copies)]
        a = chunk_attention_over(*copies[0], G, 0.088)
        b = tiles_attention(*copies[0], G, 0.088)
        err = mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item()
        masked_ms, masked_build = timed(chunk_attention_over, copies, args.layers)
        tiles_ms, tiles_build = timed(tiles_attention, copies, args.layers)
        row = {"start": start, "chunk": C, "masked_ms": masked_ms, "masked_build_ms": masked_build,
               "tiles_ms": tiles_ms, "tiles_build_ms": tiles_build, "tiles_over_masked": tiles_ms / masked_ms,
               "max_abs_diff": err}
        row["layers"] = args.layers
        rows.append(row)
        print(json.dumps(row), flush=True)
        Path(args.out).write_text(json.dumps({"device": str(mx.default_device()), "rows": rows}, indent=1) + "\n")
        del copies
        mx.clear_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
