"""A mixed load against ``kvarn serve`` and its memory afterwards.

Starts ``kvarn serve`` on loopback (the bundled model unless ``--model``), sends one warm-up
request and reads the server's RSS, then runs ``--clients`` concurrent clients over
``--requests`` requests drawn from a fixed mix (seeded):

- chat and completions, streamed and not, with ``n`` of 1 to 4;
- aborts: streams the client closes after a few chunks, and non-streamed requests it gives up
  on after a short timeout (the server must free their rows);
- shared prefixes (a long system prompt common to a third of the chats, so the prefix cache
  serves them) and distinct prompts;
- tiny ``max_tokens`` (1 to 3) beside longer ones (up to 48), logprobs on some.

Counts every answer by status (any 5xx or transport error other than the client's own aborts is
a failure), then calls ``POST /v1/cache/reset``, waits until ``/health`` shows nothing running
and reads RSS again. Prints a JSON report (and writes it with ``--json-out``): requests by kind,
statuses, failures, RSS after warm-up / after the load / after the reset, and the ratio, with the
server's memory gauges from ``/metrics`` at each reading (KV storage allocated and held, the
prefix cache, MLX's active memory and buffer cache).

    python3 bench/mixed_load.py --json-out bench/results/mixed-load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvarn_server import served  # bench/ is on sys.path when this runs as a script

SYSTEM = ("You are a careful assistant for a team that runs Linux servers. " * 12).strip()
TOPICS = ["list files", "find large folders", "read a log", "restart a service", "check disk space", "copy a tree",
          "count lines", "watch memory", "compress a folder", "schedule a job", "open a port", "kill a process"]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


GAUGES = {"kv_allocated": "kvarn_kv_allocated_bytes", "kv_held": "kvarn_kv_cache_bytes",
          "prefix_cache": "kvarn_prefix_cache_memory_bytes", "mlx_active": "kvarn_mlx_active_memory_bytes",
          "mlx_cache": "kvarn_mlx_cache_memory_bytes", "mlx_peak": "kvarn_mlx_peak_memory_bytes"}


def memory_gauges(base: str) -> dict[str, float]:
    """The server's own memory gauges from /metrics, in MiB (where the RSS is: the KV storage
    allocated and held, the prefix cache, MLX's live arrays and buffer cache)."""
    text = httpx.get(base + "/metrics", timeout=10).text
    values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return {key: round(values.get(name, 0) / 2**20, 1) for key, name in GAUGES.items()}


def make_request(rng: random.Random, model: str) -> tuple[str, str, dict]:
    """(kind, path, body); kind names what the client does with it."""
    topic = rng.choice(TOPICS)
    max_tokens = rng.choice([1, 2, 3]) if rng.random() < 0.3 else rng.randint(4, 48)
    n = rng.choice([1, 1, 1, 2, 4])
    stream = rng.random() < 0.5
    abort = rng.random() < 0.15
    common = {"model": model, "max_tokens": max_tokens, "n": n, "stream": stream,
              "temperature": rng.choice([0, 0.7, 1.0]), "seed": rng.randint(0, 10**6)}
    if rng.random() < 0.35:
        body = {**common, "prompt": f"Q{rng.randint(0, 10**6)}: how do I {topic}?\nA:"}
        if rng.random() < 0.3:
            body["logprobs"] = 2
        path = "/v1/completions"
    else:
        messages = [{"role": "user", "content": f"How do I {topic}? (case {rng.randint(0, 10**6)})"}]
        if rng.random() < 0.35:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        body = {**common, "messages": messages}
        if rng.random() < 0.2:
            body.update(logprobs=True, top_logprobs=2)
        path = "/v1/chat/completions"
    kind = ("abort-" if abort else "") + ("stream" if stream else "plain") + ("-n" if n > 1 else "")
    if not stream and n > 1 and rng.random() < 0.5:
        body.pop("seed")
    return kind, path, body


async def one(client: httpx.AsyncClient, kind: str, path: str, body: dict, stats: Counter) -> None:
    try:
        if body["stream"]:
            async with client.stream("POST", path, json=body) as response:
                stats[f"status_{response.status_code}"] += 1
                chunks = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        chunks += 1
                        if kind.startswith("abort") and chunks >= 2:
                            stats["aborted"] += 1
                            return  # closing the stream mid-way: the server must cancel the row
                        if '"error"' in line:
                            stats["stream_error"] += 1
        elif kind.startswith("abort"):
            try:
                response = await client.post(path, json=body, timeout=0.05)
                stats[f"status_{response.status_code}"] += 1
            except httpx.TimeoutException:
                stats["aborted"] += 1
        else:
            response = await client.post(path, json=body)
            stats[f"status_{response.status_code}"] += 1
    except httpx.TimeoutException:
        stats["timeout"] += 1
    except httpx.HTTPError as exc:
        stats[f"transport_{type(exc).__name__}"] += 1


async def load(base: str, model: str, clients: int, requests: int, seed: int) -> tuple[Counter, Counter, float]:
    rng = random.Random(seed)
    work = [make_request(rng, model) for _ in range(requests)]
    kinds = Counter(k for k, _, _ in work)
    queue: asyncio.Queue = asyncio.Queue()
    for item in work:
        queue.put_nowait(item)
    stats: Counter = Counter()
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:
        async def worker() -> None:
            while not queue.empty():
                kind, path, body = queue.get_nowait()
                await one(client, kind, path, body, stats)

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.monotonic() - t0
    return kinds, stats, wall


def wait_idle(base: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(base + "/health", timeout=10).json()
        if health.get("running", 0) == 0 and health.get("waiting", 0) == 0:
            return health
        if time.monotonic() > deadline:
            raise RuntimeError(f"server not idle after {timeout} s: {health}")
        time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    p.add_argument("--serve-args", default="", help="extra kvarn serve flags, one string")
    p.add_argument("--settle", type=float, default=3.0, help="seconds idle before each RSS reading")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()

    flags = args.serve_args.split() + (["--model", args.model] if args.model else [])
    with tempfile.TemporaryDirectory() as tmp, served(flags, Path(tmp) / "server.log", timeout=180) as server:
        base, pid = server.base, server.pid
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        warm = httpx.post(base + "/v1/chat/completions", timeout=120, json={
            "model": model, "messages": [{"role": "user", "content": "How do I list files?"}], "max_tokens": 16})
        assert warm.status_code == 200, warm.text
        wait_idle(base)
        time.sleep(args.settle)
        rss_warm, gauges = rss_bytes(pid), {"after_warmup": memory_gauges(base)}
        kinds, stats, wall = asyncio.run(load(base, model, args.clients, args.requests, args.seed))
        wait_idle(base)
        time.sleep(args.settle)
        rss_load, gauges["after_load"] = rss_bytes(pid), memory_gauges(base)
        reset = httpx.post(base + "/v1/cache/reset", timeout=60)
        assert reset.status_code == 200, reset.text
        health = wait_idle(base)
        time.sleep(args.settle)
        rss_reset, gauges["after_reset"] = rss_bytes(pid), memory_gauges(base)
    fivexx = sum(v for k, v in stats.items() if k.startswith("status_5"))
    failures = fivexx + sum(v for k, v in stats.items()
                            if k.startswith(("transport_", "timeout", "stream_error")))
    report = {
        "command": "python3 bench/mixed_load.py " + " ".join(sys.argv[1:]),
        "clients": args.clients, "requests": args.requests, "wall_s": round(wall, 1),
        "kinds": dict(sorted(kinds.items())), "outcomes": dict(sorted(stats.items())),
        "failures": failures, "5xx": fivexx,
        "rss_mib": {"after_warmup": round(rss_warm / 2**20, 1), "after_load": round(rss_load / 2**20, 1),
                    "after_reset": round(rss_reset / 2**20, 1)},
        "rss_after_reset_vs_warmup": round(rss_reset / rss_warm, 3),
        "kv_bytes_after_reset": health.get("kv_bytes"),
        "server_gauges_mib": gauges,
    }
    print(json.dumps(report, indent=2))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
