"""One user's stream at depth on the CPU, in one process: KVarN k4v2 and fp16 through the engine
beside mlx-lm's ``generate_step`` on the float32 copy of the bundled model.

    flock /tmp/kvarn-bench.lock python3 bench/cpu_decode_depth.py --rounds 3 \\
        --json-out bench/results/cpu-decode-depth.json

Each round gives every arm, in turn (k4v2, fp16, mlx-lm), the same new prompt of ``--prompt-tokens``
pseudo-random token ids, then ``--decode-tokens`` greedy tokens with EOS ignored. Engine arms:
``make_engine`` with the prefix cache off, one request, driven by ``engine.step()``; mlx-lm:
``generate_step`` (its own KV cache, prompt in chunks of 512 as the engine's). Per run: the cold
prefill (start to first token) and the median decode step (the time between consecutive tokens
after the first). Medians over the rounds. The float32 copy is made with ``mlx_lm convert -d
--dtype float32`` if ``--f32-model`` is missing (as ``bench/single_stream.py``). Run with OpenBLAS
preloaded (the script re-executes itself under it, as ``kvarn`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from server.blas import maybe_reexec_with_openblas, openblas_active  # noqa: E402

MODEL = ROOT / "engine/bundled/fixture-chat-29m-q8"
ARMS = ("kvarn-k4v2", "fp16", "mlx-lm-f32")


def engine_run(engine, prompt: list[int], decode_tokens: int) -> dict:  # noqa: ANN001
    from engine.request import Request, RequestId, SamplingParams

    request = Request(RequestId(f"depth-{time.monotonic_ns()}"), prompt,
                      SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True))
    engine.add_request(request)
    start = time.perf_counter()
    stamps = []
    while engine.has_work():
        engine.step()
        if len(request.output_ids) > len(stamps):
            stamps.append(time.perf_counter())
    return summary(start, stamps)


def mlx_lm_run(model, prompt: list[int], decode_tokens: int) -> dict:  # noqa: ANN001
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    start = time.perf_counter()
    stamps = []
    for _ in generate_step(mx.array(prompt), model, max_tokens=decode_tokens, sampler=lambda x: mx.argmax(x, axis=-1),
                           prefill_step_size=512):
        stamps.append(time.perf_counter())
    return summary(start, stamps)


def summary(start: float, stamps: list[float]) -> dict:
    steps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"prefill_s": stamps[0] - start, "decode_step_ms": statistics.median(steps) * 1e3, "tokens": len(stamps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--f32-model", type=Path, default=Path("/tmp/fixture-f32"))
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    maybe_reexec_with_openblas()
    if not (args.f32_model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(MODEL), "--mlx-path",
                        str(args.f32_model), "-d", "--dtype", "float32"], check=True)
    from mlx_lm import load

    from engine.engine import make_engine
    from engine.kv_config import ApcConfig, KVConfig
    from engine.loader import load_model
    from engine.scheduler import SchedulerConfig

    loaded = load_model(MODEL)
    engines = {arm: make_engine(loaded, SchedulerConfig(max_num_seqs=1), KVConfig(scheme=scheme),
                                ApcConfig(enabled=False))
               for arm, scheme in (("kvarn-k4v2", "kvarn"), ("fp16", "fp16"))}
    f32_model, _ = load(str(args.f32_model))
    rng = random.Random(0)

    def run(arm: str, prompt: list[int], tokens: int) -> dict:
        if arm in engines:
            return engine_run(engines[arm], prompt, tokens)
        return mlx_lm_run(f32_model, prompt, tokens)

    warm = [rng.randrange(16, loaded.vocab_size) for _ in range(600)]
    for arm in ARMS:
        run(arm, warm, 8)
    rounds: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        prompt = [rng.randrange(16, loaded.vocab_size) for _ in range(args.prompt_tokens)]
        for arm in ARMS:
            rounds[arm].append(run(arm, prompt, args.decode_tokens))
            print(f"round {r} {arm}: {rounds[arm][-1]}", flush=True)
    median = {arm: {key: statistics.median(x[key] for x in runs) for key in ("prefill_s", "decode_step_ms")}
              for arm, runs in rounds.items()}
    for arm, m in median.items():
        print(f"{arm:>12}: prefill {m['prefill_s']:.2f} s, decode step {m['decode_step_ms']:.1f} ms", flush=True)
    report = {"prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens, "openblas": openblas_active(),
              "load_average": os.getloadavg(), "median": median, "rounds": rounds}
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
