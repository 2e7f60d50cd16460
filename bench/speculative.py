"""Speculative decoding over HTTP, side by side in one run: no speculation, prompt lookup
(``--speculative ngram``), the verify path's ceiling (an oracle proposer replaying the greedy
continuation recorded first: bench/spec_oracle_server.py) and a draft model (``--speculative
draft``: a copy of the bundled model keeping 2 of its 8 layers, written to a temp folder), on the
bundled model.

    python bench/speculative.py [--json-out bench/results/speculative-cpu.json] [--scenarios c=1,c=4]

First the greedy continuations of every prompt are recorded in this process (the engine, no
speculation, the server's default layout) and the draft is written; then four servers run
(``--no-apc``, so no arm reuses another round's prompt) and each scenario's rounds send the same
requests to each arm in turn (the arm order rotates by round). Per arm: generated tokens / wall time, median over the
rounds; its ratio to no speculation as the median of the rounds' paired ratios (each round's tok/s over the
same round's no-speculation tok/s, so load that drifts between rounds cancels), with their range; and the
acceptance over the scenario (drafted and accepted tokens from ``/health``). Prompt lookup runs with
``--num-speculative-tokens 8 --speculative-ngram-max 8`` (adaptive lengths: short drafts when the match is
weak); the oracle and the draft model with k = 4. Scenarios:

- long greedy, c = 1 and c = 4: chat prompts, 384 tokens each with ``ignore_eos`` (this small
  model falls into repeats, which prompt lookup predicts);
- short open chat, c = 1: 64 tokens, stops at EOS;
- wide batches, c = 16 and c = 64 (6 rounds each, every prompt sent twice): speculation must not cost
  throughput there.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LONG = ["Write a long story about a cat who loves to sleep.", "Explain how a computer works, step by step.",
        "List the planets of the solar system and describe each one.", "Write a poem about the sea and the sky.",
        "Describe your perfect day from morning to night.", "How do I bake bread at home?",
        "Tell me about the history of the city of Rome.", "Write a letter to a friend about a trip to the mountains."]
SHORT = ["What is the capital of France?", "Give me a synonym for happy.", "How are you today?",
         "Name a fruit that is red.", "What is two plus two?", "Say hello in Spanish.", "What color is the sky?",
         "Recommend a good book."]
WIDE = [f"Write about topic number {i}: " + t for i in range(8) for t in LONG]  # 64 distinct prompts


@dataclass(frozen=True)
class Scenario:
    name: str
    concurrency: int
    prompts: list[str]  # all of them, split over the rounds
    per_round: int
    max_tokens: int
    ignore_eos: bool
    repeat: int = 1  # the prompts sent this many times over (more rounds)


SCENARIOS = [
    Scenario("long greedy, c=1", 1, LONG, 2, 384, True),
    Scenario("long greedy, c=4", 4, LONG, 4, 384, True),
    Scenario("short open chat, c=1", 1, SHORT, 4, 64, False),
    Scenario("wide, c=16", 16, WIDE[:48], 16, 64, True, repeat=2),
    Scenario("wide, c=64", 64, WIDE * 3, 64, 32, True, repeat=2),
]
ARMS = ("off", "ngram", "oracle", "draft")
DRAFT_LAYERS = (0, 6)  # the bundled model's first and next-to-last layers (closest of the pairs tried)
NGRAM_FLAGS = ("--num-speculative-tokens", "8", "--speculative-ngram-max", "8")
LD_PRELOAD = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


def greedy_book(engine, tokenizer, lengths: dict[str, int], id_prefix: str = "b") -> list[dict]:
    """Greedy continuations through ``engine`` (speculation off), every prompt at once:
    ``lengths`` maps a user message to the tokens it generates (EOS ignored); returns the
    oracle's book, ``[{"prompt": token ids (the server's chat rendering), "output": token ids}]``."""
    from engine.chat_format import chat_prompt_ids
    from engine.request import Request, RequestId, SamplingParams

    requests = []
    for i, (text, n) in enumerate(lengths.items()):
        ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": text}])
        requests.append(Request(RequestId(f"{id_prefix}{i}"), ids, SamplingParams(max_tokens=n, temperature=0.0,
                                                                                   ignore_eos=True)))
        engine.add_request(requests[-1])
    while engine.has_work():
        engine.step()
    return [{"prompt": r.prompt_ids, "output": r.output_ids} for r in requests]


def record(path: Path) -> None:
    """Greedy continuations of every prompt (the longest max_tokens it is asked for), as the
    oracle's book (``greedy_book``), made in this process with the server's default layout."""
    from engine.engine import make_engine
    from engine.kv_config import ApcConfig
    from engine.loader import load_model
    from engine.scheduler import SchedulerConfig

    loaded = load_model()
    engine = make_engine(loaded, SchedulerConfig(max_num_seqs=64), apc=ApcConfig(enabled=False))
    longest: dict[str, int] = {}
    for s in SCENARIOS:
        for p in s.prompts:
            longest[p] = max(longest.get(p, 0), s.max_tokens)
    path.write_text(json.dumps(greedy_book(engine, loaded.tokenizer, longest)))


def start(arm: str, port: int, tmp: Path, log: Path) -> subprocess.Popen:
    flags = ["serve", "--port", str(port), "--no-apc", "--max-num-seqs", "64"]
    if arm == "off":
        cmd = [sys.executable, "-m", "server.cli", *flags]
    elif arm == "ngram":
        cmd = [sys.executable, "-m", "server.cli", *flags, "--speculative", "ngram", *NGRAM_FLAGS]
    elif arm == "draft":
        cmd = [sys.executable, "-m", "server.cli", *flags, "--speculative", "draft",
               "--draft-model", str(tmp / "draft")]
    else:
        book = tmp / "book.json"
        cmd = [sys.executable, str(ROOT / "bench" / "spec_oracle_server.py"), str(book), *flags,
               "--speculative", "ngram", "--num-speculative-tokens", "4"]
    env = {**os.environ, "LD_PRELOAD": LD_PRELOAD, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server at {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server at {url} did not come up")


async def run_round(url: str, s: Scenario, prompts: list[str]) -> tuple[int, float]:
    """(completion tokens, wall seconds) of ``prompts`` sent with ``s.concurrency`` at a time."""
    import httpx

    gate = asyncio.Semaphore(s.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(text: str) -> int:
            async with gate:
                body = {"model": "fixture-chat-29m-q8", "messages": [{"role": "user", "content": text}],
                        "temperature": 0, "max_tokens": s.max_tokens, "ignore_eos": s.ignore_eos}
                r = await client.post("/v1/chat/completions", json=body)
                r.raise_for_status()
                return r.json()["usage"]["completion_tokens"]
        t0 = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
        return sum(tokens), time.perf_counter() - t0


def acceptance(url: str) -> tuple[int, int]:
    import httpx

    spec = httpx.get(url + "/health", timeout=10).json().get("speculative") or {}
    return spec.get("draft_tokens", 0), spec.get("accepted_tokens", 0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json-out", default=str(ROOT / "bench" / "results" / "speculative-cpu.json"))
    parser.add_argument("--base-port", type=int, default=18740)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated arms, off first (of {ARMS})")
    parser.add_argument("--scenarios", default=None, metavar="TAGS",
                        help="only the scenarios whose name ends with one of these comma-separated tags "
                             "(e.g. c=1,c=4; default: all)")
    args = parser.parse_args()
    arms = tuple(a.strip() for a in args.arms.split(","))
    if arms[0] != "off" or not set(arms) <= set(ARMS):
        parser.error(f"--arms: off first, then any of {ARMS}")
    tags = tuple(t.strip() for t in args.scenarios.split(",")) if args.scenarios else None
    scenarios = [s for s in SCENARIOS if tags is None or s.name.endswith(tags)]
    tmp = Path(tempfile.mkdtemp(prefix="kvarn-spec-"))
    record(tmp / "book.json")
    from engine.draft_model import write_layer_subset
    from engine.loader import BUNDLED_MODEL_DIR

    if "draft" in arms:
        write_layer_subset(BUNDLED_MODEL_DIR, tmp / "draft", DRAFT_LAYERS)
    urls = {arm: f"http://127.0.0.1:{args.base_port + i}" for i, arm in enumerate(arms)}
    procs = {arm: start(arm, args.base_port + i, tmp, tmp / f"{arm}.log") for i, arm in enumerate(arms)}
    results = []
    try:
        for arm, proc in procs.items():
            wait_ready(urls[arm], proc)
        for s in scenarios:
            sent = s.prompts * s.repeat
            rounds = len(sent) // s.per_round
            rates: dict[str, list[float]] = {arm: [] for arm in arms}
            before = {arm: acceptance(urls[arm]) for arm in arms}
            for r in range(rounds):
                prompts = sent[r * s.per_round: (r + 1) * s.per_round]
                for arm in arms[r % len(arms):] + arms[: r % len(arms)]:  # the order rotates by round
                    tokens, wall = asyncio.run(run_round(urls[arm], s, prompts))
                    rates[arm].append(tokens / wall)
            row = {"scenario": s.name, "concurrency": s.concurrency, "max_tokens": s.max_tokens, "rounds": rounds,
                   "requests_per_round": s.per_round}
            for arm in arms:
                drafted, accepted = (a - b for a, b in zip(acceptance(urls[arm]), before[arm]))
                median = statistics.median(rates[arm])
                paired = [x / off for x, off in zip(rates[arm], rates["off"])]
                row[arm] = {"tok_s": round(median, 1), "rounds_tok_s": [round(x, 1) for x in rates[arm]],
                            "vs_off": round(statistics.median(paired), 3),
                            "vs_off_range": [round(min(paired), 3), round(max(paired), 3)],
                            "draft_tokens": drafted, "accepted_tokens": accepted,
                            "acceptance": round(accepted / drafted, 3) if drafted else None}
            results.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for proc in procs.values():
            proc.terminate()
            proc.wait(30)
    out = {"device": "CPU (MLX CPU backend, OpenBLAS), 2 cores shared", "model": "fixture-chat-29m-q8",
           "kv_layout": "kvarn k4v2 (default)", "ngram_flags": list(NGRAM_FLAGS),
           "num_speculative_tokens": 4, "arms": list(arms),
           "draft_model": f"fixture-chat-29m-q8, layers {DRAFT_LAYERS} of 8", "results": results}
    Path(args.json_out).write_text(json.dumps(out, indent=1) + "\n")
    print("| scenario | off tok/s | " + " | ".join(f"{a} tok/s (x [range], acceptance)" for a in arms[1:]) + " |")
    print("|---" * (len(arms) + 1) + "|")
    for row in results:
        cells = [f"{row[a]['tok_s']} ({row[a]['vs_off']}x [{row[a]['vs_off_range'][0]}-{row[a]['vs_off_range'][1]}], "
                 f"{row[a]['acceptance']})" for a in arms[1:]]
        print(f"| {row['scenario']} | {row['off']['tok_s']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
