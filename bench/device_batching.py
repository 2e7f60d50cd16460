"""Continuous batching on a GPU (MLX CUDA or Metal): a parity smoke test and the concurrency
benchmark for fp16, affine-4 and KVarN k4v2, side by side in one run.

Parity: 8 greedy requests with staggered arrivals and ragged prompts, alone vs batched; reports
how many tokens agree and the max |log-prob difference| of the sampled tokens (the engine's
logprobs) before any divergence. Throughput: ``kvarn bench --concurrency`` in-process.

    PYTHONPATH=. python3 bench/device_batching.py --out OUT_DIR [--dtype float16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.bench import run_concurrency_bench  # noqa: E402
from engine.engine import make_engine  # noqa: E402
from engine.kv_config import ApcConfig, KVConfig  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.request import Request, RequestId, SamplingParams  # noqa: E402
from engine.scheduler import SchedulerConfig  # noqa: E402

ARMS = {"fp16": KVConfig("fp16"), "affine-4": KVConfig("affine", 4, 4), "kvarn-k4v2": KVConfig("kvarn", 4, 2)}
ARRIVALS = [(12, 40, 0), (300, 30, 0), (129, 48, 1), (5, 60, 2), (700, 20, 3), (64, 36, 5), (257, 28, 8), (1000, 12, 13)]


def parity(loaded, kv: KVConfig) -> dict:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(16, loaded.vocab_size, n).tolist() for n, _, _ in ARRIVALS]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=True) for _, m, _ in ARRIVALS]
    engine = make_engine(loaded, SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=160, prefill_chunk_size=128),
                         kv, ApcConfig(enabled=False))
    alone = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
        r = Request(RequestId(f"a{i}"), p, sp)
        lps = []
        engine.add_request(r)
        while engine.has_work():
            lps += [lp.logprob for o in engine.step() for lp in o.logprobs]
        alone.append((list(r.output_ids), lps))
    batched = [Request(RequestId(f"b{i}"), p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    logprobs: dict[str, list[float]] = {r.request_id: [] for r in batched}
    step, pending = 0, sorted(zip([a for _, _, a in ARRIVALS], batched), key=lambda p: p[0])
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            engine.add_request(pending.pop(0)[1])
        for out in engine.step():
            logprobs[out.request_id] += [lp.logprob for lp in out.logprobs]
        step += 1
    same, total, worst = 0, 0, 0.0
    for (tokens, lps), r in zip(alone, batched):
        k = next((j for j, (a, b) in enumerate(zip(tokens, r.output_ids)) if a != b), len(tokens))
        same += k
        total += len(tokens)
        if k:
            worst = max(worst, float(np.max(np.abs(np.array(lps[:k]) - np.array(logprobs[r.request_id][:k])))))
    return {"tokens_identical_before_divergence": same, "tokens": total, "max_logprob_diff": worst}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--levels", default="1,16,64")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print("device:", mx.default_device(), flush=True)
    loaded = load_model(None, args.dtype)
    levels = tuple(int(x) for x in args.levels.split(","))
    report = {"device": str(mx.default_device()), "compute_dtype": loaded.compute_dtype, "arms": {}}
    for name, kv in ARMS.items():
        entry = {"parity": parity(loaded, kv)}
        print(name, "parity", entry["parity"], flush=True)
        bench = run_concurrency_bench(loaded, levels, 128, 64, False, kv)
        entry["concurrency"] = bench.concurrency
        print(bench.to_markdown(), flush=True)
        report["arms"][name] = entry
    (args.out / "device-batching.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
