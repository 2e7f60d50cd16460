"""Prefix cache on a GPU, through the engine (no HTTP): time to first token of a ~3.5k-token
prompt cold, restored from the memory tier, and restored from disk by a fresh engine (a
restart), per KV layout; plus greedy agreement of restored runs with runs without the cache.

    python bench/device_apc.py --out bench/results/device-apc-h200.json

Run on a GPU with MLX's CUDA backend (`bash bench/device.sh apc`); on a CPU it runs too.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.engine import make_engine  # noqa: E402
from engine.kv_config import ApcConfig, KVConfig  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.request import Request, RequestId, SamplingParams  # noqa: E402
from engine.scheduler import SchedulerConfig  # noqa: E402

ARMS = {"kvarn-k4v2": KVConfig("kvarn", 4, 2), "fp16": KVConfig("fp16"), "affine-4": KVConfig("affine", 4, 4)}
CONFIG = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, prefill_chunk_size=512, kv_budget_bytes=2**31)


class DiskHitParts:
    """Where a disk hit's time goes: the reader thread's ``DiskTier.get_many`` (files read and
    verified) and the engine thread's ``PoolTier.load`` (blocks into the pool)."""

    def __init__(self, profile: bool = False, eval_load: bool = False) -> None:
        self.profile = profile
        self.eval_load = eval_load  # evaluate the pool right after a load: its device work timed apart
        self.profiles: dict[str, str] = {}  # slot -> the top functions of its cProfile (``--profile``)

    def __enter__(self):
        from apc.disk_tier import DiskTier
        from apc.pool_tier import PoolTier

        self.seconds = {"read_verify": 0.0, "load_into_pool": 0.0}
        self._saved = [(DiskTier, "get_many", DiskTier.get_many), (PoolTier, "load", PoolTier.load)]
        for (cls, name, fn), slot in zip(self._saved, self.seconds):
            setattr(cls, name, self._timed(fn, slot))
        return self

    def _timed(self, fn, slot):
        def wrapper(*args, **kwargs):
            prof = cProfile.Profile() if self.profile else None
            t = time.perf_counter()
            if prof is not None:
                prof.enable()  # in the calling thread (the reader's for get_many)
            try:
                return fn(*args, **kwargs)
            finally:
                if prof is not None:
                    prof.disable()
                self.seconds[slot] += time.perf_counter() - t
                if slot == "load_into_pool" and self.eval_load:  # the load's lazy device work, on its own
                    t = time.perf_counter()
                    mx.eval([a for layer in args[0].pool.layers for a in layer.arrays()])
                    self.seconds["load_eval"] = self.seconds.get("load_eval", 0.0) + time.perf_counter() - t
                if prof is not None:
                    text = io.StringIO()
                    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
                    self.profiles[slot] = text.getvalue()
        return wrapper

    def __exit__(self, *exc):
        for cls, name, fn in self._saved:
            setattr(cls, name, fn)


STEPS: list[float] = []  # the wall seconds of each engine step of the last ``ttft`` call


def ttft(engine, prompt: list[int], max_tokens: int = 1) -> tuple[float, list[int], int]:
    """(seconds to the first token, greedy tokens, cached prompt tokens); each step's wall time in ``STEPS``."""
    rid = RequestId(f"r{time.perf_counter_ns()}")
    request = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    start = time.perf_counter()
    engine.add_request(request)
    first, cached = None, 0
    STEPS.clear()
    while engine.has_work():
        t = time.perf_counter()
        outs = engine.step()
        STEPS.append(time.perf_counter() - t)
        for out in outs:
            if out.request_id == rid and out.token_ids and first is None:
                first = time.perf_counter() - start
            cached = out.num_cached_tokens
    return first, list(request.output_ids), cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=3500)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--out", default=None)
    parser.add_argument("--dtype", default="float16",
                        help="the bundled model's compute dtype (float16: weights dequantized, so no "
                             "quantized_matmul JIT compiles on a fresh GPU machine; native: its 8-bit weights)")
    parser.add_argument("--profile", action="store_true", help="print a cProfile of each disk hit's read and load")
    parser.add_argument("--eval-load", action="store_true",
                        help="evaluate the pool right after each disk hit's load (its device work as load_eval)")
    args = parser.parse_args()
    loaded = load_model(None, args.dtype)
    data = json.loads((Path(__file__).resolve().parents[1] / "engine/data/kld_prompts.json").read_text())
    ids = loaded.tokenizer.encode(" ".join(p["text"] for p in data["prompts"]), add_special_tokens=False)
    prompts = [(ids[k * 300:] + ids)[: args.tokens] for k in range(args.prompts)]  # distinct starts
    results = {"device": str(mx.default_device()), "model": loaded.model_id, "dtype": loaded.compute_dtype,
               "tokens": args.tokens, "arms": {}}
    for name in args.arms.split(","):
        kv = ARMS[name]
        with tempfile.TemporaryDirectory() as folder:
            off = make_engine(loaded, CONFIG, kv, ApcConfig(enabled=False))
            ttft(off, ids[:64], 2)  # warm-up (kernels compile on first use)
            for p in prompts[:1]:
                ttft(off, p, 1)
            want = [ttft(off, p, 24)[1] for p in prompts]
            engine = make_engine(loaded, CONFIG, kv, ApcConfig(disk_dir=folder, memory_bytes=2**30))
            ttft(engine, ids[-64:], 2)
            cold = [ttft(engine, p)[0] for p in prompts]
            memory, memory_steps = [], []
            agree = 0
            for p, w in zip(prompts, want):
                for _ in range(args.repeats):
                    memory.append(ttft(engine, p)[0])
                    memory_steps.append([round(1e3 * t, 2) for t in STEPS])
                got, cached = ttft(engine, p, 24)[1:]
                agree += got == w
            engine.close()
            restarted = make_engine(loaded, CONFIG, kv, ApcConfig(disk_dir=folder, memory_bytes=2**30))
            ttft(restarted, ids[-64:], 2)
            disk, disk_cached, parts, disk_steps, after = [], [], [], [], []
            for p in prompts:
                with DiskHitParts(args.profile, args.eval_load) as split:
                    t, _, c = ttft(restarted, p)
                disk_steps.append([round(1e3 * t, 2) for t in STEPS])
                after.append(round(1e3 * ttft(restarted, p)[0], 2))  # the same prompt again: now a memory hit
                disk.append(t)
                disk_cached.append(c)
                parts.append(split.seconds)
                for slot, text in split.profiles.items():
                    print(f"--- {name} disk hit, {slot} (cProfile, by own time)\n{text}", flush=True)
            restarted.close()
        row = {"cold_ms": 1e3 * statistics.median(cold), "memory_hit_ms": 1e3 * statistics.median(memory),
               "disk_hit_ms": 1e3 * statistics.median(disk), "cached_tokens": cached, "disk_cached_tokens": disk_cached,
               "greedy_equal_after_restore": f"{agree}/{len(prompts)}",
               "disk_hit_parts_ms": [{k: 1e3 * v for k, v in p.items()} for p in parts],
               "memory_hit_steps_ms": memory_steps, "disk_hit_steps_ms": disk_steps,
               "memory_hit_after_restart_ms": after}
        row["memory_speedup"] = row["cold_ms"] / row["memory_hit_ms"]
        row["disk_speedup"] = row["cold_ms"] / row["disk_hit_ms"]
        results["arms"][name] = row
        print(name, json.dumps(row), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
