"""The engine's host time per decode step on the CPU: the Python and MLX graph building and
dispatch that ``engine.step()`` costs the thread calling it, beside the step's wall time.

    flock /tmp/kvarn-bench.lock python3 bench/step_host_time.py --current-rev HEAD --base 8ac31b2 \\
        --rounds 3 --json-out bench/results/step-host-time-cpu.json

On MLX's CPU backend the arithmetic runs on MLX's stream worker threads and OpenBLAS's threads,
so ``time.thread_time()`` of the thread that calls ``engine.step()`` counts only that thread's
CPU time: Python plus MLX's C++ graph building and dispatch, not the math, and not the time it
waits for the result. Host time of a step = the ``thread_time()`` delta around ``engine.step()``;
wall time = the ``perf_counter()`` delta; host share = median host / median wall. Python time of a
step = its host time less the part inside MLX's own calls (``mx.eval``, ``mx.async_eval`` and
every function ``mx.compile`` returns, patched before the engine is imported): the Python that
plans, builds and reads the step, MLX ops it calls one by one included (the graph built in Python).

Per layout arm (``fp16`` and ``kvarn-k4v2``: ``make_engine`` with ``KVConfig(scheme=...)``, the
prefix cache off, the bundled model, OpenBLAS preloaded as ``kvarn`` does) and per concurrency in
``--rows``: that many requests with distinct pseudo-random prompts of ``--prompt-tokens`` tokens,
greedy, EOS ignored. The engine steps until every row has its first token (every prompt chunk
run), then ``--warm-up`` decode steps (compiled decode graphs traced), then ``--steps`` timed decode
steps, each checked to advance every row by one token; then the requests are aborted.

Each measurement runs in a subprocess whose cwd and ``PYTHONPATH`` are the tree measured (this
script is copied to a temporary file, so ``import engine`` resolves to that tree's code):
``--tree DIR`` (default: this checkout; ``--current-rev REV``: a temporary ``git worktree`` of REV)
and, with ``--base REV``, a temporary ``git worktree`` of REV (worktrees are removed at the end).
Rounds alternate the order (even rounds current first, odd rounds base first); a figure is the
median over ``--rounds`` of each round's median, the ratio current / base.
``--json-out``: settings, both revisions, every round, medians and ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MODEL = "engine/bundled/fixture-chat-29m-q8"  # relative to the tree measured
ARMS = {"fp16": "fp16", "kvarn-k4v2": "kvarn"}  # arm -> KVConfig.scheme


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10, method="inclusive")[-1]


def summarize(host: list[float], wall: list[float], python: list[float]) -> dict:
    host_med, wall_med = statistics.median(host), statistics.median(wall)
    return {"host_ms": round(host_med, 4), "host_ms_p90": round(p90(host), 4),
            "python_ms": round(statistics.median(python), 4), "python_ms_p90": round(p90(python), 4),
            "wall_ms": round(wall_med, 4), "wall_ms_p90": round(p90(wall), 4),
            "share": round(host_med / wall_med, 4)}


NATIVE = {"ms": 0.0, "depth": 0}  # the measuring thread's CPU time inside MLX's evaluation and compiled replays


def timed_native(fn):  # noqa: ANN001, ANN201
    """``fn`` with the calling thread's CPU time inside it added to ``NATIVE`` (outermost call only)."""
    def call(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if NATIVE["depth"]:
            return fn(*args, **kwargs)
        NATIVE["depth"] += 1
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            NATIVE["ms"] += (time.thread_time() - start) * 1e3
            NATIVE["depth"] -= 1
    return call


def time_native_calls(mx) -> None:  # noqa: ANN001
    """Count MLX's own host work apart: ``mx.eval`` / ``mx.async_eval`` (MLX walking the graph and
    dispatching it) and every function ``mx.compile`` returns (a replay rebuilds the recorded graph
    in C++). Patched before the engine's modules are imported, so their ``mx.`` calls go through it."""
    mx.eval, mx.async_eval = timed_native(mx.eval), timed_native(mx.async_eval)
    compile_ = mx.compile

    def compile_timed(fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        return timed_native(compile_(fn, *args, **kwargs))
    mx.compile = compile_timed


# ---- the measurement (a subprocess, cwd and PYTHONPATH the tree measured) ----

def measure_rows(engine, rows: int, args: argparse.Namespace, rng: random.Random, vocab: int, tag: str) -> dict:  # noqa: ANN001
    from engine.request import Request, RequestId, SamplingParams

    max_tokens = args.warm_up + args.steps + 8
    requests = [Request(RequestId(f"{tag}-{rows}-{i}-{time.monotonic_ns()}"),
                        [rng.randrange(16, vocab) for _ in range(args.prompt_tokens)],
                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, speculative=False))
               for i in range(rows)]
    for request in requests:
        engine.add_request(request)
    prefill_steps = 0
    while not all(r.output_ids and r.is_prefill_done for r in requests):
        engine.step()
        prefill_steps += 1
        if prefill_steps > 1000:
            raise RuntimeError("rows never all reached decode")
    for _ in range(args.warm_up):
        engine.step()
    graphs = getattr(engine.runner, "graphs", None)  # compiled decode graphs, where the tree has them
    traces = getattr(graphs, "traces", None)
    host, wall, python = [], [], []
    for _ in range(args.steps):
        before = [len(r.output_ids) for r in requests]
        native = NATIVE["ms"]
        t0, w0 = time.thread_time(), time.perf_counter()
        engine.step()
        w1, t1 = time.perf_counter(), time.thread_time()
        python.append((t1 - t0) * 1e3 - (NATIVE["ms"] - native))
        if any(len(r.output_ids) != n + 1 for r, n in zip(requests, before)):
            raise RuntimeError("a timed step was not one decode token for every row")
        host.append((t1 - t0) * 1e3)
        wall.append((w1 - w0) * 1e3)
    traced = None if traces is None else graphs.traces - traces  # forwards built in Python while timed
    for request in requests:
        engine.abort_request(request.request_id)
    while engine.has_work():
        engine.step()
    return {**summarize(host, wall, python), "prefill_steps": prefill_steps, "traces_timed": traced}


def child(args: argparse.Namespace) -> None:
    from server.blas import maybe_reexec_with_openblas, openblas_active

    maybe_reexec_with_openblas()
    import mlx.core as mx

    time_native_calls(mx)

    from engine.engine import make_engine
    from engine.kv_config import ApcConfig, KVConfig
    from engine.loader import load_model
    from engine.scheduler import SchedulerConfig

    rows = [int(x) for x in args.rows.split(",")]
    loaded = load_model(Path.cwd() / MODEL)
    rng = random.Random(args.seed)
    result = {"openblas": openblas_active(), "mlx": mx.__version__, "device": str(mx.default_device()),
              "load_average_start": [round(x, 2) for x in os.getloadavg()], "arms": {}}
    for arm, scheme in ARMS.items():
        engine = make_engine(loaded, SchedulerConfig(max_num_seqs=max(rows)), KVConfig(scheme=scheme),
                             ApcConfig(enabled=False))
        result["arms"][arm] = {}
        for n in rows:
            result["arms"][arm][str(n)] = figures = measure_rows(engine, n, args, rng, loaded.vocab_size, arm)
            print(f"  {arm:>10} c={n:<3} host {figures['host_ms']:.2f} ms (p90 {figures['host_ms_p90']:.2f}), "
                  f"python {figures['python_ms']:.2f} ms, "
                  f"wall {figures['wall_ms']:.2f} ms, share {figures['share']:.2f}", file=sys.stderr, flush=True)
        del engine
    Path(args.child_out).write_text(json.dumps(result))


# ---- the parent: trees, rounds, medians ----

def git(*argv: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *argv], cwd=cwd, check=True, capture_output=True, text=True).stdout


def run_tree(script: Path, tree: Path, args: argparse.Namespace, out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    env.pop("KVARN_OPENBLAS_REEXEC", None)  # the child preloads OpenBLAS itself
    command = [sys.executable, str(script), "--child-out", str(out), "--rows", args.rows,
               "--prompt-tokens", str(args.prompt_tokens), "--warm-up", str(args.warm_up),
               "--steps", str(args.steps), "--seed", str(args.seed)]
    subprocess.run(command, cwd=tree, env=env, check=True)
    return json.loads(out.read_text())


def medians(runs: list[dict]) -> dict:
    arms = runs[0]["arms"]
    return {arm: {n: {key: round(statistics.median(r["arms"][arm][n][key] for r in runs), 4)
                      for key in ("host_ms", "host_ms_p90", "python_ms", "python_ms_p90", "wall_ms", "wall_ms_p90", "share")}
                  for n in arms[arm]}
            for arm in arms}


def relative(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else path.name


def parent(args: argparse.Namespace) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="step-host-time-"))
    worktrees = {name: rev for name, rev in (("current", args.current_rev), ("base", args.base)) if rev}
    trees = {"current": (args.tree or REPO).resolve()}
    try:
        for name, rev in worktrees.items():
            trees[name] = scratch / name
            git("worktree", "add", "--detach", str(trees[name]), rev)
        script = scratch / "step_host_time.py"
        shutil.copy(Path(__file__).resolve(), script)
        revisions = {name: git("rev-parse", "HEAD", cwd=tree).strip() for name, tree in trees.items()}
        status = git("status", "--porcelain", "--untracked-files=no", cwd=trees["current"])
        modified = [line[3:] for line in status.splitlines()]  # the current tree's edits beside its revision
        rounds: dict[str, list[dict]] = {name: [] for name in trees}
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(reversed(trees))
            for name in order:
                print(f"round {r} {name} ({revisions[name][:7]})", file=sys.stderr, flush=True)
                rounds[name].append(run_tree(script, trees[name], args, scratch / f"{name}-{r}.json"))
    finally:
        for name in worktrees:
            if (scratch / name).exists():
                subprocess.run(["git", "worktree", "remove", "--force", str(scratch / name)], cwd=REPO, check=False)
        shutil.rmtree(scratch, ignore_errors=True)
    median = {name: medians(runs) for name, runs in rounds.items()}
    ratios = {}
    if "base" in median:
        ratios = {arm: {n: {key: round(median["current"][arm][n][key] / median["base"][arm][n][key], 4)
                            for key in ("host_ms", "python_ms", "wall_ms", "share")}
                        for n in median["current"][arm]}
                  for arm in median["current"]}
    print(f"\n{'arm':>10} {'rows':>4} " + " ".join(f"{name + ' host/python/wall ms':>30}" for name in median)
          + ("   host, python ratio" if ratios else ""))
    for arm in ARMS:
        for n in median["current"][arm]:
            cells = " ".join(f"{m[arm][n]['host_ms']:9.2f} {m[arm][n]['python_ms']:9.2f} {m[arm][n]['wall_ms']:9.2f}"
                             for m in median.values())
            tail = f"   {ratios[arm][n]['host_ms']:.3f} {ratios[arm][n]['python_ms']:.3f}" if ratios else ""
            print(f"{arm:>10} {n:>4} {cells}{tail}")
    if args.json_out:
        argv = [relative(Path(a)) if os.path.isabs(a) else a for a in sys.argv[1:]]
        report = {
            "command": shlex.join(["python3", "bench/step_host_time.py", *argv]),
            "settings": {"rows": [int(x) for x in args.rows.split(",")], "prompt_tokens": args.prompt_tokens,
                         "warm_up": args.warm_up, "steps": args.steps, "rounds": args.rounds, "seed": args.seed,
                         "arms": ARMS, "model": MODEL, "cpus": os.cpu_count()},
            "revisions": revisions, "current_modified_files": modified,
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
            "median": median, "ratio_current_over_base": ratios, "rounds": rounds,
        }
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16", help="concurrencies, comma-separated")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--warm-up", type=int, default=40)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tree", type=Path, help="the tree measured as current (default: this checkout)")
    ap.add_argument("--current-rev", help="measure this revision as current, in a temporary git worktree "
                    "(instead of the checkout with its uncommitted edits)")
    ap.add_argument("--base", help="a revision measured beside it, in a temporary git worktree")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tree and args.current_rev:
        ap.error("--tree and --current-rev both name the current side")
    if args.child_out:
        child(args)
    else:
        parent(args)


if __name__ == "__main__":
    main()
