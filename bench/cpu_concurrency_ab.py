"""Decode-phase tokens/s of fp16 and KVarN k4v2 at one concurrency level on the CPU, the arms
alternating in one process (``bench/concurrency.sh`` runs its layouts one after another).

    flock /tmp/kvarn-bench.lock python3 bench/cpu_concurrency_ab.py --level 16 --rounds 5 \\
        --json-out bench/results/cpu-concurrency-ab.json

Each arm is an engine made as ``kvarn bench --concurrency`` makes it (``max_num_seqs`` the
largest level of ``bench/concurrency.sh``, 64; the prefix cache off) on the bundled model. A
round runs, for each arm in turn, ``--level`` requests of ``--prompt-tokens`` pseudo-random
tokens arriving together, ``--decode-tokens`` greedy tokens each with EOS ignored
(``engine.bench._concurrent_level``: the decode phase starts once every row has its first
token). Per round the ratio KVarN / fp16 of decode-phase tok/s; medians over the rounds. Run with
OpenBLAS preloaded (the script re-executes itself under it, as ``kvarn`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from server.blas import maybe_reexec_with_openblas, openblas_active  # noqa: E402

MODEL = ROOT / "engine/bundled/fixture-chat-29m-q8"
ARMS = {"fp16": "fp16", "kvarn-k4v2": "kvarn"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--level", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    maybe_reexec_with_openblas()
    from engine.bench import _concurrent_level
    from engine.engine import make_engine
    from engine.kv_config import ApcConfig, KVConfig
    from engine.loader import load_model
    from engine.scheduler import SchedulerConfig

    loaded = load_model(MODEL)
    config = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=max(1024, args.max_num_seqs + 512))
    engines = {arm: make_engine(loaded, config, KVConfig(scheme=scheme), ApcConfig(enabled=False))
               for arm, scheme in ARMS.items()}
    rng = random.Random(0)
    for engine in engines.values():  # warm-up: every structure of the level traced once
        _concurrent_level(engine, rng, 2, 32, 4, loaded.vocab_size)
        _concurrent_level(engine, rng, args.level, args.prompt_tokens, args.decode_tokens, loaded.vocab_size)
    rounds: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    ratios = []
    for r in range(args.rounds):
        for arm, engine in engines.items():
            row = _concurrent_level(engine, rng, args.level, args.prompt_tokens, args.decode_tokens, loaded.vocab_size)
            rounds[arm].append(row)
            print(f"round {r} {arm}: decode-phase {row['decode_tokens_per_s']:.1f} tok/s, "
                  f"aggregate {row['tokens_per_s']:.1f} tok/s", flush=True)
        ratios.append(rounds["kvarn-k4v2"][-1]["decode_tokens_per_s"] / rounds["fp16"][-1]["decode_tokens_per_s"])
    median = {arm: {key: statistics.median(x[key] for x in runs) for key in ("decode_tokens_per_s", "tokens_per_s")}
              for arm, runs in rounds.items()}
    for arm, m in median.items():
        print(f"{arm:>11}: decode-phase {m['decode_tokens_per_s']:.1f} tok/s, aggregate {m['tokens_per_s']:.1f} tok/s")
    print(f"KVarN / fp16 decode-phase: median {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})")
    if args.json_out:
        args.json_out.write_text(json.dumps({"level": args.level, "prompt_tokens": args.prompt_tokens,
                                             "decode_tokens": args.decode_tokens, "openblas": openblas_active(),
                                             "load_average": os.getloadavg(), "median": median,
                                             "ratio_median": statistics.median(ratios), "ratios": ratios,
                                             "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
