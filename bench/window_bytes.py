"""KV bytes of one row generating 3x past its window (``--max-kv-size``), through the real engine.

For each arm, one greedy request (a ``--prompt-tokens`` prompt of held-out text, then
``--windows`` x the window generated, ``ignore_eos``) on the bundled model (context 4,096);
after every step the bytes rows hold (``ModelRunner.kv_nbytes``: the pool's held blocks and
windows for KVarN, the rotating caches' arrays for fp16) and, for KVarN, the pool's allocated
arrays. Reports them at every window's worth of tokens, their maximum from the first window on,
and the price admission charges (``Pricing.sequence_bytes``). ``--check-mlx-lm`` also runs
mlx-lm's own ``generate_step(..., max_kv_size=N)`` and counts the fp16 arm's tokens that differ.

    python bench/window_bytes.py --window 1024 --windows 3 --check-mlx-lm --json bench/results/window_bytes.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.blas import maybe_reexec_with_openblas, openblas_active  # noqa: E402

HELDOUT = Path(__file__).resolve().parents[2] / "shared" / "models" / "heldout" / "heldout_pydoc.txt"
ARMS = {"kvarn k4v2 windowed": ("kvarn", True), "fp16 windowed": ("fp16", True),
        "kvarn k4v2 unbounded": ("kvarn", False)}


def prompt_ids(loaded, tokens: int) -> list[int]:
    if HELDOUT.exists():
        ids = loaded.tokenizer.encode(HELDOUT.read_text(errors="replace"), add_special_tokens=False)
    else:  # outside the project's workspace: the shipped held-out prompts
        from engine.kld import PROMPTS_FILE

        text = " ".join(p["text"] for p in json.loads(PROMPTS_FILE.read_text())["prompts"])
        ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    return ids[:tokens]


def run_arm(loaded, scheme: str, window: int | None, prompt: list[int], gen: int) -> dict:
    from engine.engine import make_engine
    from engine.kv_config import ApcConfig, KVConfig
    from engine.request import Request, RequestId, SamplingParams
    from engine.scheduler import SchedulerConfig

    engine = make_engine(loaded, SchedulerConfig(max_num_seqs=1), KVConfig(scheme, max_kv_size=window),
                         ApcConfig(enabled=False))
    pool = engine.runner.store.pool
    request = Request(RequestId("w"), list(prompt), SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
    engine.add_request(request)
    held, allocated = [], []
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
        if not request.is_finished:
            held.append(engine.runner.kv_nbytes())
            allocated.append(pool.nbytes() if pool is not None else held[-1])
    seconds = time.perf_counter() - start
    return {"scheme": scheme, "max_kv_size": window, "tokens": list(request.output_ids), "held": held,
            "allocated": allocated, "price": engine.pricing.sequence_bytes(len(prompt) + gen), "seconds": seconds}


def mlx_lm_tokens(loaded, prompt: list[int], gen: int, window: int) -> list[int]:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(prompt), loaded.model, max_tokens=gen, max_kv_size=window)]


def summarize(arm: dict, window: int, prompt_tokens: int) -> dict:
    """Bytes at every window's worth of sequence, and the most held from the first window on."""
    marks = {}
    for t in range(window, prompt_tokens + len(arm["held"]) + 1, window):
        step = t - prompt_tokens  # after step i (0: the prompt) the row holds prompt + i tokens
        if 0 <= step < len(arm["held"]):
            marks[t] = {"held": arm["held"][step], "allocated": arm["allocated"][step]}
    first = max(window - prompt_tokens, 0)
    return {"marks": marks, "max_held_after_window": max(arm["held"][first:]),
            "max_allocated_after_window": max(arm["allocated"][first:]), "price": arm["price"],
            "seconds": round(arm["seconds"], 1), "tokens_per_s": round(len(arm["held"]) / arm["seconds"], 1)}


def to_markdown(report: dict) -> str:
    w = report["window"]
    lines = [f"`bench/window_bytes.py` on `{report['model']}` (context {report['context']}), "
             f"{report['prompt_tokens']} prompt tokens + {report['generated']} generated ({report['windows']}x the "
             f"window), `--max-kv-size {w}`, compute {report['compute_dtype']}, OpenBLAS "
             f"{'on' if report['openblas'] else 'off'}; bytes rows hold (allocated) in MiB:", "",
             "| arm | " + " | ".join(f"at {t:,} tokens" for t in report["arms"][next(iter(report["arms"]))]["marks"])
             + " | max after the window | priced | tok/s |",
             "|---" * (len(report["arms"][next(iter(report["arms"]))]["marks"]) + 4) + "|"]
    mib = 2 ** 20
    for name, s in report["arms"].items():
        cells = [f"{m['held'] / mib:.2f} ({m['allocated'] / mib:.2f})" for m in s["marks"].values()]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {s['max_held_after_window'] / mib:.2f} "
                     f"({s['max_allocated_after_window'] / mib:.2f}) | {s['price'] / mib:.2f} | {s['tokens_per_s']} |")
    if "mlx_lm_differing_tokens" in report:
        lines += ["", f"fp16 windowed vs mlx-lm `generate_step(..., max_kv_size={w})`: "
                      f"{report['mlx_lm_differing_tokens']} of {report['generated']} greedy tokens differ."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--windows", type=int, default=3, help="generate this many windows' worth of tokens")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of: {', '.join(ARMS)}")
    parser.add_argument("--check-mlx-lm", action="store_true")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    maybe_reexec_with_openblas()
    from engine.loader import load_model

    loaded = load_model()
    gen = args.windows * args.window
    if args.prompt_tokens + gen > loaded.context_length:
        raise SystemExit(f"prompt + {gen} generated exceeds the context ({loaded.context_length})")
    prompt = prompt_ids(loaded, args.prompt_tokens)
    report = {"model": loaded.model_id, "context": loaded.context_length, "compute_dtype": loaded.compute_dtype,
              "openblas": openblas_active(), "window": args.window, "windows": args.windows,
              "prompt_tokens": len(prompt), "generated": gen, "arms": {}}
    runs = {}
    for name in (a.strip() for a in args.arms.split(",")):
        scheme, windowed = ARMS[name]
        runs[name] = run_arm(loaded, scheme, args.window if windowed else None, prompt, gen)
        report["arms"][name] = summarize(runs[name], args.window, len(prompt))
        print(f"{name}: {report['arms'][name]}", file=sys.stderr)
    if args.check_mlx_lm and "fp16 windowed" in runs:
        want = mlx_lm_tokens(loaded, prompt, gen, args.window)
        report["mlx_lm_differing_tokens"] = sum(a != b for a, b in zip(runs["fp16 windowed"]["tokens"], want)) \
            + abs(len(want) - gen)
    markdown = to_markdown(report)
    print(markdown)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
