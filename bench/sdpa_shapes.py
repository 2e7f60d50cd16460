"""What a shape MLX's fused attention has not seen costs on its first call (CUDA: cuDNN builds an
execution graph per q/k/v/mask shape), causal and with an additive mask (KVarN's prompt-chunk
view), against later calls of the same shape. One layer's call, 32 query / 8 KV heads, D = 128.

    PYTHONPATH=. python3 bench/sdpa_shapes.py --out $OUT/sdpa-shapes.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx

SHAPES = [(2048, 2048), (2048, 4096), (122, 4218), (130, 4226), (512, 3584), (1, 4218)]


def timed(fn) -> float:
    t = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    dtype = getattr(mx, args.dtype)
    rows = []
    for kind in ("causal", "masked"):
        for Q, K in SHAPES:
            q = mx.random.normal((1, 32, Q, 128)).astype(dtype)
            k = mx.random.normal((1, 8, K, 128)).astype(dtype)
            v = mx.random.normal((1, 8, K, 128)).astype(dtype)
            if kind == "causal":
                mask = "causal" if Q > 1 else None
            else:  # the last Q keys causal, every earlier key visible: decode's view of a chunk, as a bias
                qi = mx.arange(K - Q, K)[:, None]
                mask = mx.where(mx.arange(K)[None] <= qi, 0.0, -mx.inf).astype(dtype)
            mx.eval(q, k, v, *([mask] if isinstance(mask, mx.array) else []))

            def call():
                return mx.fast.scaled_dot_product_attention(q, k, v, scale=128 ** -0.5, mask=mask)

            first = timed(call)
            later = sorted(timed(call) for _ in range(5))[2]
            rows.append({"kind": kind, "q": Q, "k": K, "first_ms": 1e3 * first, "later_ms": 1e3 * later})
            print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": str(mx.default_device()), "dtype": args.dtype, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
