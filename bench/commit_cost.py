"""Cost of committing one KVarN tile (quantizing K and V of G tokens) per layer, by layout.

Run from the repo root: ``python3 bench/commit_cost.py`` (OpenBLAS is not needed: no matmuls).
Shapes follow the bundled model: 2 KV heads, head_dim 128.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import mlx.core as mx  # noqa: E402

from kvarn.layout import KVLayout  # noqa: E402
from kvarn.record import quantize_tiles  # noqa: E402


def time_commit(layout: KVLayout, num_tiles: int, repeats: int = 20) -> float:
    keys = mx.random.normal((1, 2, num_tiles, layout.tile_size, 128)).astype(mx.float16)
    values = mx.random.normal((1, 2, num_tiles, layout.tile_size, 128)).astype(mx.float16)
    mx.eval(keys, values)
    mx.eval(vars(quantize_tiles(keys, values, layout)))
    start = time.perf_counter()
    for _ in range(repeats):
        mx.eval(vars(quantize_tiles(keys, values, layout)))
    return (time.perf_counter() - start) / repeats


print(f"device {mx.default_device()}; one layer, 2 KV heads, head_dim 128\n")
print("| layout | 1 tile (decode commit) | 16 tiles at once (prefill), per tile |")
print("|---|---|---|")
for preset in ("k4v2", "k4v4", "k8v8", "k3v3", "k2v2"):
    for tile in (128, 64):
        layout = KVLayout.kvarn(preset, tile_size=tile)
        one = time_commit(layout, 1)
        many = time_commit(layout, 16, repeats=5) / 16
        print(f"| {layout.name} | {one * 1e3:.2f} ms | {many * 1e3:.2f} ms |")
