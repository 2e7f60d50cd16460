"""The engine on a GPU (the H200 in docs/benchmarks.md) at an 8B shape: decode tok/s per concurrency, the KVarN tile-commit
step, prefill and TTFT, graph nodes per decode step and KV bytes, per KV layout, beside mlx-lm's
own batched caches on the same model in the same process.

    PYTHONPATH=. python3 bench/device_engine.py --out $OUT/e2e.json [--time-budget 480]

Model: an mlx-lm Llama with random weights, hidden 4096, 32 layers, 32 query / 8 KV heads,
head_dim 128, intermediate 14336, bfloat16, vocab 8192 (so the bundled model's tokenizer can
detokenize); ``--layers/--hidden/--intermediate`` shrink it (CPU smoke run:
``--layers 2 --hidden 512 --intermediate 1024 --depths 256 --concurrency 1,2 --arms fp16,kvarn-k4v2``).

Cells, depth by depth (``--depths``): first mlx-lm's own caches (``--mlxlm``), then each arm
(``--arms``) through the project's engine (``make_engine(loaded, SchedulerConfig, KVConfig,
ApcConfig(enabled=False))``, driven only by ``add_request``/``step``/``abort_request``).

Engine arm at depth d, C = the largest level of ``--concurrency``:
  * prompt length P >= d chosen so that the cache length P + k reaches a multiple of the KVarN tile
    (128) at decode step k = warm + steps // 2 + 1 of the first level (each row's tail then fills and
    every row commits a tile in that one step, inside the timed window);
  * one request alone, twice if the first is quick (TTFT at c=1; the first also compiles kernels);
  * C requests added at once, every prompt's next chunk runs in each step
    (max_num_batched_tokens = C * chunk + C): prefill tok/s = C * P / wall time until every request
    has its first token; TTFT mean and max over the C requests;
  * decode with all C rows, then requests aborted down to each lower level, decoding again.
    ``warm`` steps per level are not timed (the last one records the graph).
mlx-lm at depth d (variants): ``batch`` = ``mlx_lm.models.cache.BatchKVCache`` (no padding; its mask
goes to the one fused ``mx.fast.scaled_dot_product_attention`` per layer); ``stacked`` = a plain
``KVCache`` whose arrays hold all rows (batch dimension B, no mask). One row of P tokens is prefilled
(chunks of ``--chunk``, timed for reference) and copied into B rows; each decode step is
model -> argmax -> eval -> tolist, exactly B rows, timed alone (``-async``: model -> argmax ->
async_eval, then the previous step's tolist, as ``mlx_lm.generate_step`` pipelines its steps).
An engine arm named ``<arm>-async`` (or every arm with ``--async-scheduling``) runs with
``SchedulerConfig.async_scheduling``; one named ``<arm>-solo`` runs each prompt chunk in its own
forward (``SchedulerConfig.batch_prefill`` False; by default a step's chunks run together); one
named ``<arm>-eager`` builds the decode forward in Python at every step (``compile_decode`` False;
by default it is replayed from a graph compiled per shape bucket).

Figures (JSON ``cells[]``, seconds unless named otherwise):
  decode_tok_per_s   = level / median wall time of the ordinary decode steps at that level; an
                       ordinary step is one around ``engine.step()`` in which every alive row gained
                       exactly one token (exactly ``level`` decoding rows, no prefill) and which is
                       not the tile step. mlx-lm: level / median step wall time.
  tile_step_s        the one step in which the cache length crosses a multiple of 128 (with async
                     scheduling: the call that launched that step, one before the one returning its
                     tokens, where the commit's cost lands) (KVarN: all
                     rows commit a tile; fp16/affine: the same position, for comparison);
                     tile_step_over_median = tile_step_s / median ordinary step.
  amortized_tok_per_s = level / ((127 * median + tile_step_s) / 128): one commit every 128 steps.
  prefill_tok_per_s (C at once), ttft_c1_s (alone; try 1 if there was one, else try 0),
  ttft_batch_mean_s / ttft_batch_max_s (the C requests).
  graph_nodes        primitives in the lazy graph of one decode step's model forward (the logits
                     of the [B, 1] call; mx.export_to_dot), the same count for mlx-lm;
                     step_graph_nodes: the same for the arrays the engine's ``runner._decode``
                     leaves to evaluate (logits + sampling), when that hook exists.
  forward_build_s    Python time inside the model's [B, 1] call (graph build); decode_build_s the
                     same around ``runner._decode`` when it exists.
  kv_bytes           ``engine.runner.kv_nbytes()`` (mlx-lm: the caches' nbytes, buffers allocated).
Ratios in the table (same depth and c; > 1 means the numerator is faster):
  <arm>/fp16   = decode_tok_per_s of that arm / decode_tok_per_s of fp16, both through the engine
                 (kvarn-k4v2/fp16 is the KVarN cost at this shape);
  fp16/mlx-lm  = decode_tok_per_s of the engine's fp16 arm / that of mlx-lm's BatchKVCache
                 (1.0 = the engine adds nothing over mlx-lm's own batched decode).
``--time-budget`` seconds: a cell (arm x depth x c) that the estimate says will not finish in
time is skipped and marked ``skipped`` with the reason; the JSON is rewritten after every cell.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import BatchKVCache, KVCache, make_prompt_cache  # noqa: E402

from bench.device_batching import ARMS  # noqa: E402
from engine.bench import _prompt, _timed_request  # noqa: E402
from engine.engine import make_engine  # noqa: E402
from engine.kv_config import ApcConfig, KVConfig  # noqa: E402
from engine.loader import LoadedModel, load_model  # noqa: E402
from engine.request import Request, RequestId, SamplingParams  # noqa: E402
from engine.scheduler import SchedulerConfig  # noqa: E402

TILE = 128  # KVarN tile (KVConfig's default): the commit step's period
START = time.perf_counter()


def log(*parts: Any) -> None:
    print(f"[{time.perf_counter() - START:7.1f}s {time.strftime('%H:%M:%S')}]", *parts, flush=True)


def elapsed() -> float:
    return time.perf_counter() - START


def arm_flags(arm: str) -> tuple[str, bool, bool, bool]:
    """An engine arm's KV arm and its suffixes, in any order: (base, ``-async``, ``-solo``,
    ``-eager``: the decode forward built in Python at every step, ``--enforce-eager``)."""
    base, flags = arm, set()
    while base.endswith(("-async", "-solo", "-eager")):
        flag = next(f for f in ("-async", "-solo", "-eager") if base.endswith(f))
        flags.add(flag)
        base = base.removesuffix(flag)
    return base, "-async" in flags, "-solo" in flags, "-eager" in flags


def arm_config(name: str) -> KVConfig:
    if name in ARMS:
        return ARMS[name]
    m = re.fullmatch(r"kvarn-k(\d)v(\d)", name) or re.fullmatch(r"affine-(\d)", name)
    if m is None:
        raise SystemExit(f"unknown arm {name!r} (fp16, affine-N, kvarn-kXvY)")
    bits = [int(g) for g in m.groups()]
    return KVConfig("kvarn", bits[0], bits[1]) if name.startswith("kvarn") else KVConfig("affine", bits[0], bits[0])


# --- graph capture -------------------------------------------------------------------------------

def count_nodes(arrays: list) -> tuple[int, dict[str, int]]:
    """(primitive nodes, {label: count}) of the lazy graph of ``arrays`` (mx.export_to_dot)."""
    with tempfile.NamedTemporaryFile("r", suffix=".dot", delete=False) as f:
        path = f.name
    try:
        mx.export_to_dot(path, *arrays)
        text = Path(path).read_text()
    finally:
        os.unlink(path)
    labels = collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', text))
    return sum(labels.values()), dict(labels.most_common())


class Recorder:
    """Set on the model: times every [B, 1] forward (graph build) and, when ``keep`` is set,
    counts the nodes of that forward's lazy logits before anything evaluates them; the other
    forwards (prompt chunks) are timed apart (``chunk_build_s``)."""

    def __init__(self) -> None:
        self.keep = False
        self.reset()

    def reset(self) -> None:
        self.build_s, self.calls, self.graph = 0.0, 0, None
        self.chunk_build_s, self.chunk_calls = 0.0, 0  # the other forwards (prompt chunks)

    def forward(self, call, inputs, args, kwargs):
        if getattr(inputs, "ndim", 0) != 2 or inputs.shape[1] != 1:
            t = time.perf_counter()
            out = call(inputs, *args, **kwargs)
            self.chunk_build_s += time.perf_counter() - t
            self.chunk_calls += 1
            return out
        t = time.perf_counter()
        out = call(inputs, *args, **kwargs)
        self.build_s += time.perf_counter() - t
        self.calls += 1
        if self.keep:
            self.keep = False
            try:
                self.graph = count_nodes([out])
            except Exception:  # noqa: BLE001 (a compiled step's trace: its values cannot be exported)
                self.graph = None
        return out


def recording_llama(recorder: Recorder):
    class Model(llama.Model):
        def __call__(self, inputs, *args, **kwargs):
            return recorder.forward(super().__call__, inputs, args, kwargs)

    # the attention seam patches the module named by type(model).__module__: keep it mlx-lm's llama
    Model.__module__ = llama.__name__
    return Model


class DecodeHook:
    """Optional: times ``engine.runner._decode`` and counts the graph it leaves to evaluate (the
    sampled arrays). Absent or changed signature: reports ``available = False`` / no graph."""

    def __init__(self, engine) -> None:
        self.build_s, self.keep, self.graph = 0.0, False, None
        runner = getattr(engine, "runner", None)
        orig = getattr(runner, "_decode", None)
        self.available = callable(orig)
        if not self.available:
            return

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                self.build_s += time.perf_counter() - t
                if self.keep:
                    self.keep = False
                    self.graph = self._count(args, kwargs)

        runner._decode = timed

    @staticmethod
    def _count(args, kwargs):
        pending = kwargs.get("pending")
        if pending is None:
            pending = next((a for a in reversed(args) if isinstance(a, dict)), None)
        try:
            arrays = [v for obj in (pending or {}).values() for v in vars(obj).values() if isinstance(v, mx.array)]
            return count_nodes(arrays) if arrays else None
        except Exception as exc:  # a changed runner: the model-forward count still stands
            return (None, {"error": f"{type(exc).__name__}: {exc}"})


# --- model ---------------------------------------------------------------------------------------

def build_model(args, recorder: Recorder) -> tuple[LoadedModel, int]:
    mx.random.seed(0)
    margs = llama.ModelArgs(model_type="llama", hidden_size=args.hidden, num_hidden_layers=args.layers,
                            intermediate_size=args.intermediate, num_attention_heads=32, num_key_value_heads=8,
                            rms_norm_eps=1e-5, vocab_size=8192, head_dim=128, max_position_embeddings=65536,
                            rope_theta=500000.0, tie_word_embeddings=False)
    model = recording_llama(recorder)(margs)
    model.set_dtype(getattr(mx, args.dtype))
    mx.eval(model.parameters())
    tokenizer = load_model(None, "float16").tokenizer  # the bundled model's tokenizer (vocab 8192)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    loaded = LoadedModel(model=model, tokenizer=tokenizer, model_id=f"random-llama-{args.layers}L-{args.hidden}",
                         path=Path("/nonexistent"), fingerprint=f"random{args.layers}x{args.hidden}",
                         context_length=65536, compute_dtype=args.dtype, vocab_size=8192)
    return loaded, weights


def environment() -> dict[str, Any]:
    import mlx_lm
    info = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in mx.device_info().items()}
    env = {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "device": str(mx.default_device()),
           "device_info": info, "device_name": info.get("device_name"), "python": platform.python_version(),
           "machine": platform.machine(), "host": platform.node()}
    try:
        env["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).resolve().parents[1], timeout=5).stdout.strip() or None
    except Exception:
        env["git"] = None
    return env


# --- cells ---------------------------------------------------------------------------------------

def prompt_length(depth: int, commit_step: int) -> int:
    """The smallest P >= depth with (P + commit_step) a multiple of the tile."""
    return depth + (-(depth + commit_step)) % TILE


def step_summary(rows: list[dict], level: int) -> dict[str, Any]:
    ordinary = [r for r in rows if r["ok"] and not r["tile_step"]]
    tile = [r for r in rows if r["ok"] and r["tile_step"]]
    d: dict[str, Any] = {"level": level, "steps_timed": len(rows), "steps_ordinary": len(ordinary)}
    if not ordinary:
        d["error"] = "no ordinary decode step (rows did not all advance by one token)"
        return d
    walls = [r["wall"] for r in ordinary]
    med = statistics.median(walls)
    d.update({"median_step_s": med, "mean_step_s": statistics.mean(walls), "min_step_s": min(walls),
              "max_step_s": max(walls), "decode_tok_per_s": level / med,
              "median_forward_build_s": statistics.median(r["forward_build_s"] for r in ordinary)})
    if any(r.get("decode_build_s") is not None for r in ordinary):
        d["median_decode_build_s"] = statistics.median(r["decode_build_s"] or 0.0 for r in ordinary)
    if tile:
        t = tile[0]["wall"]
        d.update({"tile_step_s": t, "tile_step_over_median": t / med,
                  "tile_step_cache_len": tile[0].get("cache_len"),
                  "amortized_tok_per_s": level / (((TILE - 1) * med + t) / TILE)})
    d["steps"] = rows
    return d


def decode_estimate(step1: float, levels: list[int], steps: int, warm: int) -> float:
    """Pessimistic seconds for the decode phase from the c=1 step time."""
    return sum((warm + steps + 1) * min(1.5, max(step1, 0.02) * (1 + lv / 4)) for lv in levels)


def run_engine_cell(loaded, recorder, arm: str, depth: int, levels: list[int], args, save) -> dict:
    base, is_async, solo, eager = arm_flags(arm)
    kv = arm_config(base)
    async_scheduling = args.async_scheduling or is_async
    batch_prefill = not solo
    rng = random.Random(zlib.crc32(f"{arm}-{depth}".encode()))
    commit_k = args.warm + args.steps // 2 + 1
    P = prompt_length(depth, commit_k)
    C = max(levels)
    max_tokens = 8 + sum(args.warm + args.steps + 1 for _ in levels)
    entry: dict[str, Any] = {"kind": "engine", "arm": arm, "depth": depth, "prompt_tokens": P,
                             "levels": list(levels), "commit_step_expected": commit_k, "max_tokens": max_tokens}
    cfg = SchedulerConfig(max_num_seqs=C, max_num_batched_tokens=C * args.chunk + C, prefill_chunk_size=args.chunk,
                          kv_budget_bytes=int(args.kv_budget_gb * 1e9), async_scheduling=async_scheduling,
                          batch_prefill=batch_prefill, compile_decode=not eager)
    entry["async_scheduling"] = async_scheduling
    entry["batch_prefill"] = batch_prefill
    t0 = time.perf_counter()
    engine = make_engine(loaded, cfg, kv, ApcConfig(enabled=False))
    entry["make_engine_s"] = time.perf_counter() - t0
    if args.warm_up:  # as `kvarn serve` does on a GPU before it serves (engine/warm_up.py)
        from engine.warm_up import warm_up

        entry["warm_up"] = warm_up(engine, rows=args.warm_up).as_dict()
        log(f"{arm} {depth}: warm-up {entry['warm_up']}")
    try:
        entry["kv"] = engine.describe_kv()
    except Exception:
        entry["kv"] = {"scheme": kv.scheme, "key_bits": kv.key_bits, "value_bits": kv.value_bits}
    hook = DecodeHook(engine)
    entry["decode_hook"] = hook.available
    mx.reset_peak_memory()
    save(entry)

    # c=1 alone (TTFT; the first try also compiles this shape's kernels)
    for attempt in range(2):
        ttft, after, ntok = _timed_request(engine, _prompt(rng, P, loaded.vocab_size), 4)
        entry[f"ttft_c1_s_try{attempt}"] = ttft
        entry["decode_step_c1_solo_s"] = after / max(ntok, 1)
        log(f"{arm} d={depth}: alone P={P} TTFT {ttft:.3f} s (try {attempt}), "
            f"c=1 step {entry['decode_step_c1_solo_s'] * 1e3:.1f} ms")
        if ttft > args.retry_ttft_below:
            break
    ttft = entry.get("ttft_c1_s_try1", entry["ttft_c1_s_try0"])
    entry["ttft_c1_s"] = ttft
    entry["prefill_c1_tok_per_s"] = P / ttft

    # the largest C whose prefill and decode fit the time left
    left = args.time_budget - elapsed()
    fits = [c for c in sorted(levels, reverse=True)
            if 1.1 * c * ttft + decode_estimate(entry["decode_step_c1_solo_s"], [l for l in levels if l <= c],
                                                args.steps, args.warm) + 10 < left]
    if not fits:
        entry["skipped"] = f"no time for any level ({left:.0f} s left, TTFT alone {ttft:.2f} s)"
        entry["levels_skipped"] = list(levels)
        log(f"{arm} d={depth}: skipped: {entry['skipped']}")
        return finish_cell(engine, entry, [], save)
    if fits[0] < C:
        entry["levels_skipped"] = [l for l in levels if l > fits[0]]
        entry["skip_reason"] = f"time budget ({left:.0f} s left, TTFT alone {ttft:.2f} s)"
        levels = [l for l in levels if l <= fits[0]]
        C = fits[0]
        log(f"{arm} d={depth}: levels {entry['levels_skipped']} skipped ({entry['skip_reason']})")
    entry["levels_run"] = sorted(levels, reverse=True)

    # C requests at once
    reqs = [Request(RequestId(f"{arm}-{depth}-{i}"), _prompt(rng, P, loaded.vocab_size),
                    SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)) for i in range(C)]
    first: dict[str, float] = {}
    walls = []
    t0 = time.perf_counter()
    forwards0, chunks0 = engine.runner.prefill_forwards, engine.runner.prefill_chunks
    for r in reqs:
        engine.add_request(r)
    while len(first) < C:
        ts = time.perf_counter()
        engine.step()
        now = time.perf_counter()
        walls.append(now - ts)
        for r in reqs:
            if r.output_ids and r.request_id not in first:
                first[r.request_id] = now - t0
        failed = [r for r in reqs if r.is_finished and not r.output_ids]  # the step failed them (e.g. out of memory)
        if failed:
            for r in reqs:
                engine.abort_request(r.request_id)
            while engine.has_work():
                engine.step()
            raise RuntimeError(f"{len(failed)} of {C} prompts failed in prefill ({failed[0].finish_reason})")
        if now - t0 > 4 * args.time_budget:
            raise RuntimeError("prefill did not finish")
    entry["prefill_all_s"] = time.perf_counter() - t0
    entry["prefill_steps"] = len(walls)
    entry["prefill_forwards"] = engine.runner.prefill_forwards - forwards0
    entry["prefill_chunks"] = engine.runner.prefill_chunks - chunks0
    entry["prefill_max_step_s"] = max(walls)
    entry["prefill_tok_per_s"] = C * P / entry["prefill_all_s"]
    entry["ttft_batch_mean_s"] = statistics.mean(first.values())
    entry["ttft_batch_max_s"] = max(first.values())
    entry["kv_bytes_after_prefill"] = engine.runner.kv_nbytes()
    log(f"{arm} d={depth}: {C} prompts of {P} in {entry['prefill_all_s']:.2f} s "
        f"({entry['prefill_tok_per_s']:.0f} tok/s, TTFT mean {entry['ttft_batch_mean_s']:.2f} s, "
        f"{entry['prefill_chunks']} chunks in {entry['prefill_forwards']} forwards), "
        f"KV {entry['kv_bytes_after_prefill'] / 1e9:.2f} GB")
    save(entry)

    # decode at each level, aborting down
    alive = list(reqs)
    entry["decode"] = []
    for li, level in enumerate(sorted(levels, reverse=True)):
        n = args.steps + (1 if li == 0 else 0)
        est = decode_estimate(entry["decode_step_c1_solo_s"], [level], args.steps, args.warm)
        if li > 0 and args.time_budget - elapsed() < est:
            entry.setdefault("levels_skipped", []).append(level)
            entry["skip_reason"] = "time budget"
            log(f"{arm} d={depth} c={level}: skipped (time budget)")
            continue
        for r in alive[level:]:
            engine.abort_request(r.request_id)
        alive = alive[:level]
        rows = []
        for i in range(args.warm + n):
            before = [len(r.output_ids) for r in alive]
            keep = i == args.warm - 1
            recorder.reset()
            recorder.keep = keep
            hook.build_s, hook.keep = 0.0, keep
            ts = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - ts
            recorder.keep = hook.keep = False
            ok = all(len(r.output_ids) == b + 1 for r, b in zip(alive, before))
            cache_len = len(alive[0].prompt_ids) + len(alive[0].output_ids) - 1
            if getattr(engine, "_ahead", None) is not None:  # async scheduling: this call launched the next step
                cache_len += 1  # (the step whose work it dispatched, so a commit's cost lands in this call)
            if keep:
                graph, step_graph = recorder.graph, hook.graph
            if i >= args.warm:
                rows.append({"wall": wall, "ok": ok, "cache_len": cache_len, "tile_step": cache_len % TILE == 0,
                             "forward_build_s": recorder.build_s,
                             "decode_build_s": hook.build_s if hook.available else None})
        d = step_summary(rows, level)
        d["kv_bytes"] = engine.runner.kv_nbytes()
        d["graph_nodes"], d["graph_labels"] = graph if graph else (None, None)
        d["step_graph_nodes"], d["step_graph_labels"] = step_graph if step_graph else (None, None)
        entry["decode"].append(d)
        entry["peak_memory_bytes"] = mx.get_peak_memory()
        if "median_step_s" in d:
            tile = (f"; tile step {d['tile_step_s'] * 1e3:.1f} ms = {d['tile_step_over_median']:.2f}x"
                    if "tile_step_s" in d else "")
            log(f"{arm} d={depth} c={level}: median step {d['median_step_s'] * 1e3:.1f} ms -> "
                f"{d['decode_tok_per_s']:.1f} tok/s (max {d['max_step_s'] * 1e3:.0f} ms, forward build "
                f"{d['median_forward_build_s'] * 1e3:.1f} ms{tile}); nodes {d['graph_nodes']}, "
                f"KV {d['kv_bytes'] / 1e9:.2f} GB")
        else:
            log(f"{arm} d={depth} c={level}: {d.get('error')}")
        save(entry)
    return finish_cell(engine, entry, alive, save)


def finish_cell(engine, entry, alive, save) -> dict:
    for r in alive:
        engine.abort_request(r.request_id)
    has_work = getattr(engine, "has_work", lambda: True)
    for _ in range(4):  # aborted rows are freed at once; a step or two settles the scheduler
        if not has_work():
            break
        engine.step()
    entry["peak_memory_bytes"] = mx.get_peak_memory()
    save(entry)
    del engine
    mx.clear_cache()
    return entry


def mlxlm_caches(variant: str, row: list, B: int, P: int, capacity: int) -> list:
    """One cache per layer holding B copies of the prefilled row, room for ``capacity`` tokens
    (no reallocation while timed)."""
    caches = []
    for c in row:
        k, v = c.keys[..., :P, :], c.values[..., :P, :]
        _, H, _, D = k.shape
        pad = mx.zeros((B, H, capacity - P, D), k.dtype)
        keys = mx.concatenate([mx.broadcast_to(k, (B, H, P, D)), pad], axis=2)
        values = mx.concatenate([mx.broadcast_to(v, (B, H, P, D)), pad], axis=2)
        mx.eval(keys, values)
        if variant == "batch":
            cache = BatchKVCache([0] * B)
            cache.keys, cache.values = keys, values
            cache.offset = cache.offset + P
            cache._idx = P
        else:
            cache = KVCache()
            cache.keys, cache.values, cache.offset = keys, values, P
        caches.append(cache)
    return caches


def run_mlxlm_cell(loaded, recorder, variant: str, depth: int, levels: list[int], args, save) -> dict:
    commit_k = args.warm + args.steps // 2 + 1
    P = prompt_length(depth, commit_k)  # the engine arms' prompt length at this depth
    model = loaded.model
    entry: dict[str, Any] = {"kind": "mlx-lm", "arm": f"mlxlm-{variant}", "depth": depth, "prompt_tokens": P,
                             "levels": list(levels),
                             "cache": "BatchKVCache" if variant == "batch" else "KVCache (batch dim B)"}
    mx.reset_peak_memory()
    rng = random.Random(zlib.crc32(f"mlxlm-{depth}".encode()))
    tokens = _prompt(rng, P, loaded.vocab_size)
    times = []
    for _ in range(2):  # the first also compiles
        row = make_prompt_cache(model)
        t0 = time.perf_counter()
        for s in range(0, P, args.chunk):
            model(mx.array(tokens[s: s + args.chunk], dtype=mx.int32)[None], cache=row)
            mx.eval([c.keys for c in row] + [c.values for c in row])
        times.append(time.perf_counter() - t0)
        if times[0] > args.retry_ttft_below:
            break
    entry["prefill_one_row_s"] = times[-1]
    entry["prefill_tok_per_s"] = P / times[-1]
    log(f"mlx-lm {variant} d={depth}: one row of {P} prefilled in {times[-1]:.2f} s ({P / times[-1]:.0f} tok/s)")
    entry["decode"] = []
    for level in sorted(levels, reverse=True):
        if args.time_budget - elapsed() < 15:
            entry.setdefault("levels_skipped", []).append(level)
            entry["skip_reason"] = "time budget"
            log(f"mlx-lm {variant} d={depth} c={level}: skipped (time budget)")
            continue
        n = args.steps
        caches = mlxlm_caches(variant.removesuffix("-async"), row, level, P, P + args.warm + n + 8)
        tok = mx.array(_prompt(rng, level, loaded.vocab_size), dtype=mx.int32)[:, None]
        rows, graph, prev = [], None, None
        for i in range(args.warm + n):
            recorder.reset()
            recorder.keep = i == args.warm - 1
            ts = time.perf_counter()
            logits = model(tok, cache=caches)
            nxt = mx.argmax(logits[:, -1, :], axis=-1)
            if variant.endswith("-async"):  # as mlx_lm.generate_step: launch the next, then read the last
                mx.async_eval(nxt)
                if prev is not None:
                    prev.tolist()
                prev = nxt
            else:
                mx.eval(nxt)
                nxt.tolist()
            wall = time.perf_counter() - ts
            recorder.keep = False
            tok = nxt[:, None].astype(mx.int32)
            if i == args.warm - 1:
                graph = recorder.graph
            if i >= args.warm:
                rows.append({"wall": wall, "ok": True, "tile_step": False, "forward_build_s": recorder.build_s})
        d = step_summary(rows, level)
        d["kv_bytes"] = sum(c.nbytes for c in caches)
        d["graph_nodes"], d["graph_labels"] = graph if graph else (None, None)
        entry["decode"].append(d)
        del caches, logits, nxt
        mx.clear_cache()
        log(f"mlx-lm {variant} d={depth} c={level}: median step {d['median_step_s'] * 1e3:.1f} ms -> "
            f"{d['decode_tok_per_s']:.1f} tok/s (forward build {d['median_forward_build_s'] * 1e3:.1f} ms, "
            f"nodes {d['graph_nodes']}, SDPA {(d['graph_labels'] or {}).get('ScaledDotProductAttention')})")
        entry["peak_memory_bytes"] = mx.get_peak_memory()
        save(entry)
    del row
    mx.clear_cache()
    return entry


# --- report --------------------------------------------------------------------------------------

def rate(cells: list[dict], arm: str, depth: int, c: int) -> float | str | None:
    """decode tok/s of (arm, depth, c); "skip" if skipped, None if never asked or failed."""
    for e in cells:
        if e.get("arm") != arm or e.get("depth") != depth:
            continue
        for d in e.get("decode", []):
            if d["level"] == c and "decode_tok_per_s" in d:
                return d["decode_tok_per_s"]
        if c in e.get("levels_skipped", []) or e.get("skipped"):
            return "skip"
        return "err" if "error" in e else None
    return None


def fmt(x, digits=1) -> str:
    if x is None:
        return "-"
    return x if isinstance(x, str) else f"{x:,.{digits}f}"


def markdown(report: dict, args) -> str:
    cells = report["cells"]
    arms = args.arms.split(",")
    mlxlm = [f"mlxlm-{v}" for v in args.mlxlm.split(",") if v]
    others = [a for a in arms if a != "fp16"]
    head = ["depth", "c"] + [m.replace("mlxlm-", "mlx-lm ") for m in mlxlm] + [f"our {a}" if a == "fp16" else a
                                                                             for a in arms]
    head += [f"{a}/fp16" for a in others if "fp16" in arms]
    if "fp16" in arms and "mlxlm-batch" in mlxlm:
        head.append("fp16/mlx-lm")
    lines = ["decode tok/s (median step; ratios: same depth and c)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for depth in (int(x) for x in args.depths.split(",")):
        for c in sorted(int(x) for x in args.concurrency.split(",")):
            vals = {a: rate(cells, a, depth, c) for a in mlxlm + arms}
            row = [str(depth), str(c)] + [fmt(vals[a]) for a in mlxlm + arms]
            num = lambda a: vals.get(a) if isinstance(vals.get(a), float) else None  # noqa: E731
            if "fp16" in arms:
                row += [fmt(num(a) / num("fp16"), 3) if num(a) and num("fp16") else "-" for a in others]
                if "mlxlm-batch" in mlxlm:
                    row.append(fmt(num("fp16") / num("mlxlm-batch"), 3) if num("fp16") and num("mlxlm-batch")
                               else "-")
            lines.append("| " + " | ".join(row) + " |")
    lines += ["", "per engine arm at the largest c run: prefill (C at once), TTFT, tile step vs median step, "
                  "forward graph nodes, KV held", "",
              "| arm | depth | P | C | prefill tok/s | TTFT c=1 s | TTFT mean at C s | median step ms | "
              "tile step ms (x) | nodes | KV GB | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in cells:
        if e.get("kind") != "engine":
            continue
        d = (e.get("decode") or [{}])[0]
        tile = (f"{d['tile_step_s'] * 1e3:.1f} ({d['tile_step_over_median']:.2f}x)" if "tile_step_s" in d else "-")
        med = d.get("median_step_s")
        lines.append(f"| {e['arm']} | {e['depth']} | {e.get('prompt_tokens', '-')} | {d.get('level', '-')} | "
                     f"{fmt(e.get('prefill_tok_per_s'), 0)} | {fmt(e.get('ttft_c1_s'), 3)} | "
                     f"{fmt(e.get('ttft_batch_mean_s'), 2)} | {fmt(med * 1e3 if med else None)} | {tile} | "
                     f"{fmt(d.get('graph_nodes'), 0)} | "
                     f"{fmt(d['kv_bytes'] / 1e9 if 'kv_bytes' in d else None, 2)} | "
                     f"{e.get('skipped') or e.get('error') or ''}"
                     f"{' skipped c=' + ','.join(map(str, e['levels_skipped'])) if e.get('levels_skipped') else ''} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--arms", default="fp16,kvarn-k4v2,affine-4")
    p.add_argument("--depths", default="4096,16384")
    p.add_argument("--concurrency", default="1,16,32")
    p.add_argument("--mlxlm", default="batch,stacked", help="mlx-lm cache variants (batch, stacked, and either with -async: the next step launched "
                        "before the last one's tokens are read, as mlx_lm.generate_step; '' for none)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="the engine arms run with SchedulerConfig.async_scheduling")
    p.add_argument("--steps", type=int, default=12, help="timed decode steps per level")
    p.add_argument("--warm-up", type=int, default=2, metavar="ROWS",
                   help="engine/warm_up.py's workload with this many decode rows after each engine is made, as "
                        "kvarn serve runs it on a GPU (0: none)")
    p.add_argument("--warm", type=int, default=3, help="untimed decode steps per level (the last records the graph)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (the engine's prefill_chunk_size)")
    p.add_argument("--time-budget", type=float, default=480.0, help="seconds from start; later cells are skipped")
    p.add_argument("--retry-ttft-below", type=float, default=10.0,
                   help="repeat the solo request (warm TTFT) only if the first took less than this many seconds")
    p.add_argument("--kv-budget-gb", type=float, default=200.0)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    if args.warm < 1 or args.steps < 2:
        raise SystemExit("--warm >= 1 and --steps >= 2")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    levels = sorted({int(x) for x in args.concurrency.split(",")})
    depths = [int(x) for x in args.depths.split(",")]
    arms = args.arms.split(",")
    for a in arms:
        arm_config(arm_flags(a)[0])
    variants = [v for v in args.mlxlm.split(",") if v]
    if any(v.removesuffix("-async") not in ("batch", "stacked") for v in variants):
        raise SystemExit("--mlxlm takes batch, stacked (either with -async)")

    recorder = Recorder()
    env = environment()
    log("environment", json.dumps(env))
    loaded, weights = build_model(args, recorder)
    log(f"model: {weights / 1e9:.2f} GB of {args.dtype} weights, {args.layers} layers, hidden {args.hidden}")
    report: dict[str, Any] = {"env": env, "args": vars(args), "weights_bytes": weights, "tile": TILE,
                              "cells": []}

    def save(entry: dict | None = None) -> None:
        if entry is not None and not any(e is entry for e in report["cells"]):
            report["cells"].append(entry)
        report["elapsed_s"] = elapsed()
        out.write_text(json.dumps(report, indent=1) + "\n")

    solo: dict[str, tuple[int, float]] = {}  # arm -> (prompt tokens, TTFT alone) at the last depth
    for depth in depths:
        jobs = [("mlxlm", v) for v in variants] + [("engine", a) for a in arms]
        for kind, name in jobs:
            left = args.time_budget - elapsed()
            label = f"mlxlm-{name}" if kind == "mlxlm" else name
            need = 30.0
            if kind == "engine" and name in solo:  # the solo request alone, scaled from the last depth
                P0, t0 = solo[name]
                need += 1.2 * t0 * (prompt_length(depth, args.warm + args.steps // 2 + 1) / P0) ** 1.5
            if left < need:
                save({"kind": kind, "arm": label, "depth": depth, "levels": levels,
                      "skipped": f"time budget ({left:.0f} s left, about {need:.0f} s needed)",
                      "levels_skipped": levels})
                log(f"skip {label} d={depth} ({left:.0f} s left, about {need:.0f} s needed)")
                continue
            log(f"cell {label} d={depth} levels {levels} ({left:.0f} s left)")
            try:
                if kind == "mlxlm":
                    run_mlxlm_cell(loaded, recorder, name, depth, levels, args, save)
                else:
                    e = run_engine_cell(loaded, recorder, name, depth, levels, args, save)
                    if e.get("ttft_c1_s"):
                        solo[name] = (e["prompt_tokens"], e["ttft_c1_s"])
            except Exception as exc:
                import traceback
                traceback.print_exc()
                entry = next((e for e in reversed(report["cells"]) if e.get("arm") == label
                              and e.get("depth") == depth), None)
                if entry is None:
                    entry = {"kind": kind, "arm": label, "depth": depth, "levels": levels}
                entry["error"] = f"{type(exc).__name__}: {exc}"
                save(entry)
            gc.collect()
            mx.clear_cache()
    report["markdown"] = markdown(report, args)
    save()
    log("done")
    print(report["markdown"], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
