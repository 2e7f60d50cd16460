"""One user's stream over HTTP on the CPU: kvarn serve (KVarN k4v2, fp16) beside mlx_lm.server.

One server at a time on a free loopback port, started fresh for every round and arm, arms
alternating within each round (k4v2, fp16, mlx-lm, then again). Each server, after one short
warm-up request, gets (streamed chat completions, greedy, the same seeded prompts for every arm):

* ``short``: a short chat (~45-token prompt), ``--max-tokens`` tokens: decode tok/s =
  (completion tokens - 1) / (last content chunk - first);
* ``cold``: a ~3,000-token prompt never seen before (a new one each round): its TTFT (request
  sent to first content chunk) and the decode tok/s after it;
* ``hit``: the same prompt again (the prefix cache's hit): its TTFT;
* ``c16``: 16 distinct short chats at once: aggregate tok/s = completion tokens / wall time.

Every answer runs to ``--max-tokens`` (``logit_bias`` -100 on the model's end tokens, which both
servers honour): the arms' answers differ (KVarN's keys and values are not fp16's), and with EOS
honoured one server's c = 16 wall time would be its longest answer's and its decode at depth a
10-token answer's. ``--natural-length`` leaves EOS alone.

Medians over the rounds per arm, ratios against mlx_lm.server. Writes ``--json-out`` and prints a
markdown table. mlx_lm.server runs on a float32 copy of the bundled model (``kvarn serve``
computes in float32 on the CPU; made with ``mlx_lm convert -d --dtype float32`` if missing), with
Debian's OpenBLAS preloaded, as ``kvarn serve`` preloads it for itself.

    python3 bench/single_stream.py --rounds 3 --json-out bench/results/single-stream-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from serve_load import WORDS  # noqa: E402  (bench/ is this script's folder)
from sse import sse_messages  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "engine/bundled/fixture-chat-29m-q8"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"
ARMS = ("kvarn-k4v2", "kvarn-fp16", "mlx-lm-f32")
METRICS = ("short_tps", "cold_ttft_ms", "cold_tps", "hit_ttft_ms", "c16_tps")


def server_command(arm: str, f32_model: Path) -> list[str]:
    """``arm`` may carry extra ``kvarn serve`` flags after a colon: ``kvarn-fp16:--async-scheduling``."""
    arm, *flags = arm.split(":")
    if flags:
        return server_command(arm, f32_model) + flags
    if arm == "kvarn-k4v2":
        return [sys.executable, "-m", "server.cli", "serve", str(MODEL), "--kv-scheme", "kvarn"]
    if arm == "kvarn-fp16":
        return [sys.executable, "-m", "server.cli", "serve", str(MODEL), "--kv-scheme", "fp16"]
    return [sys.executable, "-m", "mlx_lm", "server", "--model", str(f32_model)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(arm: str, f32_model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if arm.startswith("mlx"):
        env.update(LD_PRELOAD=OPENBLAS, HF_HUB_CACHE=str(log.parent / "empty-hf-cache"))
        (log.parent / "empty-hf-cache").mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([*server_command(arm, f32_model), "--port", str(port)], cwd=ROOT, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{arm} exited while starting: see {log}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop(proc)
    raise RuntimeError(f"{arm} did not become ready in 300 s: see {log}")


def stop(proc: subprocess.Popen) -> None:
    """The server's whole process group (``kvarn serve`` re-executes itself once)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except ProcessLookupError:
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def words_prompt(rng: random.Random, n_words: int) -> str:
    return "Continue this list of words: " + " ".join(rng.choice(WORDS) for _ in range(n_words))


def long_prompt(rng: random.Random, tokenizer: Tokenizer, target: int) -> str:
    """A word-list prompt of ``target`` tokens (the message's own tokens, before the template)."""
    words = [rng.choice(WORDS) for _ in range(2 * target)]
    lo, hi = 1, len(words)
    while lo < hi:  # the most words whose prompt fits in target tokens
        mid = (lo + hi + 1) // 2
        text = "Continue this list of words: " + " ".join(words[:mid])
        lo, hi = (mid, hi) if len(tokenizer.encode(text).ids) <= target else (lo, mid - 1)
    return "Continue this list of words: " + " ".join(words[:lo])


NO_END: dict[str, float] = {}  # logit_bias that keeps the model's end tokens from being chosen (main sets it)


def end_token_ids(tokenizer: Tokenizer) -> list[int]:
    """The bundled model's end tokens: its generation config's EOS ids and ChatML's end of turn."""
    ids = set(json.loads((MODEL / "generation_config.json").read_text())["eos_token_id"])
    ids.add(tokenizer.token_to_id("<|im_end|>"))
    return sorted(i for i in ids if i is not None)


async def chat(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int) -> dict:
    """One streamed greedy chat completion: TTFT, decode tok/s, token counts."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if NO_END:
        body["logit_bias"] = NO_END
    t0 = time.perf_counter()
    first = last = None
    usage: dict = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            r.raise_for_status()
        async for msg in sse_messages(r):
            usage = msg.get("usage") or usage
            if any((c.get("delta") or {}).get("content") for c in msg.get("choices") or []):
                last = time.perf_counter()
                first = first or last
    end = time.perf_counter()
    n = usage.get("completion_tokens", 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ttft": (first or end) - t0, "wall": end - t0, "tokens": n, "prompt_tokens": usage.get("prompt_tokens"),
            "cached_tokens": cached, "tps": (n - 1) / (last - first) if n > 1 and last and last > first else None}


async def staggered(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, delay: float) -> dict:
    """``chat`` after ``delay`` seconds, retried on a refused or reset connection: mlx_lm.server's
    ThreadingHTTPServer listens with a backlog of 5 and resets connections opened at once."""
    await asyncio.sleep(delay)
    for attempt in range(5):
        try:
            return await chat(client, model, prompt, max_tokens)
        except (httpx.ReadError, httpx.ConnectError, httpx.RemoteProtocolError):
            await asyncio.sleep(0.1 * (attempt + 1))
    return await chat(client, model, prompt, max_tokens)


async def one_round(url: str, model: str, prompts: dict, max_tokens: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:
        await chat(client, model, "Say hello.", 8)  # warm-up, not counted
        short = await chat(client, model, prompts["short"], max_tokens)
        cold = await chat(client, model, prompts["long"], max_tokens)
        hit = await chat(client, model, prompts["long"], 8)
        t0 = time.perf_counter()
        many = await asyncio.gather(*(staggered(client, model, p, max_tokens, 0.02 * i)
                                      for i, p in enumerate(prompts["c16"])))
        wall = time.perf_counter() - t0
    return {"short_tps": short["tps"], "short_tokens": short["tokens"], "cold_ttft_ms": 1000 * cold["ttft"],
            "cold_tps": cold["tps"], "cold_tokens": cold["tokens"], "prompt_tokens": cold["prompt_tokens"],
            "hit_ttft_ms": 1000 * hit["ttft"], "hit_cached_tokens": hit["cached_tokens"],
            "c16_tps": sum(m["tokens"] for m in many) / wall, "c16_tokens": sum(m["tokens"] for m in many)}


def median(rounds: list[dict], key: str) -> float | None:
    values = [r[key] for r in rounds if r.get(key) is not None]
    return statistics.median(values) if values else None


def markdown(report: dict) -> str:
    base = report["median"].get("mlx-lm-f32", {})
    head = ("| server | decode tok/s, short chat | cold TTFT, 3k prompt | decode tok/s after 3k | TTFT, same prompt "
            "again | c = 16 tok/s |\n|---|---|---|---|---|---|")
    rows = [head]
    for arm in report["arms"]:
        med = report["median"][arm]
        cells = []
        for key in METRICS:
            value, ref = med.get(key), base.get(key)
            text = "-" if value is None else (f"{value:,.0f} ms" if key.endswith("_ms") else f"{value:.1f}")
            if value is not None and ref and arm != "mlx-lm-f32":
                ratio = ref / value if key.endswith("_ms") else value / ref  # > 1: better than mlx-lm
                text += f" ({ratio:.2f}x)"
            cells.append(text)
        rows.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--long-tokens", type=int, default=3000)
    ap.add_argument("--f32-model", type=Path, default=Path("/tmp/fixture-f32"))
    ap.add_argument("--natural-length", action="store_true", help="answers end at EOS (lengths then differ by arm)")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--logs", type=Path, default=ROOT / "bench/out")
    args = ap.parse_args()
    arms = args.arms.split(",")
    if any(a.startswith("mlx") for a in arms) and not (args.f32_model / "config.json").exists():
        subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(MODEL), "--mlx-path",
                        str(args.f32_model), "-d", "--dtype", "float32"], check=True)
    tokenizer = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    if not args.natural_length:
        NO_END.update({str(i): -100.0 for i in end_token_ids(tokenizer)})
    args.logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {a: [] for a in arms}
    for r in range(args.rounds):
        rng = random.Random(r)
        prompts = {"short": words_prompt(rng, 40), "long": long_prompt(rng, tokenizer, args.long_tokens),
                   "c16": [words_prompt(rng, 40) for _ in range(16)]}
        for arm in arms:
            proc, url = start(arm, args.f32_model, args.logs / f"single-stream-{arm}.log")
            try:
                model = str(args.f32_model) if arm.startswith("mlx") else httpx.get(url + "/v1/models").json()["data"][0]["id"]
                got = asyncio.run(one_round(url, model, prompts, args.max_tokens))
            finally:
                stop(proc)
            results[arm].append(got)
            print(f"round {r + 1} {arm}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items() if v is not None),
                  flush=True)
    report = {"command": "python3 bench/single_stream.py " + " ".join(sys.argv[1:]), "machine": platform.node(),
              "cpus": os.cpu_count(), "arms": arms, "answers": "natural" if args.natural_length else "max_tokens",
              "rounds": results,
              "median": {a: {k: median(results[a], k) for k in results[a][0]} for a in arms}}
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))


if __name__ == "__main__":
    main()
