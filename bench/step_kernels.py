"""Which GPU kernels one decode step launches and how long each runs (8B shape, one row at a depth,
or ``--rows`` of them): the engine's compiled step (KVarN k4v2, fp16) beside mlx-lm's own step over
its ``KVCache``. Where the time of a lone row's step goes: the GPU's kernels, or the host.

    python3 bench/step_kernels.py --arms kvarn-k4v2,fp16,mlx-lm --out $OUT/step-timing.json
    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \\
        python3 bench/step_kernels.py --arms kvarn-k4v2 --profile 2 > $OUT/ncu-kvarn-k4v2.csv
    python3 bench/step_kernels.py --summarize $OUT/ncu-kvarn-k4v2.csv --steps 2 --out $OUT/step-kernels-kvarn-k4v2.json

Timing mode (no profiler): per arm, ``--warm`` decode steps, then ``--timed`` steps each read back
(wall, median) and the same number launched back to back with the next step built while the last
runs (mlx-lm as ``mlx_lm.generate_step`` does; the engine's own loop: ``Engine.step``, with
``-async`` arms its ``async_scheduling``), and for the engine's arms the host milliseconds a step
in each of its phases (``Phases``).
``--profile N``: after the warm steps, N steps inside ``cudaProfilerStart/Stop`` (ncu then
measures those steps' kernels only: ``--profile-from-start off``). ``--prefill-again N``: after
the steps, the rows' prompts prefilled N more times (new prompts, every graph already built), each
timed; with ``--profile-prefill`` the last of them is the profiled range. ``--summarize CSV``: ncu's
per-kernel durations grouped by kernel, per step. The model is ``bench/device_engine.py``'s
(random weights; ``--layers 2 --hidden 512 --intermediate 1024 --depth 256`` shrink it on a CPU).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import glob
import json
import os
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.device_engine import Recorder, arm_config, arm_flags, build_model, environment, log  # noqa: E402
from engine.bench import _prompt  # noqa: E402
from engine.engine import make_engine  # noqa: E402
from engine.kv_config import ApcConfig  # noqa: E402
from engine.request import Request, RequestId, SamplingParams  # noqa: E402
from engine.scheduler import SchedulerConfig  # noqa: E402


def cuda_profiler():
    """(start, stop) of the CUDA runtime's profiler range, or None where no runtime library is found."""
    names = [os.environ.get("CUDART", "")]
    for base in sys.path:
        names += sorted(glob.glob(os.path.join(base, "nvidia", "cuda_runtime", "lib", "libcudart.so*")))
        names += sorted(glob.glob(os.path.join(base, "torch", "lib", "libcudart*.so*")))
    names += ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    for name in names:
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        log(f"profiler range through {name}")
        return lib.cudaProfilerStart, lib.cudaProfilerStop
    return None


class Phases:
    """Host seconds the engine spends in each phase of its steps (``Engine.step``'s calls, each
    timed where the engine makes it): ``plan`` (the scheduler), ``dispatch`` (build the step's
    graphs and launch them), ``collect`` (wait for a step's tokens and read them back),
    ``update`` (outputs, detokenizing, the prefix cache). With ``-async`` a step's ``collect``
    waits only for what the device has not finished while the next step was built."""

    NAMES = ("plan", "dispatch", "collect", "update")

    def __init__(self, engine) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        for owner, name in ((engine.scheduler, "plan"), (engine.runner, "dispatch"), (engine.runner, "collect"),
                            (engine, "update")):
            setattr(owner, name, self._timed(name, getattr(owner, name)))

    def _timed(self, name: str, fn):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t
        return timed

    def per_step(self, steps: int) -> dict[str, float]:
        return {name: round(1e3 * self.seconds[name] / steps, 3) for name in self.NAMES}


class EngineArm:
    """``rows`` rows of ``depth`` prompt tokens each decoding in the engine (its compiled step); an
    arm ending in ``-async`` runs the engine with ``async_scheduling``."""

    def __init__(self, loaded, arm: str, depth: int, chunk: int, rows: int = 1) -> None:
        base, run_ahead, _, _ = arm_flags(arm)
        cfg = SchedulerConfig(max_num_seqs=rows + 1, max_num_batched_tokens=chunk + rows + 1, prefill_chunk_size=chunk,
                              async_scheduling=run_ahead)
        self.engine = make_engine(loaded, cfg, arm_config(base), ApcConfig(enabled=False))
        self.loaded, self.depth, self.rows = loaded, depth, rows
        self.prefill(seed=3)
        self.phases = Phases(self.engine)

    def prefill(self, seed: int) -> float:
        """Submit the rows' prompts (made from ``seed``) and step until each has its first token;
        the seconds that took."""
        rng = random.Random(seed)
        self.requests = [Request(RequestId(f"s{seed}r{i}"), _prompt(rng, self.depth, self.loaded.vocab_size),
                                 SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True))
                         for i in range(self.rows)]
        t = time.perf_counter()
        for request in self.requests:
            self.engine.add_request(request)
        while not all(r.output_ids for r in self.requests):
            self.engine.step()
        mx.synchronize()
        return time.perf_counter() - t

    def step(self) -> None:
        self.engine.step()  # reads the token back (the engine's loop)

    def launch(self) -> None:
        self.engine.step()

    def done(self) -> None:
        for request in self.requests:
            self.engine.abort_request(request.request_id)
        while self.engine.has_work():
            self.engine.step()


class MlxLmArm:
    """mlx-lm's own step: the model over its ``KVCache`` (``make_prompt_cache``), greedy."""

    def __init__(self, loaded, depth: int, chunk: int) -> None:
        from mlx_lm.models.cache import make_prompt_cache

        self.model = loaded.model
        self.cache = make_prompt_cache(self.model)
        prompt = mx.array(_prompt(random.Random(3), depth, loaded.vocab_size))
        for lo in range(0, depth - 1, chunk):
            self.model(prompt[None, lo: min(lo + chunk, depth - 1)], cache=self.cache)
            mx.eval([c.state for c in self.cache])
        self.y = prompt[-1:]
        self.step()

    def _next(self) -> mx.array:
        return mx.argmax(self.model(self.y[None], cache=self.cache)[:, -1], axis=-1)

    def step(self) -> None:
        self.y = self._next()
        mx.eval(self.y)

    def launch(self) -> None:  # generate_step's pipelining: the next step is built before the last is read
        y = self._next()
        mx.async_eval(y)
        self.y.item()
        self.y = y

    def done(self) -> None:
        mx.eval(self.y)
        self.cache = None


def run_arm(loaded, arm: str, args, profiler) -> dict:
    log(f"{arm}: building {args.rows} row(s) of {args.depth} tokens")
    if arm == "mlx-lm" and args.rows != 1:
        raise SystemExit("the mlx-lm arm runs one row")
    t = time.perf_counter()
    a = MlxLmArm(loaded, args.depth, args.chunk) if arm == "mlx-lm" else EngineArm(loaded, arm, args.depth, args.chunk,
                                                                                   args.rows)
    prefill_s = time.perf_counter() - t
    for _ in range(args.warm):
        a.step()
    mx.synchronize()
    walls = []
    for _ in range(args.timed):
        t = time.perf_counter()
        a.step()
        walls.append(time.perf_counter() - t)
    phases = getattr(a, "phases", None)
    if phases is not None:
        phases.seconds.clear()
    t = time.perf_counter()
    for _ in range(args.timed):
        a.launch()
    a.step()
    pipelined = (time.perf_counter() - t) / (args.timed + 1)
    out = {"arm": arm, "depth": args.depth, "rows": args.rows, "prefill_s": round(prefill_s, 3),
           "step_ms_median": round(1e3 * statistics.median(walls), 3), "step_ms_min": round(1e3 * min(walls), 3),
           "step_ms_pipelined": round(1e3 * pipelined, 3)}
    if phases is not None:  # where the engine's host time went in the back-to-back steps
        out["host_ms_per_step"] = phases.per_step(args.timed + 1)
    if args.profile and not args.profile_prefill:
        mx.synchronize()
        if profiler is not None:
            profiler[0]()
        for _ in range(args.profile):
            a.step()
        mx.synchronize()
        if profiler is not None:
            profiler[1]()
        out["profiled_steps"] = args.profile
    a.done()
    if args.prefill_again and isinstance(a, EngineArm):
        # the same rows' prefill again, new prompts, every graph already built (inside the profiler's
        # range with --profile-prefill)
        times = []
        for i in range(args.prefill_again):
            last = args.profile_prefill and i == args.prefill_again - 1
            if last and profiler is not None:
                profiler[0]()
            times.append(a.prefill(seed=10 + i))
            if last and profiler is not None:
                profiler[1]()
            a.done()
        out["prefill_again_s"] = [round(t, 4) for t in times]
    log(f"{arm}: {out}")
    return out


def summarize(path: str, steps: int) -> dict:
    """ncu's CSV (one row per kernel and metric) grouped by kernel name: launches and microseconds
    a step, the busiest first."""
    lines = Path(path).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    by_name: dict[str, list[float]] = defaultdict(list)
    for row in csv.DictReader(lines[start:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(row["Metric Value"].replace(",", ""))
        unit = row.get("Metric Unit", "ns")
        scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}.get(unit, 1e-3)
        by_name[row["Kernel Name"].split("(")[0][:120]].append(value * scale)
    kernels = sorted(({"kernel": k, "launches_per_step": len(v) / steps, "us_per_step": round(sum(v) / steps, 1),
                       "us_median": round(statistics.median(v), 2)} for k, v in by_name.items()),
                     key=lambda x: -x["us_per_step"])
    total = sum(x["us_per_step"] for x in kernels)
    return {"csv": os.path.basename(path), "steps": steps, "gpu_us_per_step": round(total, 1),
            "launches_per_step": sum(x["launches_per_step"] for x in kernels), "kernels": kernels}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default="kvarn-k4v2,fp16,mlx-lm")
    p.add_argument("--depth", type=int, default=4096)
    p.add_argument("--rows", type=int, default=1, help="rows decoding together (engine arms)")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--warm", type=int, default=8)
    p.add_argument("--timed", type=int, default=20)
    p.add_argument("--profile", type=int, default=0, metavar="STEPS")
    p.add_argument("--prefill-again", type=int, default=0, metavar="N",
                   help="after the steps, the rows' prefill N more times with new prompts (timed)")
    p.add_argument("--profile-prefill", action="store_true",
                   help="with --prefill-again: the last prefill inside the profiler's range (not the decode steps)")
    p.add_argument("--rotate", choices=("auto", "reference"), default="auto",
                   help="KVarN's rotations: the rotation kernel where it passes its check (auto), or MLX's operations")
    p.add_argument("--summarize", metavar="CSV")
    p.add_argument("--steps", type=int, default=2, help="with --summarize: the steps the CSV holds")
    p.add_argument("--out")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    if args.summarize:
        report = summarize(args.summarize, args.steps)
        for k in report["kernels"][:25]:
            print(f"{k['us_per_step']:9.1f} us  x{k['launches_per_step']:5.1f}  {k['kernel']}")
        print(f"total {report['gpu_us_per_step']} us a step over {report['launches_per_step']} launches")
    else:
        if args.rotate == "reference":
            from metal import KERNELS
            KERNELS.pin_rotate_path("reference")
        loaded, weights = build_model(args, Recorder())
        profiler = cuda_profiler() if args.profile or args.profile_prefill else None
        report = {"environment": environment(), "weights_bytes": weights, "rotate": args.rotate,
                  "arms": [run_arm(loaded, arm, args, profiler) for arm in args.arms.split(",")]}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
