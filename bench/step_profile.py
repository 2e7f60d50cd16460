"""Where one engine decode step's time goes (on a GPU, 8B shape): graph build, dispatch, the
rest; and per phase of the KV work, in the step where every row commits a tile against an
ordinary step.

    PYTHONPATH=. python3 bench/step_profile.py --out $OUT/step-profile.json [--arm kvarn-k4v2]

The model is ``bench/device_engine.py``'s (random-weight mlx-lm Llama, 8B shape; ``--layers`` and
friends shrink it: ``--layers 2 --hidden 512 --intermediate 1024 --depth 256 --rows 2`` on a CPU).
``--rows`` prompts of P tokens (P + k a multiple of the tile at decode step k) are prefilled
together, then for each level (``--rows``, then 1) the rows decode across tile boundaries three
times, in three modes:

* ``plain``: each step's wall time split into Python graph build (the model forward),
  ``mx.async_eval`` (MLX walks the graph and launches its kernels: on CUDA the host's launch
  work happens here) and the rest (sampling, the final eval, reading tokens back);
* ``synced`` (an ``-eager`` arm: a compiled step's phases cannot be timed apart): the same steps
  with an ``mx.eval`` after each layer's KV work, timing the phases alone (each timing = its own launches + GPU time + one sync): the window writes, the commit's
  tile gather, the quantizer, the record writes, and the attention. A sync per phase costs
  ~20-50 us itself, so the total is larger than the plain step; what matters is which phase grows
  in the commit step;
* ``profiled``: cProfile of the commit step and of the ordinary step before it (top functions
  by own time).

``--prefill-rounds 2`` prefills a second set of C prompts of the same length after the first
(aborted): its steps meet no shape for the first time (no kernel compile, no new cuDNN graph).
Then ``--commits`` more commit steps per level in plain mode (each with the ordinary step before
it: is a commit slow every time, or only the first time at a batch size?). Every prefill step is
timed too: the prompt chunks' graph build, ``mx.eval`` (a chunk in shared storage is evaluated
before the next is built) and ``mx.async_eval``. ``new_jit_files`` counts files a step added to
MLX's PTX cache (``MLX_PTX_CACHE_DIR``): a kernel compiled in that step.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kvarn.decode_graph as decode_graph  # noqa: E402
import kvarn.pool as pool_mod  # noqa: E402
from bench.device_engine import TILE, Recorder, arm_config, build_model, environment, log  # noqa: E402
from engine.bench import _prompt  # noqa: E402
from engine.engine import make_engine  # noqa: E402
from engine.kv_config import ApcConfig  # noqa: E402
from engine.request import Request, RequestId, SamplingParams  # noqa: E402
from engine.scheduler import SchedulerConfig  # noqa: E402


class Phases:
    """Per-phase seconds of the current step (``synced`` mode): wraps the KV functions so each one
    is evaluated (and timed) on its own."""

    def __init__(self) -> None:
        self.on = False
        self.t: dict[str, float] = {}
        self._orig: list[tuple[Any, str, Any]] = []

    def add(self, name: str, seconds: float) -> None:
        self.t[name] = self.t.get(name, 0.0) + seconds

    def install(self) -> None:
        phases = self

        def timed(name, fn, outputs):
            def wrapper(*args, **kwargs):
                if not phases.on:
                    return fn(*args, **kwargs)
                t = time.perf_counter()
                out = fn(*args, **kwargs)
                mx.eval(outputs(out, args))
                phases.add(name, time.perf_counter() - t)
                return out
            return wrapper

        def patch(obj, attr, wrapper):
            self._orig.append((obj, attr, getattr(obj, attr)))
            setattr(obj, attr, wrapper)

        patch(pool_mod.KVarNPool, "write_records",
              timed("write_records", pool_mod.KVarNPool.write_records,
                    lambda out, args: list(args[0].layers[args[1]].records.values())))
        patch(decode_graph, "quantize_window_tails",
              timed("quantize", decode_graph.quantize_window_tails, lambda out, args: list(out.values())))
        patch(decode_graph.PagedStepLayer, "update_and_fetch",
              timed("update_total", decode_graph.PagedStepLayer.update_and_fetch, lambda out, args: args[0].arrays()))
        patch(decode_graph.PagedStepLayer, "attend",
              timed("attention", decode_graph.PagedStepLayer.attend, lambda out, args: [out]))

    def uninstall(self) -> None:
        for obj, attr, fn in reversed(self._orig):
            setattr(obj, attr, fn)
        self._orig.clear()


def run(args) -> dict:
    recorder = Recorder()
    loaded, weights = build_model(args, recorder)
    kv = arm_config(args.arm)
    C = args.rows
    k_first = 6  # decode step at which the cache length reaches a tile multiple
    P = args.depth + (-(args.depth + k_first)) % TILE
    cfg = SchedulerConfig(max_num_seqs=C, max_num_batched_tokens=C * args.chunk + C, prefill_chunk_size=args.chunk,
                          kv_budget_bytes=int(args.kv_budget_gb * 1e9))
    log(f"{args.arm}: model built")
    engine = make_engine(loaded, cfg, kv, ApcConfig(enabled=False))
    log(f"{args.arm}: engine made")
    warm = None
    if args.warm_up:
        from engine.warm_up import warm_up

        rep = warm_up(engine, rows=args.warm_up)
        warm = rep.as_dict() | {"step_seconds": [round(t, 4) for t in rep.step_seconds]}
        log(f"{args.arm}: warm-up {rep.as_dict()}; slowest steps "
            f"{sorted((round(t, 3) for t in rep.step_seconds), reverse=True)[:6]}")
    rng = random.Random(7)
    # tokens each level decodes at most: three modes (each up to a tile and 6 steps) and the commits; no more,
    # since admission reserves every row's prompt + max_tokens (a larger one keeps rows out for good)
    max_tokens = 2 * (3 * (TILE + 8) + args.commits * (TILE + 2)) + 16
    reqs = [Request(RequestId(f"p{i}"), _prompt(rng, P, loaded.vocab_size),
                    SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)) for i in range(C)]
    # split a step: the model forwards (Recorder), mx.async_eval, mx.eval, the rest
    dispatch = {"s": 0.0, "eval_s": 0.0}
    orig_async, orig_eval = mx.async_eval, mx.eval

    def timed(fn, slot: str):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                dispatch[slot] += time.perf_counter() - t
        return wrapper

    mx.async_eval, mx.eval = timed(orig_async, "s"), timed(orig_eval, "eval_s")
    rounds = []
    for round_ in range(args.prefill_rounds):
        if round_:  # the same shapes again, every compile and cuDNN graph of the first round made
            for r in reqs:
                engine.abort_request(r.request_id)
            engine.step()
            reqs = [Request(RequestId(f"p{round_}-{i}"), _prompt(rng, P, loaded.vocab_size),
                            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)) for i in range(C)]
        t0 = time.perf_counter()
        for r in reqs:
            engine.add_request(r)
        prefill = []
        while not all(r.output_ids for r in reqs):
            if time.perf_counter() - t0 > 900:
                raise RuntimeError(f"prefill did not finish in 900 s ({engine.num_waiting} requests waiting)")
            wall, jit = timed_step(engine, recorder, dispatch)
            prefill.append({"wall_s": wall, "chunks": recorder.chunk_calls, "chunk_build_s": recorder.chunk_build_s,
                            "eval_s": dispatch["eval_s"], "async_eval_s": dispatch["s"], "new_jit_files": jit})
            log(f"prefill step {len(prefill) - 1}: {wall:.3f} s, {recorder.chunk_calls} chunks, "
                f"{sum(bool(r.output_ids) for r in reqs)} rows done, jit +{prefill[-1]['new_jit_files']}")
        prefill_s = time.perf_counter() - t0
        log(f"round {round_}: {C} prompts of {P} prefilled in {prefill_s:.2f} s ({C * P / prefill_s:.0f} tok/s)")
        for i, row in enumerate(prefill[:8]):
            log(f"prefill step {i}: {row['wall_s'] * 1e3:.1f} ms, {row['chunks']} chunks, build "
                f"{row['chunk_build_s'] * 1e3:.1f}, eval {row['eval_s'] * 1e3:.1f}, "
                f"async_eval {row['async_eval_s'] * 1e3:.1f}, jit +{row['new_jit_files']}")
        rounds.append({"prefill_s": prefill_s, "tok_per_s": C * P / prefill_s, "steps": prefill})
    phases = Phases()
    phases.install()
    report: dict[str, Any] = {"arm": args.arm, "depth": args.depth, "prompt_tokens": P, "rows": C, "warm_up": warm,
                              "weights_bytes": weights, "prefill_s": rounds[0]["prefill_s"],
                              "prefill_steps": rounds[0]["steps"], "prefill_rounds": rounds, "levels": []}
    alive = list(reqs)
    try:
        for level in sorted({C, 1}, reverse=True):
            for r in alive[level:]:
                engine.abort_request(r.request_id)
            alive = alive[:level]
            engine.step()  # the aborts settle
            entry: dict[str, Any] = {"level": level, "modes": {}}
            # a compiled step runs its KV work inside one graph: no phase of it can be synced apart
            for mode in ("plain", "synced", "profiled") if args.arm.endswith("-eager") else ("plain", "profiled"):
                # run to 3 steps before the next commit, then time 6 steps (the 3rd commits)
                while (-(len(alive[0].prompt_ids) + len(alive[0].output_ids))) % TILE != 2:
                    engine.step()
                steps = []
                for i in range(6):
                    cache_len = len(alive[0].prompt_ids) + len(alive[0].output_ids) - 1  # tokens cached before it
                    tile = (cache_len + 1) % TILE == 0  # this step's token fills the tail: every row commits
                    recorder.reset()
                    dispatch["s"] = 0.0
                    phases.t = {}
                    phases.on = mode == "synced"
                    prof = cProfile.Profile() if mode == "profiled" and i in (1, 2) else None
                    ts = time.perf_counter()
                    if prof is not None:
                        prof.enable()
                    engine.step()
                    if prof is not None:
                        prof.disable()
                    wall = time.perf_counter() - ts
                    phases.on = False
                    row = {"cache_len": cache_len, "tile_step": tile, "wall_s": wall, "build_s": recorder.build_s,
                           "async_eval_s": dispatch["s"], "rest_s": wall - recorder.build_s - dispatch["s"]}
                    if mode == "synced":
                        row["phases_s"] = dict(phases.t)
                    if prof is not None:
                        s = io.StringIO()
                        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
                        row["profile"] = s.getvalue()
                    steps.append(row)
                    log(f"c={level} {mode} len {cache_len}{' TILE' if tile else ''}: {wall * 1e3:.1f} ms "
                        f"(build {recorder.build_s * 1e3:.1f}, async_eval {dispatch['s'] * 1e3:.1f})"
                        + (f" phases { {k: round(v * 1e3, 2) for k, v in phases.t.items()} }" if mode == "synced" else ""))
                entry["modes"][mode] = steps
            entry["commits"] = repeat_commits(engine, alive[0], recorder, dispatch, args.commits)
            ordinary = [s["wall_s"] for s in entry["modes"]["plain"] if not s["tile_step"]]
            tile = [s["wall_s"] for s in entry["modes"]["plain"] if s["tile_step"]]
            entry["median_ordinary_s"] = statistics.median(ordinary)
            entry["tile_s"] = tile[0] if tile else None
            report["levels"].append(entry)
    finally:
        mx.async_eval, mx.eval = orig_async, orig_eval
        phases.uninstall()
    for r in alive:
        engine.abort_request(r.request_id)
    return report


def jit_files() -> int:
    """Files in MLX's PTX cache (``MLX_PTX_CACHE_DIR``): a step that adds one compiled a kernel."""
    root = os.environ.get("MLX_PTX_CACHE_DIR")
    if not root or not os.path.isdir(root):
        return 0
    return sum(len(files) for _, _, files in os.walk(root))


def timed_step(engine, recorder, dispatch) -> tuple[float, int]:
    """One engine step with the recorder and the eval timers reset: (wall seconds, files it added
    to MLX's kernel cache)."""
    recorder.reset()
    dispatch["s"] = dispatch["eval_s"] = 0.0
    jit0 = jit_files()
    ts = time.perf_counter()
    engine.step()
    return time.perf_counter() - ts, jit_files() - jit0


def repeat_commits(engine, req, recorder, dispatch, n: int) -> list[dict[str, Any]]:
    """Plain steps through ``n`` more tile boundaries: each commit step and the ordinary step
    before it (is a commit slow every time, or only the first time at a batch size?)."""
    rows = []
    for _ in range(n):
        while (-(len(req.prompt_ids) + len(req.output_ids))) % TILE != 1:
            engine.step()
        for tile in (False, True):
            wall, jit = timed_step(engine, recorder, dispatch)
            rows.append({"tile_step": tile, "wall_s": wall, "build_s": recorder.build_s, "async_eval_s": dispatch["s"],
                         "new_jit_files": jit})
            log(f"  repeat {'TILE' if tile else 'plain'}: {wall * 1e3:.1f} ms (build {recorder.build_s * 1e3:.1f}, "
                f"async_eval {dispatch['s'] * 1e3:.1f}, jit +{rows[-1]['new_jit_files']})")
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--arm", default="kvarn-k4v2")
    p.add_argument("--depth", type=int, default=4096)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--commits", type=int, default=3, help="commit steps repeated per level after the modes")
    p.add_argument("--kv-budget-gb", type=float, default=100.0)
    p.add_argument("--prefill-rounds", type=int, default=1,
                   help="prefill C new prompts this many times (round 2 on: every shape seen before)")
    p.add_argument("--warm-up", type=int, default=0, metavar="ROWS",
                   help="run engine/warm_up.py's workload with this many decode rows before the prompts (0: none)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    env = environment()
    report = {"env": env, "args": vars(args), "runs": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for arm in args.arm.split(","):
        args_arm = argparse.Namespace(**{**vars(args), "arm": arm})
        report["runs"].append(run(args_arm))
        out.write_text(json.dumps(report, indent=1) + "\n")
        mx.clear_cache()
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
