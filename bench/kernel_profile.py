"""Run the fused paged decode kernel a few times on one benchmark shape, for a profiler:

    ncu --clock-control none --kernel-name regex:kvarn_paged_decode --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        python3 bench/kernel_profile.py --rows 16 --tokens 32768
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernel_decode import H, pool_case  # noqa: E402
from metal.cuda.paged_decode import Variant, paged_decode_attention  # noqa: E402
from metal.paged_plan import BLOCKS_PER_SM, make_plan  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--blocks-per-sm", type=int, default=BLOCKS_PER_SM)
    ap.add_argument("--kind", default="auto")
    ap.add_argument("--calls", type=int, default=6)
    args = ap.parse_args()
    kw, _ = pool_case(args.rows, args.tokens)
    L = kw["lengths"]
    plan = make_plan(L.slots, L.sink_len, L.tail_len, L.num_tiles, H, blocks_per_sm=args.blocks_per_sm)
    for _ in range(args.calls):
        mx.eval(paged_decode_attention(**kw, plan=plan, variant=Variant(kind=args.kind)))
    mx.synchronize()


if __name__ == "__main__":
    main()
