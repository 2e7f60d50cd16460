"""What one part of the compiled decode step costs on a GPU: the step's median time with that part
changed, side by side with the step as it is (8B shape, random weights, through the engine).

    PYTHONPATH=. python3 bench/step_ablation.py --arms fp16,kvarn-k4v2 --rows 1,32 --depth 4096 \
        --ablations none,single,noattn,nowrite --out $OUT/step-ablation.json

Ablations (each traced afresh after the rows are prefilled normally):

* ``none``: the step as the product runs it;
* ``single``: the fused decode kernels' launch plans with one work item a row (no split, no
  combine), against the product's split plans (``metal/paged_plan.py``, ``metal/cuda/ragged_decode.py``);
* ``noattn``: every layer's attention returns its queries (what the rest of the step costs);
* ``nowrite``: no cache write or commit (what the writes cost).

The last two change the tokens: they time the step, nothing else.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvarn.decode_graph as decode_graph  # noqa: E402
from bench.device_engine import Recorder, arm_config, build_model  # noqa: E402
from engine.bench import _prompt  # noqa: E402
from engine.engine import make_engine  # noqa: E402
from engine.kv_config import ApcConfig  # noqa: E402
from engine.request import Request, RequestId, SamplingParams  # noqa: E402
from engine.scheduler import SchedulerConfig  # noqa: E402

try:  # the fp16 slots' step: beside the slots, or in the decode graph's module
    import kvarn.slot_step as slot_step
except ImportError:
    slot_step = decode_graph
LAYERS = [decode_graph.PagedStepLayer, slot_step.SlotStepLayer]
ORIGINAL = {cls: (cls.update_and_fetch, cls.attend) for cls in LAYERS}
# the split-count policies as the step modules imported them: (module, name) -> function
SPLITS = {(mod, name): getattr(mod, name) for mod in {decode_graph, slot_step}
          for name in ("static_splits", "ragged_splits") if hasattr(mod, name)}


def ablate(name: str) -> None:
    """Put the step's parts back as they are, then change the one ``name`` names."""
    for cls, (update, attend) in ORIGINAL.items():
        cls.update_and_fetch, cls.attend = update, attend
    for (mod, fn_name), fn in SPLITS.items():
        setattr(mod, fn_name, (lambda *a, **k: 1) if name == "single" else fn)
    if name == "noattn":
        for cls in ORIGINAL:
            cls.attend = lambda self, queries, keys, values, **kw: queries
    if name == "nowrite":
        for cls, (update, _) in ORIGINAL.items():
            def skip(self, keys, values, _update=update):
                if hasattr(self, "buffers"):  # slots: the views attention reads, unwritten
                    view = [buf[self.lo: self.lo + self.Bp, :, : self.Tb] for buf in self.buffers]
                    return view[0], view[1]
                return None, None
            cls.update_and_fetch = skip


def step_ms(loaded, arm: str, rows: int, depth: int, ablation: str, steps: int) -> float:
    cfg = SchedulerConfig(max_num_seqs=rows, max_num_batched_tokens=rows * 512 + rows, prefill_chunk_size=512,
                          kv_budget_bytes=int(200e9))
    engine = make_engine(loaded, cfg, arm_config(arm), ApcConfig(enabled=False))
    rng = random.Random(1)
    reqs = [Request(RequestId(f"{arm}-{rows}-{ablation}-{i}"), _prompt(rng, depth + 5, loaded.vocab_size),
                    SamplingParams(max_tokens=steps + 64, temperature=0.0, ignore_eos=True)) for i in range(rows)]
    ablate("none")
    for r in reqs:
        engine.add_request(r)
    while not all(r.output_ids for r in reqs):
        engine.step()
    ablate(ablation)
    engine.runner.graphs._graphs.clear()  # trace the step again with the change
    for _ in range(6):
        engine.step()
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    ablate("none")
    for r in reqs:
        engine.abort_request(r.request_id)
    engine.step()
    del engine
    gc.collect()
    mx.clear_cache()
    return 1e3 * statistics.median(walls)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default="fp16,kvarn-k4v2")
    p.add_argument("--rows", default="1,32")
    p.add_argument("--depth", type=int, default=4096)
    p.add_argument("--ablations", default="none,single,noattn,nowrite")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    loaded, _ = build_model(args, Recorder())
    results = []
    for arm in args.arms.split(","):
        for rows in [int(r) for r in args.rows.split(",")]:
            for ablation in args.ablations.split(","):
                ms = step_ms(loaded, arm, rows, args.depth, ablation, args.steps)
                results.append({"arm": arm, "rows": rows, "depth": args.depth, "ablation": ablation, "step_ms": ms})
                print(f"{arm} rows={rows} depth={args.depth} {ablation}: {ms:.2f} ms a step", flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps({"device": str(mx.default_device()), "results": results},
                                                         indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
