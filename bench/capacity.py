"""How many concurrent sequences of a given length fit in a fixed KV budget, per layout.

Two parts:
1. priced: from the engine's exact capacity pricing (``engine.pricing``, tested equal to the
   measured ``nbytes`` of filled caches in tests/engine/test_batching.py), for the bundled model
   at several budgets, including the fp16 scheme both as it runs on this CPU (float32 storage)
   and as on a GPU (float16 storage);
2. admitted (``--admit``): the real engine with ``--kv-budget-bytes`` = a small budget and
   ``--requests`` requests queued at once, each reserving ``--tokens`` (a prompt of tokens - 72
   and 72 generated tokens); reports the most requests the scheduler ever ran together (a
   prompt being prefilled also holds its transient, so fewer run while prompts are prefilled;
   prefill is real, so this takes minutes on a CPU).

    python bench/capacity.py --tokens 3072 --budget-mib 256 1024 4096 [--admit --admit-budget-mib 128]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server.blas import maybe_reexec_with_openblas  # noqa: E402

_GENERATED = 72
LAYOUTS = {  # label -> (KVConfig args, storage dtype override or None = the compute dtype)
    "fp16 (float16 storage, as on a GPU)": (("fp16",), "float16"),
    "fp16 (float32 storage, this CPU)": (("fp16",), None),
    "affine-4 g64 (float16 scales, as on a GPU)": (("affine", 4, 4), "float16"),
    "affine-4 g64 (float32 scales, this CPU)": (("affine", 4, 4), None),
    "kvarn k4v4": (("kvarn", 4, 4), None),
    "kvarn k3v3": (("kvarn", 3, 3), None),
    "kvarn k4v2": (("kvarn", 4, 2), None),
    "kvarn k4v2 g64": (("kvarn", 4, 2, 64), None),
}


def priced(tokens: int, budgets_mib: list[int]) -> list[dict]:
    from dataclasses import replace

    from engine.engine import make_layout, make_pricing
    from engine.kv_config import KVConfig
    from engine.loader import load_model

    loaded = load_model()
    rows = []
    for label, (args, storage) in LAYOUTS.items():
        layout = make_layout(KVConfig(*args), loaded)
        if storage is not None:
            layout = replace(layout, storage_dtype=storage)
        pricing = make_pricing(loaded, layout, 512)
        per_sequence = pricing.sequence_bytes(tokens)
        rows.append({"layout": label, "bytes_per_sequence": per_sequence,
                     "fits": {mib: (mib * 2**20) // per_sequence for mib in budgets_mib}})
    return rows


def admitted(tokens: int, budget_mib: float, requests: int, arms: list[str]) -> list[dict]:
    import numpy as np

    from engine.engine import make_engine
    from engine.kv_config import ApcConfig, KVConfig
    from engine.loader import load_model
    from engine.request import Request, RequestId, SamplingParams
    from engine.scheduler import SchedulerConfig

    loaded = load_model()
    rng = np.random.default_rng(0)
    results = []
    for label in arms:
        args, _ = LAYOUTS[label]
        budget = int(budget_mib * 2**20)
        engine = make_engine(loaded, SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=1024,
                                                     prefill_chunk_size=512, kv_budget_bytes=budget), KVConfig(*args),
                             ApcConfig(enabled=False))  # the whole budget for rows
        for i in range(requests):
            engine.add_request(Request(RequestId(f"{i}"), rng.integers(16, 8000, tokens - _GENERATED).tolist(),
                                       SamplingParams(max_tokens=_GENERATED, temperature=0.0, ignore_eos=True)))
        most, peak_bytes = 0, 0
        while engine.has_work():
            engine.step()
            most = max(most, engine.num_running)
            peak_bytes = max(peak_bytes, engine.runner.kv_nbytes())
        results.append({"layout": label, "budget_bytes": budget, "most_running": most, "peak_kv_bytes": peak_bytes})
        print(f"{label}: {most} of {requests} ran together (peak KV {peak_bytes / 2**20:.1f} MiB)", file=sys.stderr)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=3072, help="tokens per sequence (prompt + generated)")
    parser.add_argument("--budget-mib", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--admit", action="store_true", help="also run the engine's admission for real")
    parser.add_argument("--admit-budget-mib", type=float, default=128)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    maybe_reexec_with_openblas(disabled=False)
    report = {"tokens": args.tokens, "priced": priced(args.tokens, args.budget_mib)}
    if args.admit:
        report["admitted"] = admitted(args.tokens, args.admit_budget_mib, args.requests,
                                      ["fp16 (float32 storage, this CPU)", "kvarn k4v2"])
    lines = [f"Concurrent {args.tokens}-token sequences that fit (bundled model, 8 layers x 2 KV heads x 128):", "",
             "| layout | bytes / sequence | " + " | ".join(f"{m} MiB" for m in args.budget_mib) + " |",
             "|---|---|" + "---|" * len(args.budget_mib)]
    for row in report["priced"]:
        lines.append(f"| {row['layout']} | {row['bytes_per_sequence']:,} | "
                     + " | ".join(str(row["fits"][m]) for m in args.budget_mib) + " |")
    for row in report.get("admitted", []):
        lines.append(f"\nadmitted with --kv-budget-bytes {row['budget_bytes']:,}: {row['layout']}: "
                     f"{row['most_running']} ran together, peak KV {row['peak_kv_bytes']:,} bytes")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
