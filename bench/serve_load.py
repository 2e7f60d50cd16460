"""HTTP load generator for OpenAI-compatible servers (kvarn serve, mlx_lm.server, ...).

For each concurrency level C, a fixed pool of C workers pulls requests from a queue and sends
them to ``/v1/chat/completions`` (temperature 0, distinct seeded prompts, no ``ignore_eos``, so
a server may stop early at EOS: throughput counts the tokens actually generated). Per level it
measures:

* aggregate generated tokens/s = total ``usage.completion_tokens`` / wall time of the level;
* TTFT (time to first content chunk; with ``--no-stream`` it is the whole request latency),
  mean, p50 and p95;
* mean per-request decode tokens/s = (completion tokens - 1) / (last chunk - first chunk)
  (with ``--no-stream``: completion tokens / request latency);
* requests ok and failed, failures counted by kind (exception class or ``http_<status>``).

``--burst N`` adds a scenario in which N requests are released at the same instant by an
``asyncio.Event`` barrier, to see whether the server accepts them all or drops connections.

Prints a markdown table and, with ``--json-out``, writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from collections import Counter

import httpx

from sse import sse_messages  # bench/sse.py (this script's folder is on sys.path)

WORDS = ("time year people way day man thing woman life child world school state family student "
         "group country problem hand part place case week company system program question work "
         "government number night point home water room mother area money story fact month lot "
         "right study book eye job word business issue side kind head house service friend father "
         "power hour game line end member law car city community name president team minute idea "
         "kid body information back parent face others level office door health person art war "
         "history party result change morning reason research girl guy moment air teacher force "
         "education river mountain garden bridge window").split()


def make_prompt(rng: random.Random, n_words: int) -> str:
    return "Continue this list of words: " + " ".join(rng.choice(WORDS) for _ in range(n_words))


def percentile(xs: list[float], p: float) -> float | None:
    """Nearest-rank percentile; None for an empty list."""
    if not xs:
        return None
    s = sorted(xs)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def error_kind(exc: BaseException) -> str:
    return f"http_{exc.response.status_code}" if isinstance(exc, httpx.HTTPStatusError) else type(exc).__name__


async def one_request(client: httpx.AsyncClient, args, prompt: str) -> dict:
    body = {"model": args.model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": args.max_tokens, "temperature": 0, "stream": args.stream}
    if args.stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    usage = None
    try:
        if args.stream:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    r.raise_for_status()
                async for msg in sse_messages(r):
                    if "error" in msg:
                        raise RuntimeError(f"stream error: {msg['error']}")
                    usage = msg.get("usage") or usage
                    for choice in msg.get("choices") or []:
                        if (choice.get("delta") or {}).get("content"):
                            last = time.perf_counter()
                            first = first or last
                            chunks += 1
        else:
            r = await client.post("/v1/chat/completions", json=body)
            r.raise_for_status()
            msg = r.json()
            first = last = time.perf_counter()
            usage = msg.get("usage")
            chunks = 1 if msg["choices"][0]["message"].get("content") else 0
    except Exception as exc:  # noqa: BLE001 - every failure is counted by kind
        return {"ok": False, "error": error_kind(exc), "detail": str(exc)[:200]}
    end = time.perf_counter()
    usage = usage or {}
    gen = usage.get("completion_tokens", chunks)
    if not args.stream:
        decode_tps = gen / (end - t0) if gen else None
    else:
        decode_tps = (gen - 1) / (last - first) if gen > 1 and first is not None and last > first else None
    return {"ok": True, "ttft": (first or end) - t0, "latency": end - t0, "completion_tokens": gen,
            "prompt_tokens": usage.get("prompt_tokens"), "decode_tps": decode_tps}


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    tps = [r["decode_tps"] for r in ok if r["decode_tps"] is not None]
    prompt = [r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None]
    gen = sum(r["completion_tokens"] for r in ok)
    mean = lambda xs: statistics.fmean(xs) if xs else None  # noqa: E731
    return {"requests": len(results), "ok": len(ok), "failed": len(results) - len(ok),
            "errors": dict(Counter(r["error"] for r in results if not r["ok"])),
            "error_samples": sorted({r["detail"] for r in results if not r["ok"]})[:3],
            "wall_s": wall, "completion_tokens": gen, "agg_tps": gen / wall if wall > 0 else 0.0,
            "ttft_mean_s": mean(ttft), "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
            "decode_tps_mean": mean(tps), "prompt_tokens_mean": mean(prompt),
            "completion_tokens_mean": gen / len(ok) if ok else None}


async def run_level(args, concurrency: int, prompts: list[str]) -> dict:
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=args.url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def worker():
            while not queue.empty():
                results.append(await one_request(client, args, queue.get_nowait()))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"concurrency": concurrency, **summarize(results, wall)}


async def run_burst(args, prompts: list[str]) -> dict:
    go = asyncio.Event()
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=args.url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def fire(prompt: str) -> dict:
            await go.wait()
            return await one_request(client, args, prompt)

        tasks = [asyncio.create_task(fire(p)) for p in prompts]
        await asyncio.sleep(0.2)  # let every task reach the barrier
        t0 = time.perf_counter()
        go.set()
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return {"burst": len(prompts), **summarize(list(results), wall)}


def fmt(x, scale=1.0, digits=1) -> str:
    return "-" if x is None else f"{x * scale:.{digits}f}"


def markdown(report: dict) -> str:
    head = ("| scenario | requests | ok | failed | agg tok/s | TTFT mean ms | TTFT p50 ms | TTFT p95 ms "
            "| decode tok/s/req | prompt tok | gen tok/req | wall s |")
    lines = [f"### {report['label']} ({report['url']}, model {report['model']})", "", head,
             "|" + "---|" * (head.count("|") - 1)]
    rows = [(f"c={lv['concurrency']}", lv) for lv in report["levels"]]
    if report.get("burst"):
        rows.append((f"burst {report['burst']['burst']}", report["burst"]))
    for name, s in rows:
        lines.append(f"| {name} | {s['requests']} | {s['ok']} | {s['failed']} | {fmt(s['agg_tps'])} "
                     f"| {fmt(s['ttft_mean_s'], 1e3)} | {fmt(s['ttft_p50_s'], 1e3)} | {fmt(s['ttft_p95_s'], 1e3)} "
                     f"| {fmt(s['decode_tps_mean'])} | {fmt(s['prompt_tokens_mean'], digits=0)} "
                     f"| {fmt(s['completion_tokens_mean'])} | {fmt(s['wall_s'], digits=2)} |")
    for name, s in rows:
        if s["errors"]:
            lines.append(f"\n{name} failures: {s['errors']} e.g. {s['error_samples']}")
    return "\n".join(lines)


async def main_async(args) -> dict:
    args.url = args.url.rstrip("/")
    if not args.model:
        async with httpx.AsyncClient(base_url=args.url, timeout=30.0) as client:
            r = await client.get("/v1/models")
            r.raise_for_status()
            args.model = r.json()["data"][0]["id"]
    rng = random.Random(args.seed)
    # calibrated on the bundled fixture's 8k vocabulary: ~1.7 tokens per word plus ~27 for the
    # instruction and chat template (the real length is reported from usage.prompt_tokens)
    n_words = max(1, round((args.prompt_tokens - 27) / 1.7))
    take = lambda n: [make_prompt(rng, n_words) for _ in range(n)]  # noqa: E731
    report = {"label": args.label or args.url, "url": args.url, "model": args.model,
              "args": {k: v for k, v in vars(args).items() if k not in ("json_out",)}, "levels": []}
    async with httpx.AsyncClient(base_url=args.url, timeout=httpx.Timeout(600.0)) as client:
        for prompt in take(args.warmup):
            await one_request(client, args, prompt)
    for c in args.concurrency:
        n = args.requests_per_level or max(2 * c, 8)
        level = await run_level(args, c, take(n))
        report["levels"].append(level)
        print(f"[{report['label']}] c={c}: {level['ok']}/{n} ok, {level['agg_tps']:.1f} tok/s, "
              f"wall {level['wall_s']:.2f}s", flush=True)
    if args.burst:
        report["burst"] = await run_burst(args, take(args.burst))
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080", help="server base URL")
    ap.add_argument("--model", help="model id for the request body (default: first of GET /v1/models)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--requests-per-level", type=int, default=0, help="0: max(2*concurrency, 8)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="approximate prompt length")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--burst", type=int, default=0, help="also fire N requests at the same instant")
    ap.add_argument("--warmup", type=int, default=1, help="untimed requests sent first")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    report = asyncio.run(main_async(args))
    print(markdown(report))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
