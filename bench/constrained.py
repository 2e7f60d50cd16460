"""Structured outputs: what grammar-constrained rows cost the engine, on one model.

In-process (the real engine: continuous batching, masks on the worker thread; no HTTP), the
prefix cache off. For each concurrency level in ``--levels`` (default 1 and 16) and each share
of constrained rows in ``--shares`` (0%, 50%, 100%), ``level`` chat requests arrive together;
the constrained ones carry a JSON schema (an object holding an array of at least 64 records, so
no row can finish before ``--max-tokens``) and the others ignore EOS: every row generates exactly
``--max-tokens`` tokens, greedy. At level 1 two requests run one after the other (so 50% means
one of them). The configurations run round-robin, ``--repeats`` rounds (medians reported), so
drift of the machine hits them alike; the ratio to the unconstrained run is taken per round. Reported per configuration:
aggregate tokens/s (generated tokens over wall time, prefill included), decode-phase tokens/s
(once every row has its first token), and relative to the same level with no constrained row.

Also measured: the llguidance tokenizer's build time (once per server), the time to compile
each JSON schema of the test suite (``tests/server/schemas.py``) and the benchmark's own, each
on a fresh compiler (no cache); and per constrained token, the worker's mask time, the part of
it the engine thread waited for (not hidden behind the forward), and the consume time.

    python bench/constrained.py                     # ~4 min on 2 CPU cores (an otherwise idle machine)
    python bench/constrained.py --levels 1,16 --repeats 5 --max-tokens 128 --out bench/results/constrained-cpu

Writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.blas import maybe_reexec_with_openblas, openblas_active  # noqa: E402

maybe_reexec_with_openblas()

import mlx.core as mx  # noqa: E402

from engine.constraints import ConstraintCompiler, GrammarSpec  # noqa: E402
from engine.engine import Engine, make_engine  # noqa: E402
from engine.kv_config import ApcConfig, KVConfig  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.request import Request, RequestId, SamplingParams  # noqa: E402
from engine.scheduler import SchedulerConfig  # noqa: E402

RECORDS = {"type": "object", "properties": {"records": {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                                     "name": {"type": "string", "maxLength": 24},
                                     "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                                     "ok": {"type": "boolean"}},
    "required": ["id", "name", "tags", "ok"], "additionalProperties": False}}},
    "required": ["records"], "additionalProperties": False}
QUESTIONS = ["List the files of a project as JSON records.", "Describe three Linux commands as JSON.",
             "Give me an inventory as JSON.", "Export the users table as JSON records."]


def run_level(engine: Engine, prompts: list[list[int]], constraint, level: int, share: float,
              max_tokens: int) -> dict[str, float]:
    """``max(level, 2)`` requests, at most ``level`` in flight (a new one starts when one ends:
    at level 1 they run one after the other), ``round(count * share)`` of them constrained;
    rates and mask stats."""
    count = max(level, 2)
    constrained = round(count * share)
    stats = engine.runner.grammars.stats
    before = (stats.masks, stats.mask_s, stats.wait_s, stats.consume_s)
    requests = []
    for i in range(count):
        grammar = constraint if (i * constrained) % count < constrained else None  # spread evenly
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=grammar is None, constraint=grammar)
        requests.append(Request(RequestId(f"b{level}-{share}-{i}-{time.monotonic_ns()}"),
                                prompts[(i // 2) % len(prompts)], params))
    assert sum(r.params.constraint is not None for r in requests) == constrained
    queue = list(requests)
    start = time.perf_counter()
    all_in, tokens_at_all_in = None, 0
    while queue or engine.has_work():
        while queue and engine.num_running + engine.num_waiting < level:
            engine.add_request(queue.pop(0))
        engine.step()
        if all_in is None and not queue and all(r.output_ids for r in requests):
            all_in, tokens_at_all_in = time.perf_counter(), sum(len(r.output_ids) for r in requests)
    end = time.perf_counter()
    total = sum(len(r.output_ids) for r in requests)
    assert total == count * max_tokens, f"a row ended early: {[len(r.output_ids) for r in requests]}"
    masks = stats.masks - before[0]
    return {"level": level, "share": share, "requests": count, "constrained_rows": constrained, "tokens": total,
            "seconds": end - start, "tokens_per_s": total / (end - start),
            "decode_tokens_per_s": (total - tokens_at_all_in) / (end - all_in) if all_in and end > all_in else 0.0,
            "masks": masks, "mask_ms_per_token": 1e3 * (stats.mask_s - before[1]) / masks if masks else 0.0,
            "wait_ms_per_token": 1e3 * (stats.wait_s - before[2]) / masks if masks else 0.0,
            "consume_ms_per_token": 1e3 * (stats.consume_s - before[3]) / masks if masks else 0.0}


def compile_times(loaded) -> dict[str, object]:
    """Tokenizer build once, then every schema on a fresh compiler (nothing cached)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.server.schemas import SCHEMAS

    start = time.perf_counter()
    ConstraintCompiler(loaded.tokenizer, loaded.vocab_size).lltokenizer()
    tokenizer_s = time.perf_counter() - start
    times = {}
    for name, schema in {**SCHEMAS, "bench_records": RECORDS}.items():
        compiler = ConstraintCompiler(loaded.tokenizer, loaded.vocab_size)
        compiler.lltokenizer()
        times[name] = compiler.compile(GrammarSpec.json_schema(schema)).compile_s
    values = sorted(times.values())
    return {"tokenizer_build_s": tokenizer_s, "schemas": times, "median_s": statistics.median(values),
            "max_s": values[-1], "min_s": values[0]}


def _ratio(row: dict, key: str) -> str:
    low, high = row[key + "_range"]
    return f"{row[key]:.3f} [{low:.2f}-{high:.2f}]" if row["share"] else "1"


def markdown(report: dict) -> str:
    lines = [f"model `{report['model']}`, KV {report['kv_layout']}, device {report['device']}, OpenBLAS "
             f"{'on' if report['openblas'] else 'off'}, {report['max_tokens']} tokens per row, greedy; medians of "
             f"{report['repeats']} rounds; \"vs 0%\": the median of each round's ratio to that round's unconstrained "
             f"run (range in brackets)", "",
             "| concurrency | constrained requests | aggregate tok/s | vs 0% | decode-phase tok/s | vs 0% | "
             "mask ms/token (worker) | waited ms/token (engine thread) |",
             "|---|---|---|---|---|---|---|---|"]
    for row in report["results"]:
        lines.append(f"| {row['level']} | {row['constrained_rows']} of {row['requests']} ({row['share']:.0%}) | "
                     f"{row['tokens_per_s']:.1f} | {_ratio(row, 'vs_unconstrained')} | "
                     f"{row['decode_tokens_per_s']:.1f} | {_ratio(row, 'decode_vs_unconstrained')} | "
                     f"{row['mask_ms_per_token']:.3f} | "
                     f"{row['wait_ms_per_token']:.3f} |")
    c = report["compile"]
    lines += ["", f"llguidance tokenizer build (once per server): {c['tokenizer_build_s'] * 1e3:.1f} ms; "
                  f"schema compile (the {len(c['schemas'])} schemas, fresh compiler each): median "
                  f"{c['median_s'] * 1e3:.2f} ms, max {c['max_s'] * 1e3:.2f} ms"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="an mlx-lm model folder (default: the bundled model)")
    parser.add_argument("--levels", default="1,16")
    parser.add_argument("--shares", default="0,0.5,1")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kv-scheme", default="kvarn", choices=["kvarn", "fp16", "affine"])
    parser.add_argument("--out", default="bench/results/constrained-cpu")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    shares = [float(x) for x in args.shares.split(",")]
    loaded = load_model(args.model)
    engine = make_engine(loaded, SchedulerConfig(max_num_seqs=max(levels), max_num_batched_tokens=1024 + max(levels)),
                         KVConfig(args.kv_scheme), ApcConfig(enabled=False))
    tok = loaded.tokenizer
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
               for q in QUESTIONS]
    compiled = compile_times(loaded)
    constraint = ConstraintCompiler(tok, loaded.vocab_size).compile(GrammarSpec.json_schema(RECORDS))
    for level in levels:  # warm-up: first calls at each batch shape, the mask worker
        run_level(engine, prompts, constraint, level, 0.5, 8)
    runs: dict[tuple[int, float], list[dict]] = {(lv, sh): [] for lv in levels for sh in shares}
    for repeat in range(args.repeats):
        for key in runs:
            runs[key].append(run_level(engine, prompts, constraint, *key, args.max_tokens))
            row = runs[key][-1]
            print(f"repeat {repeat}: c={key[0]} constrained {key[1]:.0%}: {row['tokens_per_s']:.1f} tok/s "
                  f"(mask {row['mask_ms_per_token']:.3f} ms/token, waited {row['wait_ms_per_token']:.3f})", flush=True)
    results = []
    for (level, share), rows in runs.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], float)}
        results.append({**rows[0], **med, "runs": rows})
    for row in results:  # paired: each round's ratio to the unconstrained run of the same round
        base = next(r for r in results if r["level"] == row["level"] and r["share"] == 0.0)
        for key, rate in (("vs_unconstrained", "tokens_per_s"), ("decode_vs_unconstrained", "decode_tokens_per_s")):
            ratios = sorted(a[rate] / b[rate] for a, b in zip(row["runs"], base["runs"]))
            row[key], row[key + "_range"] = statistics.median(ratios), (ratios[0], ratios[-1])
    report = {"model": loaded.model_id, "kv_layout": engine.layout.name, "device": f"{mx.default_device()} "
              f"({platform.machine()})", "openblas": openblas_active(), "max_tokens": args.max_tokens,
              "repeats": args.repeats, "results": results, "compile": compiled,
              "command": " ".join(["python", *sys.argv])}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
