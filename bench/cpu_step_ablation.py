"""Where a decode step of the bundled model goes on the CPU: the step's median time with one part
changed, KVarN k4v2 beside fp16, arms and ablations alternating in one process.

    flock /tmp/kvarn-bench.lock python3 bench/cpu_step_ablation.py --rows 1 --depth 3000 \\
        --ablations none,noattn,nowrite,norotate,nocast --json-out bench/results/cpu-step-ablation.json

Every arm's rows are prefilled once (``--depth`` pseudo-random tokens each, the prefix cache off);
then, for each round, each (arm, ablation) pair in turn has its step traced afresh and timed over
``--steps`` decode steps (medians of steps, then of rounds). Per step: ``host_ms`` (the plan and
the compiled graph's replay, lazily) and ``eval_ms`` (evaluating the logits and the storage's
new arrays), besides the whole engine step. Ablations:

* ``none``: the step as the product runs it;
* ``noattn``: every layer's attention returns its queries;
* ``nowrite``: no cache write (KVarN: no commit either);
* ``windowonly`` (KVarN): attention over the window alone, no records;
* ``norotate`` (KVarN): the new keys and values stored unrotated;
* ``nocast`` (KVarN): the new keys and values stored without the float16 rounding casts.

All but ``none`` change the tokens: they time the step, nothing else. ``--nodes`` prints the
compiled step's node counts by kind (``bench/device_engine.py: count_nodes``). Run with OpenBLAS
preloaded (the script re-executes itself under it, as ``kvarn`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from server.blas import maybe_reexec_with_openblas, openblas_active  # noqa: E402

MODEL = ROOT / "engine/bundled/fixture-chat-29m-q8"
SCHEMES = {"kvarn-k4v2": "kvarn", "fp16": "fp16"}


def patch(name: str) -> None:
    """Put the step's parts back as they are, then change the one ``name`` names."""
    import mlx.core as mx

    import kvarn.decode_graph as dg
    import kvarn.slot_step as ss

    for cls, (update, attend) in ORIGINAL.items():
        cls.update_and_fetch, cls.attend = update, attend
    dg.rounded = ROUNDED
    if name == "noattn":
        for cls in ORIGINAL:
            cls.attend = lambda self, queries, keys, values, **kw: queries
    elif name == "nowrite":
        def skip_paged(self, keys, values):  # noqa: ANN001, ANN202
            return None, None

        def skip_slots(self, keys, values):  # noqa: ANN001, ANN202
            view = [buf[self.lo: self.lo + self.Bp, :, : self.Tb] for buf in self.buffers]
            return view[0], view[1]
        dg.PagedStepLayer.update_and_fetch = skip_paged
        ss.SlotStepLayer.update_and_fetch = skip_slots
    elif name == "windowonly":
        from kvarn.paged_attention import decode_attention_over

        def window_only(self, queries, keys, values, *, scale, **kw):  # noqa: ANN001, ANN202
            W = self.static[9]
            return decode_attention_over(queries, self.a, self.layout, scale, windows=self.windows, win_len=W,
                                         table=None, mask=self.inputs["mask"][..., :W])
        dg.PagedStepLayer.attend = window_only
    elif name == "norotate":
        dg.rounded = lambda x, dtype: x.astype(mx.float16).astype(dtype)
    elif name == "nocast":
        dg.rounded = lambda x, dtype: dg.rotate(x) if x.dtype == dtype else dg.rotate(x).astype(dtype)


def timed_logits(times: list[tuple[float, float]]):  # noqa: ANN201
    """``DecodeGraphs.logits`` with its host part (plan, replay) and its evaluation timed apart."""
    import mlx.core as mx

    import engine.forward as fw

    def logits(self, tokens, caches, counts=None):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        plan = fw.plan_decode(caches, counts=counts)
        key = (plan.build, plan.static)
        fn = self._graph(key, plan)
        if plan.padded > plan.rows:
            tokens = mx.concatenate([tokens, mx.zeros((plan.padded - plan.rows, tokens.shape[1]), tokens.dtype)])
        out = fn(tokens, plan.inputs, plan.state)
        plan.finish(list(out[1:]))
        rows = plan.rows
        del plan  # the storage's old arrays held by nothing but the graph: written in place, as in the engine
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        times.append((t1 - t0, t2 - t1))
        return out[0][:rows]

    return logits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--depth", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", default="kvarn-k4v2,fp16")
    ap.add_argument("--ablations", default="none,noattn,nowrite,norotate,nocast")
    ap.add_argument("--nodes", action="store_true")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    maybe_reexec_with_openblas()
    import mlx.core as mx

    import kvarn.decode_graph as dg
    import kvarn.slot_step as ss
    from engine.engine import make_engine
    from engine.forward import DecodeGraphs
    from engine.kv_config import ApcConfig, KVConfig
    from engine.loader import load_model
    from engine.request import Request, RequestId, SamplingParams
    from engine.scheduler import SchedulerConfig

    global ORIGINAL, ROUNDED
    ORIGINAL = {cls: (cls.update_and_fetch, cls.attend) for cls in (dg.PagedStepLayer, ss.SlotStepLayer)}
    ROUNDED = dg.rounded
    times: list[tuple[float, float]] = []
    DecodeGraphs.logits = timed_logits(times)
    loaded = load_model(MODEL)
    rng = random.Random(0)
    arms = args.arms.split(",")
    engines = {}
    budget = args.steps * (len(args.ablations.split(",")) * args.rounds + 1) + 64
    for arm in arms:
        cfg = SchedulerConfig(max_num_seqs=args.rows, max_num_batched_tokens=args.rows + 512)
        engine = make_engine(loaded, cfg, KVConfig(scheme=SCHEMES[arm]), ApcConfig(enabled=False))
        for i in range(args.rows):
            prompt = [rng.randrange(16, loaded.vocab_size) for _ in range(args.depth)]
            engine.add_request(Request(RequestId(f"{arm}-{i}"), prompt,
                                       SamplingParams(max_tokens=budget, temperature=0.0, ignore_eos=True)))
        while engine.scheduler.waiting or any(not r.output_ids for r in engine.scheduler.running):
            engine.step()
        engines[arm] = engine
    results: dict[str, dict[str, list[dict]]] = {arm: {} for arm in arms}
    for r in range(args.rounds):
        for ablation in args.ablations.split(","):
            for arm in arms:
                if ablation in ("norotate", "nocast", "windowonly") and arm == "fp16":
                    continue
                engine = engines[arm]
                patch(ablation)
                engine.runner.graphs._graphs.clear()
                for _ in range(4):
                    engine.step()
                if args.nodes and r == 0:
                    report_nodes(engine, arm, ablation)
                times.clear()
                walls = []
                for _ in range(args.steps):
                    t = time.perf_counter()
                    engine.step()
                    walls.append(time.perf_counter() - t)
                got = {"step_ms": 1e3 * statistics.median(walls),
                       "host_ms": 1e3 * statistics.median(h for h, _ in times),
                       "eval_ms": 1e3 * statistics.median(e for _, e in times)}
                results[arm].setdefault(ablation, []).append(got)
                print(f"round {r} {arm} {ablation}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()), flush=True)
    patch("none")
    median = {arm: {ab: {k: statistics.median(x[k] for x in runs) for k in runs[0]} for ab, runs in per.items()}
              for arm, per in results.items()}
    for arm, per in median.items():
        for ab, m in per.items():
            print(f"{arm:>11} {ab:>9}: step {m['step_ms']:.2f} ms (host {m['host_ms']:.2f}, eval {m['eval_ms']:.2f})")
    if args.json_out:
        args.json_out.write_text(json.dumps({"rows": args.rows, "depth": args.depth, "openblas": openblas_active(),
                                             "load_average": os.getloadavg(), "median": median, "rounds": results},
                                            indent=1))
    del mx


def report_nodes(engine, arm: str, ablation: str) -> None:  # noqa: ANN001
    """The step's graph node counts by kind, traced uncompiled on the next step's plan."""
    import mlx.core as mx

    from bench.device_engine import count_nodes
    from engine.forward import DecodeGraphs

    graphs = engine.runner.graphs
    original = DecodeGraphs._graph
    seen = {}

    def capture(self, key, plan):  # noqa: ANN001, ANN202
        def fn(tokens, inputs, state):  # noqa: ANN001, ANN202
            out = self._step(plan.build, plan.static)(tokens, inputs, state)
            seen["nodes"] = count_nodes(list(out))
            mx.eval(out)
            return out
        return fn

    DecodeGraphs._graph = capture
    try:
        engine.step()
    finally:
        DecodeGraphs._graph = original
    graphs._graphs.clear()
    total, kinds = seen["nodes"]
    print(f"{arm} {ablation} nodes {total}: {kinds}", flush=True)


ORIGINAL: dict = {}
ROUNDED = None

if __name__ == "__main__":
    main()
