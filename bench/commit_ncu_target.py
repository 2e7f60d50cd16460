"""The decode commit of 32 rows of one layer (8 KV heads, D = G = 128, k4v2: the 8B shape), launched
a few times: a target for Nsight Compute (``ncu --kernel-name regex:commit``) on a CUDA GPU. An
argument 0 launches the kernel with IEEE divisions (``reciprocal=False``), 1 (the default) with
reciprocal ones.

    ncu --clock-control none --kernel-name regex:commit --launch-skip 2 --launch-count 1 \\
        python3 bench/commit_ncu_target.py [1|0]
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metal.cuda import commit as C  # noqa: E402


def main() -> None:
    n, H, G, D = 32, 8, 128, 128
    reciprocal = bool(int(sys.argv[1])) if len(sys.argv) > 1 else True
    k1, k2 = mx.random.split(mx.random.key(3))
    win_k = (mx.random.normal((n + 4, H, 2 * G, D), key=k1) * mx.linspace(0.2, 3.0, D)).astype(mx.float16)
    win_v = mx.random.normal((n + 4, H, 2 * G, D), key=k2).astype(mx.float16)
    slots = mx.arange(2, n + 2, dtype=mx.int32)
    mx.eval(win_k, win_v, slots)
    for _ in range(4):
        mx.eval(list(C.quantize_window_tails(win_k=win_k, win_v=win_v, slots=slots, key_bits=4, value_bits=2,
                                             iters=8, reciprocal=reciprocal).values()))
    mx.synchronize()


if __name__ == "__main__":
    main()
