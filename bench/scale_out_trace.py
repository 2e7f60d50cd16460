"""Why a router sent each request where it did: vllm-router ``kv_aware`` traced against kvarn's events.

    python bench/scale_out_trace.py --tenants 6 --users 18 --turns 2 --concurrency 4
    python bench/scale_out_trace.py ... --session-by-tenant --router-args "--kv-aware-session-affinity-ttl-secs 600"

Starts the replicas and vllm-router ``kv_aware`` (debug log: one ``KV prefix decision`` line per
request, naming the worker, the prompt's tokens and the tokens it credited as cached), subscribes
to every replica's KV events itself and keeps its own index of which replica holds which 16-token
blocks (by the blocks' token ids, as the router hashes them). At each request's send it notes
every replica's cached prefix by that index and how many requests each replica has in flight.
Each decision is then one of:

- **followed the cache**: the chosen replica held the longest cached prefix (longer than 0);
- **load over cache**: another replica held a longer prefix than the chosen one (the router's
  cost counts the work a replica already has: its requests in flight);
- **prefix still computing**: no replica had published the prefix yet, but a request with the same
  system prompt was already in flight (its blocks are cached, and published, as its prefill runs);
- **cold**: nothing of the prefix anywhere, and nothing computing it.

It also measures the events' lag: from a request's send to its replica's first ``BlockStored``
for that prompt. Writes ``--out`` .json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import re
import shlex
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale_out import Result, chatml, one_request, system_prompt  # noqa: E402
from scale_out_fleet import EVENTS_BLOCK_SIZE, Fleet, FleetConfig  # noqa: E402

logger = logging.getLogger("scale_out_trace")
DECISION = re.compile(r'KV prefix decision .*?worker="([^"]+)" input_tokens=(\d+) new_prefill_tokens=(\d+) '
                      r'credited_prefix_tokens=(\d+)')
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def chain_keys(tokens: list[int], block: int = EVENTS_BLOCK_SIZE) -> list[int]:
    """One key per whole block of ``tokens``: a hash of every token up to that block's end."""
    keys, key = [], 0
    for start in range(0, len(tokens) - block + 1, block):
        key = hash((key, tuple(tokens[start:start + block])))
        keys.append(key)
    return keys


class EventIndex:
    """Every replica's published blocks, kept by their prefix's token chain (a subscriber thread a
    replica). ``lag`` holds, per replica, when each prefix key was first stored."""

    def __init__(self, endpoints: list[str]) -> None:
        self._lock = threading.Lock()
        self._by_hash: list[dict[int, int]] = [{} for _ in endpoints]  # published hash -> chain key
        self.held: list[set[int]] = [set() for _ in endpoints]
        self.first_stored: list[dict[int, float]] = [{} for _ in endpoints]
        self.batches = [0] * len(endpoints)
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._listen, args=(i, ep), daemon=True)
                         for i, ep in enumerate(endpoints)]
        for t in self._threads:
            t.start()

    def _listen(self, replica: int, endpoint: str) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(endpoint)
        decoder = msgspec.msgpack.Decoder()
        while not self._stop.is_set():
            if not sock.poll(100):
                continue
            _, _, payload = sock.recv_multipart()
            _, events, *_ = decoder.decode(payload)
            now = time.monotonic()
            with self._lock:
                self.batches[replica] += 1
                for event in events:
                    self._apply(replica, event, now)
        sock.close(linger=0)

    def _apply(self, replica: int, event: dict[str, Any], now: float) -> None:
        kind = event.get("type")
        if kind == "BlockStored" and event.get("medium") in (None, "GPU"):
            parent = event.get("parent_block_hash")
            key = self._by_hash[replica].get(parent, 0) if parent is not None else 0
            tokens, size = event["token_ids"], event["block_size"]
            for j, h in enumerate(event["block_hashes"]):
                key = hash((key, tuple(tokens[j * size:(j + 1) * size])))
                self._by_hash[replica][h] = key
                self.held[replica].add(key)
                self.first_stored[replica].setdefault(key, now)
        elif kind == "BlockRemoved" and event.get("medium") in (None, "GPU"):
            for h in event["block_hashes"]:
                key = self._by_hash[replica].pop(h, None)
                self.held[replica].discard(key)
        elif kind == "AllBlocksCleared":
            self._by_hash[replica].clear()
            self.held[replica].clear()

    def overlaps(self, keys: list[int]) -> list[int]:
        """Per replica, how many leading blocks of ``keys`` it holds now."""
        with self._lock:
            out = []
            for held in self.held:
                n = 0
                while n < len(keys) and keys[n] in held:
                    n += 1
                out.append(n)
            return out

    def stored_at(self, replica: int, key: int) -> float | None:
        with self._lock:
            return self.first_stored[replica].get(key)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(2)
        self._ctx.term()


@dataclass
class Sent:
    user: int
    tenant: int
    turn: int
    tokens: int
    keys: list[int]
    start: float
    overlaps: list[int]
    end: float = 0.0
    replica: int | None = None
    credited: int | None = None
    in_flight: list[int] = field(default_factory=list)
    kind: str = ""


async def play(fleet: Fleet, index: EventIndex, args: argparse.Namespace, systems: list[str]) -> list[Sent]:
    order = list(range(args.users))
    random.Random(7).shuffle(order)
    gate = asyncio.Semaphore(args.concurrency)
    sent: list[Sent] = []

    async def user(u: int, client: httpx.AsyncClient) -> None:
        turns: list[tuple[str, str | None]] = []
        for k in range(args.turns):
            turns.append((f"User {u}, question {k}: what should I check about item {u * 7 + k}?", None))
            prompt = chatml(systems[u % len(systems)], turns)
            ids = (await client.post(fleet.urls[0] + "/tokenize", json={"prompt": prompt})).json()["tokens"]
            keys = chain_keys(ids)
            async with gate:
                record = Sent(u, u % len(systems), k, len(ids), keys, time.monotonic(), index.overlaps(keys))
                sent.append(record)
                result = Result(u, k, record.start)
                answer = await one_request(client, fleet.router_url, prompt, args.max_tokens, result)
                record.end = time.monotonic()
            turns[-1] = (turns[-1][0], answer.strip() or "ok")

    async def session(u: int) -> None:
        headers = {"X-Session-ID": f"tenant-{u % len(systems)}"} if args.session_by_tenant else {}
        async with httpx.AsyncClient(timeout=600, headers=headers) as client:
            await user(u, client)

    await asyncio.gather(*(session(u) for u in order))
    return sent


def decisions(log: Path) -> list[tuple[str, int, int, int]]:
    """(worker, input tokens, new prefill tokens, credited tokens) of every decision, in order."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = DECISION.search(ANSI.sub("", line))
        if m:
            out.append((m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))))
    return out


def classify(sent: list[Sent], made: list[tuple[str, int, int, int]], urls: list[str]) -> None:
    """Match each decision to the earliest unmatched request of its token count, then say why."""
    pending = sorted(sent, key=lambda s: s.start)
    for worker, tokens, _, credited in made:
        match = next((s for s in pending if s.tokens == tokens and s.replica is None), None)
        if match is None or worker not in urls:
            continue
        match.replica, match.credited = urls.index(worker), credited
    for s in sent:
        if s.replica is None:
            s.kind = "unmatched"
            continue
        s.in_flight = [sum(1 for o in sent if o is not s and o.replica == r and o.start < s.start < o.end)
                       for r in range(len(urls))]
        best = max(s.overlaps)
        if best > 0:
            s.kind = "followed the cache" if s.overlaps[s.replica] == best else "load over cache"
        elif any(o.tenant == s.tenant and o.start < s.start < o.end for o in sent if o is not s):
            s.kind = "prefix still computing"
        else:
            s.kind = "cold"


def lags(sent: list[Sent], index: EventIndex) -> list[float]:
    """Seconds from a request's send to its replica's first BlockStored of the request's first block."""
    out = []
    for s in sent:
        if s.replica is None or not s.keys or s.overlaps[s.replica] > 0:
            continue
        at = index.stored_at(s.replica, s.keys[0])
        if at is not None and at >= s.start:
            out.append(round(at - s.start, 2))
    return out


class TracedFleet(Fleet):
    """The fleet with vllm-router's decisions logged (and any extra router flags)."""

    extra: list[str] = []

    def _router_cmd(self) -> list[str]:
        return super()._router_cmd() + ["--log-level", "debug", *self.extra]


async def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args()
    systems = [system_prompt(t, args.system_words) for t in range(args.tenants)]
    log_dir = Path(tempfile.mkdtemp(prefix="kvarn-trace-"))
    config = FleetConfig(args.replicas, args.base_port, args.events_port, args.router_port, args.apc_memory_bytes,
                         log_dir)
    TracedFleet.extra = shlex.split(args.router_args)
    async with TracedFleet(config, "vllm-router", "kv_aware") as fleet:
        index = EventIndex([f"tcp://127.0.0.1:{args.events_port + 2 * i}" for i in range(args.replicas)])
        await asyncio.sleep(1.0)  # subscriptions settle
        started = time.monotonic()
        sent = await play(fleet, index, args, systems)
        wall = time.monotonic() - started
        await asyncio.sleep(1.0)
        index.close()
    classify(sent, decisions(log_dir / "router.log"), fleet.urls)
    write(args, sent, sorted(lags(sent, index)), wall, log_dir)


def write(args: argparse.Namespace, sent: list[Sent], lag: list[float], wall: float, log_dir: Path) -> None:
    counts: dict[str, int] = defaultdict(int)
    for s in sent:
        counts[s.kind] += 1
    data = {"command": "python bench/scale_out_trace.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
            "requests": len(sent), "wall_s": round(wall, 1), "kinds": dict(counts),
            "event_lag_s": lag, "router_log": str(log_dir / "router.log"),
            "sent": [{k: v for k, v in asdict(s).items() if k != "keys"} for s in sent]}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    lines = ["# vllm-router kv_aware: why each request went where it did", "", "```bash", data["command"], "```", "",
             f"{len(sent)} requests in {wall:.0f} s.", "", "| decision | requests |", "|---|---|"]
    lines += [f"| {kind} | {n} |" for kind, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    if lag:
        lines += ["", f"Events' lag (send to the replica's first BlockStored of the prompt, cold prompts): median "
                      f"{lag[len(lag) // 2]:.2f} s, {lag[0]:.2f}-{lag[-1]:.2f} s over {len(lag)} requests."]
    over = [s for s in sent if s.kind == "load over cache"]
    if over:
        lines += ["", "Load over cache, each: the chosen replica, every replica's cached blocks of the prompt (by "
                      "the events) and requests in flight at the send:", ""]
        lines += [f"- user {s.user} turn {s.turn}: chose {s.replica}, cached {s.overlaps}, in flight {s.in_flight}, "
                  f"credited {s.credited} tokens" for s in over[:12]]
    text = "\n".join(lines) + "\n"
    out.with_suffix(".md").write_text(text)
    print(text)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--tenants", type=int, default=6)
    parser.add_argument("--users", type=int, default=18)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--system-words", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--apc-memory-bytes", type=int, default=None, help="default: the replicas' own")
    parser.add_argument("--router-args", default="", help="more vllm-router flags, one string")
    parser.add_argument("--session-by-tenant", action="store_true",
                        help="send X-Session-ID: tenant-N (for --kv-aware-session-affinity-ttl-secs)")
    parser.add_argument("--base-port", type=int, default=8501)
    parser.add_argument("--events-port", type=int, default=5801)
    parser.add_argument("--router-port", type=int, default=8500)
    parser.add_argument("--out", default="bench/results/scale-out-kv-aware-trace")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main())
