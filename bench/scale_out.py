"""Live loopback benchmark: kvarn replicas behind a prefix-aware router vs. round robin.

    python bench/scale_out.py                        # every run, writes bench/results/scale-out-cpu.{md,json}
    python bench/scale_out.py --runs smg:round_robin --no-rolling --no-late-join --out /tmp/x

Each run starts N fresh replicas of the bundled model (127.0.0.1 only, as ``bench/scale_out.sh``)
and a router in front, then plays a multi-tenant workload: ``--tenants`` distinct system prompts of
about ``--system-tokens`` tokens, ``--users`` users (user u belongs to tenant u mod tenants), each
a conversation of ``--turns`` turns whose prompt is the whole conversation so far (ChatML,
through ``/v1/completions``, streamed). Each replica's prefix cache holds about a third of the
tenants' prefixes (``--apc-memory-bytes`` computed from a cached block's bytes, measured), so a
router that spreads a tenant over every replica keeps missing. Per run: the aggregate prefix-cache
hit rate (prompt tokens served from cache / prompt tokens, from each replica's ``/metrics``),
throughput, p50/p99 TTFT, failures.

Two more phases: a rolling restart of one replica under load (SIGTERM, it drains, it starts again;
the router routes around it: failures are counted), and a replica that joins late with the shared
``--apc-disk-dir``: its TTFT on a prefix the others computed vs. on a cold prefix of the same length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_out_fleet import Fleet, FleetConfig, prompt_counters  # noqa: E402

logger = logging.getLogger("scale_out")
MODEL_ID = "fixture-chat-29m-q8"
WORDS = ("account address answer archive balance billing branch budget cache calendar channel client cluster "
         "column commit config contract credit customer dashboard deadline delivery deploy device discount "
         "document domain draft engine estimate event export feature filter folder forecast gateway handler "
         "invoice journal ledger license limit manager message metric migration module monitor network notice "
         "office order outage owner package partner payment pipeline policy portal pricing product profile "
         "project quota receipt record region release report request review route schedule schema service "
         "session shipment signal storage supplier support survey ticket timeline token tracker update vendor "
         "version volume warehouse webhook window workflow").split()


@dataclass
class Result:
    """One request: when it started, its TTFT and latency (s), whether it failed and why."""

    user: int
    turn: int
    start: float
    ttft: float | None = None
    latency: float | None = None
    output_tokens: int = 0
    error: str | None = None


@dataclass
class RunReport:
    name: str
    requests: int
    failed: int
    wall_s: float
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    requests_per_s: float
    prompt_tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    per_replica: list[dict[str, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    notes: str = ""
    loadavg: str = ""  # the machine's 1/5/15-minute load at the run's end (the cores are shared)


def system_prompt(tenant: int, words: int) -> str:
    rng = random.Random(1000 + tenant)
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"You are the assistant of tenant {tenant}. Their handbook follows. {body}"


def chatml(system: str, turns: list[tuple[str, str | None]]) -> str:
    """The conversation as the bundled model's chat template renders it, open for the next answer."""
    text = f"<|im_start|>system\n{system}<|im_end|>\n"
    for question, answer in turns:
        text += f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        if answer is not None:
            text += f"{answer}<|im_end|>\n"
    return text


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, result: Result) -> str:
    """Stream one completion; fill ``result``; return its text."""
    body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    text = ""
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"{response.status_code} {(await response.aread())[:200]!r}"
                return text
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = f"stream error {chunk['error']}"
                    return text
                for choice in chunk.get("choices") or ():
                    if choice.get("text") and result.ttft is None:
                        result.ttft = time.monotonic() - result.start
                    text += choice.get("text") or ""
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return text
    result.latency = time.monotonic() - result.start
    if result.ttft is None:
        result.ttft = result.latency
    return text


async def play(url: str, args: argparse.Namespace, systems: list[str]) -> list[Result]:
    """Every user's conversation, ``--concurrency`` requests at a time, users in a seeded order."""
    order = list(range(args.users))
    random.Random(7).shuffle(order)
    gate = asyncio.Semaphore(args.concurrency)
    results: list[Result] = []

    async def user(u: int, client: httpx.AsyncClient) -> None:
        turns: list[tuple[str, str | None]] = []
        for k in range(args.turns):
            turns.append((f"User {u}, question {k}: what should I check about item {u * 7 + k}?", None))
            async with gate:
                result = Result(u, k, time.monotonic())
                answer = await one_request(client, url, chatml(systems[u % len(systems)], turns), args.max_tokens,
                                           result)
            results.append(result)
            turns[-1] = (turns[-1][0], answer.strip() or "ok")

    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(user(u, client) for u in order))
    return results


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


def report(name: str, results: list[Result], wall: float, before: list[dict[str, float]],
           after: list[dict[str, float]], notes: str = "") -> RunReport:
    per = [{k: a[k] - b.get(k, 0.0) for k in a} for b, a in zip(before, after)]
    prompt = sum(p["prompt"] for p in per)
    cached = sum(p["cached"] for p in per)
    ok = [r for r in results if r.error is None]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    return RunReport(name, len(results), len(results) - len(ok), round(wall, 1), int(prompt), int(cached),
                     round(cached / prompt, 3) if prompt else 0.0, round(len(ok) / wall, 3),
                     round(prompt / wall, 1), round(statistics.median(ttfts), 3) if ttfts else float("nan"),
                     round(percentile(ttfts, 0.99), 3), per, [r.error for r in results if r.error][:10], notes,
                     " ".join(machine()["loadavg_at_end"]))


async def measure(fleet: Fleet, url: str, args: argparse.Namespace, systems: list[str], name: str,
                  during: Any = None) -> RunReport:
    before = await prompt_counters(fleet.urls)
    start = time.monotonic()
    task = asyncio.create_task(play(url, args, systems))
    notes = await during(fleet) if during is not None else ""
    results = await task
    wall = time.monotonic() - start
    await asyncio.sleep(0.5)
    return report(name, results, wall, before, await prompt_counters(fleet.urls), notes)


async def rolling_restart(fleet: Fleet) -> str:
    """Once the run is under way: SIGTERM replica 0, wait for it to drain and exit, start it again."""
    await asyncio.sleep(fleet.config.restart_after_s)
    began = time.monotonic()
    code = await fleet.restart(0)
    return f"replica 0 got SIGTERM after {fleet.config.restart_after_s:.0f} s, exited {code}, served again " \
           f"{time.monotonic() - began:.1f} s later"


async def run_router(spec: str, args: argparse.Namespace, systems: list[str], rolling: bool = False) -> RunReport:
    router, policy = spec.split(":")
    if rolling and args.rolling_users:
        args = argparse.Namespace(**{**vars(args), "users": args.rolling_users})
    config = FleetConfig(replicas=args.replicas, base_port=args.base_port, events_port=args.events_port,
                         router_port=args.router_port, apc_memory_bytes=args.apc_memory_bytes,
                         log_dir=Path(tempfile.mkdtemp(prefix="kvarn-scale-")), restart_after_s=args.restart_after)
    async with Fleet(config, router, policy) as fleet:
        name = f"{router} {policy}" + (" + rolling restart" if rolling else "")
        logger.info("run %s", name)
        return await measure(fleet, fleet.router_url, args, systems, name, rolling_restart if rolling else None)


async def late_join(args: argparse.Namespace, systems: list[str]) -> dict[str, Any]:
    """Two replicas share a disk cache and serve the tenants' first turns; a third starts later on
    the same folder. Its TTFT on a tenant prefix the others computed vs. on a fresh prefix of the
    same length (both measured on the late replica alone, nothing else running)."""
    disk = Path(tempfile.mkdtemp(prefix="kvarn-disk-"))
    config = FleetConfig(replicas=2, base_port=args.base_port, events_port=args.events_port,
                         router_port=args.router_port, apc_memory_bytes=args.apc_memory_bytes,
                         log_dir=Path(tempfile.mkdtemp(prefix="kvarn-late-")), disk_dir=disk)
    shared = systems[:4]
    try:
        async with Fleet(config, None, None) as fleet:
            async with httpx.AsyncClient(timeout=600) as client:
                for i, system in enumerate(shared):
                    await one_request(client, fleet.urls[i % 2], chatml(system, [("hello", None)]), 1,
                                      Result(0, 0, time.monotonic()))
            await fleet.settle_disk()
            late = await fleet.add_replica()
            warm, cold = [], []
            async with httpx.AsyncClient(timeout=600) as client:
                for i, system in enumerate(shared):
                    question = [(f"late question {i}", None)]
                    r = Result(0, 0, time.monotonic())
                    await one_request(client, late, chatml(system, question), 1, r)
                    warm.append(r.ttft)
                    r = Result(0, 1, time.monotonic())
                    await one_request(client, late, chatml(system_prompt(500 + i, args.system_words), question), 1, r)
                    cold.append(r.ttft)
            counters = (await prompt_counters([late]))[0]
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    return {"shared_prefixes": len(shared), "warm_ttft_s": [round(t, 3) for t in warm],
            "cold_ttft_s": [round(t, 3) for t in cold], "speedup": round(statistics.median(cold)
                                                                       / statistics.median(warm), 1),
            "late_replica_cached_tokens": counters["cached"], "late_replica_prompt_tokens": counters["prompt"]}


async def affinity(args: argparse.Namespace, systems: list[str], follow_ups: int = 3) -> dict[str, Any]:
    """vllm-router ``kv_aware`` from kvarn's events, one request at a time: tenant t's first turn
    is sent straight to replica t; every later request with that prefix, sent to the router, must
    land on replica t (only its prompt counter moves) and be served from its cache."""
    config = FleetConfig(replicas=args.replicas, base_port=args.base_port, events_port=args.events_port,
                         router_port=args.router_port, apc_memory_bytes=args.apc_memory_bytes,
                         log_dir=Path(tempfile.mkdtemp(prefix="kvarn-affinity-")))
    routed, holders = 0, []
    async with Fleet(config, "vllm-router", "kv_aware") as fleet, httpx.AsyncClient(timeout=600) as client:
        for t, system in enumerate(systems[:args.replicas]):
            served = []
            for k in range(1 + follow_ups):
                before = await prompt_counters(fleet.urls)
                await one_request(client, fleet.urls[t] if k == 0 else fleet.router_url,
                                  chatml(system, [(f"question {k}", None)]), 1, Result(t, k, time.monotonic()))
                await asyncio.sleep(0.3)  # the replica's BlockStored events reach the router
                after = await prompt_counters(fleet.urls)
                moved = [i for i, (b, a) in enumerate(zip(before, after)) if a["prompt"] > b["prompt"]]
                hit = sum(a["cached"] - b["cached"] for b, a in zip(before, after))
                served.append((moved, hit))
            holder = served[0][0]
            routed += sum(1 for moved, hit in served[1:] if moved == holder and hit > 0)
            holders.append(holder)
            logger.info("tenant %d: %s", t, served)
    return {"tenants": len(holders), "first_turn_replicas": holders, "follow_ups": follow_ups * len(holders),
            "routed_to_holder_with_hits": routed}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="smg:cache_aware,smg:round_robin,vllm-router:kv_aware")
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--tenants", type=int, default=24)
    parser.add_argument("--users", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-words", type=int, default=1250, help="words per system prompt (~1.65 tokens each)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--cache-share", type=float, default=1 / 3, help="of the tenants' prefixes, per replica")
    parser.add_argument("--apc-memory-bytes", type=int, default=None, help="default: measured from --cache-share")
    parser.add_argument("--restart-after", type=float, default=20.0)
    parser.add_argument("--no-rolling", action="store_true")
    parser.add_argument("--rolling-users", type=int, default=None, help="users of the rolling-restart run "
                                                                        "(default: --users)")
    parser.add_argument("--no-late-join", action="store_true")
    parser.add_argument("--append", action="store_true", help="keep the runs already in --out's .json (same "
                                                               "workload) and add these: one policy per invocation")
    parser.add_argument("--base-port", type=int, default=8301)
    parser.add_argument("--events-port", type=int, default=5701)
    parser.add_argument("--router-port", type=int, default=8300)
    parser.add_argument("--out", default="bench/results/scale-out-cpu")
    return parser.parse_args()


async def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args()
    systems = [system_prompt(t, args.system_words) for t in range(args.tenants)]
    sizing = await Fleet.size_cache(args, systems[0], chatml)
    args.apc_memory_bytes = args.apc_memory_bytes or sizing["apc_memory_bytes"]
    logger.info("sizing %s", sizing)
    runs = [await run_router(spec, args, systems) for spec in args.runs.split(",") if spec]
    if not args.no_rolling:
        runs.append(await run_router("smg:cache_aware", args, systems, rolling=True))
    late = None if args.no_late_join else await late_join(args, systems)
    routing = None if "vllm-router:kv_aware" not in args.runs else await affinity(args, systems)
    write(args, sizing, runs, late, routing)


def markdown(data: dict[str, Any]) -> str:
    """The results file: the command, the workload, the table, the rolling restart and the late join."""
    w, z = data["workload"], data["sizing"]
    lines = ["# Scale out on CPU: kvarn replicas behind a router (loopback)", "", "```bash", *data["commands"], "```", "",
             f"{w['replicas']} replicas of the bundled model on one machine of {data['machine']['cores']} cores shared "
             f"with other work (each run's load average at its end in the table). Workload: "
             f"{w['tenants']} tenants (system prompts of {z['prefix_tokens']} tokens with the first question), "
             f"{w['users']} users, {w['turns']} turns each (the prompt is the conversation so far, ChatML, through "
             f"`/v1/completions`, streamed, {w['max_tokens']} tokens out, temperature 0), {w['concurrency']} requests "
             f"at a time. Each replica's prefix cache: `--apc-memory-bytes {w['apc_memory_bytes']}` = "
             f"{z['tenants_held_per_replica']} tenants x {z['blocks_per_tenant']} blocks x {z['block_bytes']} bytes "
             f"(a block of {z['block_tokens']} tokens, measured), memory tier only; caches start cold every run.", "",
             "| router | policy | requests | failed | prefix-cache hit rate | req/s | prompt tok/s | TTFT p50 (s) "
             "| TTFT p99 (s) | wall (s) | load 1/5/15 min |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["runs"]:
        router, _, policy = r["name"].partition(" ")
        lines.append(f"| {router} | {policy} | {r['requests']} | {r['failed']} | {r['hit_rate']:.1%} | "
                     f"{r['requests_per_s']:.2f} | {r['prompt_tokens_per_s']:.0f} | {r['ttft_p50_s']:.2f} | "
                     f"{r['ttft_p99_s']:.2f} | {r['wall_s']:.0f} | {r.get('loadavg', '')} |")
    by_name = {r["name"]: r for r in data["runs"]}
    rr = by_name.get("smg round_robin")
    if rr and rr["hit_rate"]:
        lines += ["", "Against round robin: " + "; ".join(
            f"{r['name']} {r['hit_rate'] / rr['hit_rate']:.2f}x the hit rate, "
            f"{r['requests_per_s'] / rr['requests_per_s']:.2f}x the throughput"
            for r in data["runs"] if r["name"] != rr["name"] and "rolling" not in r["name"]) + "."]
    for r in data["runs"]:
        if r["notes"]:
            lines += ["", f"Rolling restart ({r['name']}): {r['notes']}; {r['failed']} of {r['requests']} requests "
                          f"failed." + (f" Errors: {r['errors']}" if r["errors"] else "")]
    late = data.get("late_join")
    if late:
        lines += ["", f"Late join: two replicas share `--apc-disk-dir` and serve {late['shared_prefixes']} tenants' "
                      f"first turns; a third replica then starts on the same folder. Its TTFT on those prefixes "
                      f"(read from disk): {late['warm_ttft_s']} s; on fresh prefixes of the same length: "
                      f"{late['cold_ttft_s']} s: {late['speedup']}x faster (median). It served "
                      f"{late['late_replica_cached_tokens']:.0f} of {late['late_replica_prompt_tokens']:.0f} prompt "
                      f"tokens from the cache."]
    routing = data.get("kv_aware_affinity")
    if routing:
        lines += ["", f"kv_aware routing check (vllm-router fed by kvarn's KV events, one request at a time): "
                      f"{routing['tenants']} tenants' first turns sent straight to replicas "
                      f"{routing['first_turn_replicas']}; {routing['routed_to_holder_with_hits']} of "
                      f"{routing['follow_ups']} later requests with the same prefix, sent to the router, went to the "
                      f"replica holding it and were served from its cache."]
    return "\n".join(lines) + "\n"


def write(args: argparse.Namespace, sizing: dict[str, Any], runs: list[RunReport], late: dict[str, Any] | None,
          routing: dict[str, Any] | None) -> None:
    command = "python bench/scale_out.py " + " ".join(sys.argv[1:])
    workload = {k: v for k, v in vars(args).items() if k not in ("out", "append", "runs", "no_rolling", "no_late_join")}
    data = {"commands": [command.strip()], "workload": workload, "sizing": sizing, "runs": [asdict(r) for r in runs],
            "late_join": late, "kv_aware_affinity": routing, "machine": machine()}
    out = Path(args.out)
    if args.append and out.with_suffix(".json").exists():
        data = merged(json.loads(out.with_suffix(".json").read_text()), data)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(data))
    print(markdown(data))


def merged(before: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """The runs of an earlier invocation with this one's added (its workload must be the same)."""
    if before.get("workload") != now["workload"]:
        raise SystemExit(f"--append: {now['workload']} is not the workload of the runs in the file "
                         f"({before.get('workload')})")
    names = {r["name"] for r in now["runs"]}
    return {**now, "commands": before.get("commands", []) + now["commands"],
            "runs": [r for r in before["runs"] if r["name"] not in names] + now["runs"],
            "late_join": now["late_join"] or before.get("late_join"),
            "kv_aware_affinity": now["kv_aware_affinity"] or before.get("kv_aware_affinity")}


def machine() -> dict[str, Any]:
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return {"cores": cores, "loadavg_at_end": load, "python": sys.version.split()[0]}


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    asyncio.run(main())
