"""Greedy tokens of the bundled model through the engine with the fused KVarN decode kernel vs the
pure-MLX reference path: do they give the same greedy tokens (8 prompts x 256 tokens)? With
``--compare compile``: the decode step compiled (graphs by bucket) vs built in Python at every step
(``--enforce-eager``), both with the fused kernel.

Both arms run the same 8 held-out prompts (engine/data/kld_prompts.json) as one batch, greedy,
256 tokens each, KVarN k4v2; the only difference is the decode attention's verdict
(``metal.KERNELS.pin_attention_path``). Reports,
per prompt, how many tokens agree before the first difference and the max |logprob difference| of
the sampled tokens up to it.

    PYTHONPATH=. python3 bench/device_greedy.py --out OUT.json [--dtype float16]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from metal import KERNELS  # noqa: E402
from engine.engine import make_engine  # noqa: E402
from engine.kld import PROMPTS_FILE  # noqa: E402
from engine.kv_config import ApcConfig, KVConfig  # noqa: E402
from engine.loader import load_model  # noqa: E402
from engine.request import Request, RequestId, SamplingParams  # noqa: E402
from engine.scheduler import SchedulerConfig  # noqa: E402


def generate(loaded, prompts: list[list[int]], tokens: int, compile_decode: bool = True,
             kv: KVConfig = KVConfig("kvarn", 4, 2)) -> list[tuple[list[int], list[float]]]:
    engine = make_engine(loaded, SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=1024, prefill_chunk_size=512,
                                                 compile_decode=compile_decode),
                         kv, ApcConfig(enabled=False))
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=True)
    requests = [Request(RequestId(f"g{i}"), p, params) for i, p in enumerate(prompts)]
    logprobs: dict[str, list[float]] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        for out in engine.step():
            logprobs[out.request_id] += [lp.logprob for lp in out.logprobs]
    engine.close()
    return [(list(r.output_ids), logprobs[r.request_id]) for r in requests]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--compare", choices=("kernel", "compile"), default="kernel")
    parser.add_argument("--layout", choices=("kvarn", "fp16"), default="kvarn",
                        help="with --compare compile: the KV layout (fp16: the fused ragged kernel)")
    args = parser.parse_args()
    loaded = load_model(None, args.dtype)
    texts = [p["text"] for p in json.loads(PROMPTS_FILE.read_text())["prompts"][: args.prompts]]
    prompts = [loaded.tokenizer.encode(t, add_special_tokens=False)[: args.prompt_tokens] for t in texts]
    fused_verdict = KERNELS.attention_path()
    arms = {}
    if args.compare == "compile":
        first, second = "compiled", "eager"
        kv = KVConfig("kvarn", 4, 2) if args.layout == "kvarn" else KVConfig("fp16")
        arms = {"compiled": generate(loaded, prompts, args.tokens, True, kv),
                "eager": generate(loaded, prompts, args.tokens, False, kv)}
    else:
        first, second = "fused", "reference"
        for name, verdict in (("fused", fused_verdict), ("reference", "reference")):
            KERNELS.pin_attention_path(verdict)  # the process's decision, set per arm
            arms[name] = generate(loaded, prompts, args.tokens)
    rows = []
    for (a, la), (b, lb) in zip(arms[first], arms[second]):
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        worst = max((abs(x - y) for x, y in zip(la[:k], lb[:k])), default=0.0)
        rows.append({"agree_tokens": k, "of": len(a), "max_logprob_diff_before": worst})
    report = {"device": str(mx.default_device()), "dtype": loaded.compute_dtype, "fused_verdict": fused_verdict,
              "compare": f"{first} vs {second}", "layout": args.layout,
              "prompts": len(prompts), "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
              "identical_prompts": sum(r["agree_tokens"] == r["of"] for r in rows), "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
