"""What the compiled decode step costs a stream when it meets a new shape bucket: one request
decodes from a short prompt across several block-table widths (each new width is a new graph to
trace and compile), with the decode step compiled and built in Python at every step
(``--enforce-eager``), side by side in one process.

    PYTHONPATH=. python3 bench/compile_stalls.py --out $OUT/compile-stalls.json [--tokens 1200]

The model is ``bench/device_engine.py``'s (random-weight mlx-lm Llama, 8B shape by default;
``--layers 2 --hidden 512 --intermediate 1024`` on a CPU). Per arm: the median step, every step
slower than 3x it (the token index and seconds: a trace, a commit step, a kernel built), the
wall time of the whole stream, and the steps' graphs traced.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.device_engine import Recorder, build_model, environment  # noqa: E402
from engine.engine import make_engine  # noqa: E402
from engine.kv_config import ApcConfig, KVConfig  # noqa: E402
from engine.request import Request, RequestId, SamplingParams  # noqa: E402
from engine.scheduler import SchedulerConfig  # noqa: E402


def stream(loaded, compile_decode: bool, prompt: int, tokens: int) -> dict:
    engine = make_engine(loaded, SchedulerConfig(max_num_seqs=4, compile_decode=compile_decode),
                         KVConfig("kvarn", 4, 2), ApcConfig(enabled=False))
    request = Request(RequestId("s"), [(7 * i) % 8000 + 16 for i in range(prompt)],
                      SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    engine.add_request(request)
    steps = []
    start = time.perf_counter()
    while engine.has_work():
        t = time.perf_counter()
        engine.step()
        steps.append((len(request.output_ids), time.perf_counter() - t))
    wall = time.perf_counter() - start
    median = statistics.median(s for _, s in steps)
    graphs = engine.runner.graphs
    return {"compiled": compile_decode, "wall_s": wall, "tokens": len(request.output_ids), "median_step_s": median,
            "slow_steps": [(n, round(s, 4)) for n, s in steps if s > 3 * median], "graphs_traced": graphs.traces,
            "steps_planned": graphs.steps, "steps_uncompiled": graphs.eager}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--prompt", type=int, default=100)
    p.add_argument("--tokens", type=int, default=1200)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    loaded, _ = build_model(args, Recorder())
    report = {"env": environment(), "args": vars(args),
              "arms": [stream(loaded, c, args.prompt, args.tokens) for c in (True, False)]}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    for arm in report["arms"]:
        print(json.dumps(arm))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
