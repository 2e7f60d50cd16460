"""Prefix cache over HTTP: TTFT cold / memory hit / disk hit after restart, agent-workload hit rate.

Measured against real `kvarn serve` processes (one at a time, each on a free loopback port,
always stopped in ``finally``).

Per layout in ``--schemes`` (default ``kvarn,fp16,affine``: KVarN k4v2, unquantized, affine
4-bit):

1. **TTFT** of ~``--prompt-tokens`` (3,500) token prompts on ``/v1/completions`` (streamed,
   temperature 0, ``--ttft-max-tokens`` tokens; TTFT = request sent to the first chunk that
   carries a token), for ``--prompts`` distinct prompts (disjoint slices of a text pool made of
   ``engine/data/kld_prompts.json`` and the repo's own docs, so no two share a block):

   - *cold*: a server started on an empty ``--apc-disk-dir``, warmed up, ``POST /v1/cache/reset``,
     then each prompt's first request (median over the prompts);
   - *memory hit*: each prompt again, ``--repeats`` times right after its cold request (median);
     then, to split a hit's TTFT into "restore + one step" and "prefill of the uncached rest",
     the prompt's token ids cut to (cached tokens + 1) are sent ``--repeats`` times as a token-id
     prompt (the whole cached prefix restored, a single token computed);
   - *disk hit after restart*: the server is stopped with SIGINT and waited for (its queued disk
     writes land before it exits), a new one is started on the same folder and warmed up, and
     each prompt's first request is timed (median); ``/v1/cache/stats`` deltas around every
     request say whether the blocks came from memory or disk.

   Warm-up of every fresh server (untimed): a 2-token request, then an unrelated ~640-token
   prompt twice (a cold prefill, then a memory hit), so model load and first-call costs of the
   prefill and restore paths are not charged to the cache.

   ``--probe`` (default off) also sends one more distinct prompt of ``--probe-tokens`` (1,200:
   three prefill chunks, the last holding a whole block) twice with ``max_tokens`` 1, then twice
   with 2, to record how many tokens a repeat finds cached: a request that finishes in the step
   of its last prefill chunk must still cache that chunk's blocks.

2. **Agent workload** (layouts in ``--agent-schemes``, default the first of ``--schemes``):
   ``--conversations`` chat conversations of up to ``--turns`` turns on
   ``/v1/chat/completions`` (streamed, ``max_tokens`` ``--agent-max-tokens``, temperature 0). All
   share one ~``--system-tokens`` system prompt; turn 1 is a user task, each later turn appends
   the assistant's reply and a new tool or user message of ``--message-tokens`` (100-300) tokens
   from the text pool (a tool result with no call to answer, as in every turn without
   ``--tool-calls``, is sent as a user message: a tool message needs a ``tool_call_id``). A
   conversation stops before its prompt would pass ``--agent-max-prompt-tokens`` or its prompt
   + ``max_tokens`` the context. Each conversation
   is a coroutine; at most ``--agent-concurrency`` requests are in flight, handed out first come
   first served, so turns interleave round-robin as agents' do. The same workload runs against a
   server with the prefix cache (memory tier, defaults) and one with ``--no-apc``; hit rate =
   sum of ``usage.prompt_tokens_details.cached_tokens`` / sum of ``usage.prompt_tokens``,
   cross-checked with the deltas of ``GET /v1/cache/stats``. ``--tool-calls`` makes the turns
   real tool calls (``bench/agent_tools.py``): tools on every request, a forced call after each
   user message, its result sent back as the next (tool) message, by ``tool_call_id``.

Writes ``--json-out`` (bench/results/apc.json) and ``--md-out`` (bench/results/apc.md), prints
the markdown tables. Server logs go to ``bench/out/`` (git-ignored).

    python bench/apc.py                                  # everything (~10 min on 2 CPU cores)
    python bench/apc.py --schemes kvarn                  # one layout (~6 min)
    python bench/apc.py --prompts 2 --repeats 3 --conversations 2 --turns 6   # shorter
    python bench/apc.py --skip-ttft --conversations 8    # the agent workload alone, 8 x 8 (~10 min)
    python bench/apc.py --skip-ttft --tool-calls         # the agent workload with real tool-call turns
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

import agent_tools  # bench/agent_tools.py: --tool-calls
from sse import sse_messages  # bench/sse.py (this script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "engine" / "bundled" / "fixture-chat-29m-q8"
LOGS = ROOT / "bench" / "out"

SCHEMES: dict[str, tuple[str, list[str]]] = {  # name -> (label, kvarn serve flags)
    "kvarn": ("kvarn k4v2 (default)", ["--kv-scheme", "kvarn"]),
    "kvarn-k4v4": ("kvarn k4v4", ["--kv-scheme", "kvarn", "--kv-bits", "4"]),
    "fp16": ("fp16", ["--kv-scheme", "fp16"]),
    "affine": ("affine 4-bit g64", ["--kv-scheme", "affine", "--kv-bits", "4"]),
}
TARGET_MEMORY_SPEEDUP = 20.0
TARGET_DISK_SPEEDUP = 10.0


class BenchError(RuntimeError):
    """A failure worth a clear one-line message (server did not start, bad response, ...)."""


def log(msg: str) -> None:
    print(f"[apc {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- text and tokens

class Tokens:
    """The served model's tokenizer (``tokenizers`` only, no MLX), to cut prompts to length."""

    def __init__(self, model_dir: Path) -> None:
        from tokenizers import Tokenizer

        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise BenchError(f"no tokenizer.json in {model_dir}: pass --model-dir with the served model's folder")
        self.tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Prompt token ids of ``messages`` rendered as ChatML with the generation prompt (the
        bundled model's template; the server's usage.prompt_tokens is the authority)."""
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        if messages[0]["role"] != "system":
            text = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n" + text
        return self.encode(text + "<|im_start|>assistant\n")

    def chat_tokens(self, messages: list[dict[str, str]]) -> int:
        return len(self.chat_ids(messages))


_SPECIAL = re.compile(r"<\|[A-Za-z0-9_]+\|>|\x1e")


def text_pool(tokens: Tokens) -> list[int]:
    """Token ids of the held-out KLD prompts, then the repo's docs, special markers removed."""
    texts = [p["text"] for p in json.loads((ROOT / "engine" / "data" / "kld_prompts.json").read_text())["prompts"]]
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        texts.append(path.read_text())
    ids: list[int] = []
    for text in texts:
        ids += tokens.encode(_SPECIAL.sub("\n", text) + "\n\n")
    return ids


def fit_text(tokens: Tokens, ids: list[int], n: int) -> str:
    """Text of about ``n`` tokens from ``ids`` (decoded, then trimmed until it re-encodes to <= n)."""
    cut = ids[:n]
    text = tokens.decode(cut)
    while len(tokens.encode(text)) > n and cut:
        cut = cut[:-1]
        text = tokens.decode(cut)
    return text


# --------------------------------------------------------------------------- servers

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """One ``kvarn serve`` process in its own session (process group)."""

    name: str
    args: list[str]
    command: list[str]
    ready_timeout: float
    stop_timeout: float
    port: int = 0
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    started_s: float = 0.0
    stop_info: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        LOGS.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.log_path = LOGS / f"apc-{self.name}.log"
        cmd = [*self.command, *self.args, "--port", str(self.port)]
        log(f"start {self.name}: {shlex.join(cmd)}  (log {self.log_path.relative_to(ROOT)})")
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = t0 + self.ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"server {self.name} exited with {self.proc.returncode} before it was ready; "
                                 f"last lines of {self.log_path}:\n{self.tail()}")
            try:
                r = httpx.get(self.url + "/v1/models", timeout=5.0)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.perf_counter() > deadline:
                raise BenchError(f"server {self.name} not ready after {self.ready_timeout:.0f}s; "
                                 f"last lines of {self.log_path}:\n{self.tail()}")
            time.sleep(0.25)
        self.started_s = time.perf_counter() - t0

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self) -> dict[str, Any]:
        """SIGINT (uvicorn's graceful shutdown: the engine closes and flushes its disk writes),
        wait; then SIGTERM, then SIGKILL to the whole process group. Returns how it went."""
        proc = self.proc
        if proc is None:
            return self.stop_info
        t0 = time.perf_counter()
        how = "sigint" if proc.poll() is None else "none (it had exited)"
        for sig, wait in ((signal.SIGINT, self.stop_timeout), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            if proc.poll() is not None:
                break
            how = sig.name.lower()
            try:
                if sig == signal.SIGKILL:
                    os.killpg(proc.pid, sig)
                else:
                    proc.send_signal(sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        try:  # anything left in its group (there should be nothing)
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        clean = how == "sigint" and proc.returncode == 0
        self.stop_info = {"signal": how, "returncode": proc.returncode, "clean": clean,
                          "stop_s": round(time.perf_counter() - t0, 3)}
        self.proc = None
        if not self.stop_info["clean"]:
            self.stop_info["log_tail"] = self.tail(3).splitlines()
            log(f"!! {self.name} did not stop cleanly: {self.stop_info}")
        return self.stop_info


class Servers:
    """Every server started, so ``finally`` can stop them all."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.live: list[Server] = []

    def start(self, name: str, flags: list[str]) -> Server:
        a = self.args
        server = Server(name, [*flags, *shlex.split(a.server_args)], shlex.split(a.server_cmd), a.ready_timeout,
                        a.stop_timeout)
        self.live.append(server)
        for attempt in range(3):
            try:
                server.start()
                return server
            except BenchError:  # the free port was taken between the probe and the bind: another one
                if attempt == 2 or "address already in use" not in server.tail().lower():
                    raise
                log(f"port {server.port} was taken; retrying {name} on another port")
        return server

    def stop(self, server: Server) -> dict[str, Any]:
        info = server.stop()
        if server in self.live:
            self.live.remove(server)
        return info

    def stop_all(self) -> None:
        for server in list(self.live):
            try:
                self.stop(server)
            except Exception as exc:  # noqa: BLE001 - keep stopping the others
                log(f"!! stopping {server.name}: {exc}")


# --------------------------------------------------------------------------- requests

@dataclass
class Result:
    ttft: float
    latency: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    text: str
    finish_reason: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


async def stream_request(client: httpx.AsyncClient, route: str, body: dict[str, Any]) -> Result:
    """One streamed request; TTFT = time to the first chunk that carries a token."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chat = route.endswith("chat/completions")
    t0 = time.perf_counter()
    first = None
    usage: dict[str, Any] | None = None
    parts: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    async with client.stream("POST", route, json=body) as r:
        if r.status_code != 200:
            detail = (await r.aread()).decode(errors="replace")[:500]
            raise BenchError(f"POST {route} answered {r.status_code}: {detail}")
        async for msg in sse_messages(r):
            if "error" in msg:
                raise BenchError(f"POST {route}: error in the stream: {msg['error']}")
            usage = msg.get("usage") or usage
            for choice in msg.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                agent_tools.assemble(calls, (choice.get("delta") or {}).get("tool_calls") if chat else None)
                if piece or choice.get("finish_reason") or calls:
                    first = first or time.perf_counter()
                if piece:
                    parts.append(piece)
                finish = choice.get("finish_reason") or finish
    end = time.perf_counter()
    if usage is None:
        raise BenchError(f"POST {route}: no usage chunk in the stream (stream_options.include_usage)")
    return Result((first or end) - t0, end - t0, usage["prompt_tokens"],
                  (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                  usage["completion_tokens"], "".join(parts), finish, [calls[i] for i in sorted(calls)])


async def get_json(client: httpx.AsyncClient, route: str) -> dict[str, Any]:
    r = await client.get(route)
    if r.status_code != 200:
        raise BenchError(f"GET {route} answered {r.status_code}: {r.text[:300]}")
    return r.json()


async def cache_reset(client: httpx.AsyncClient) -> dict[str, Any]:
    r = await client.post("/v1/cache/reset")
    if r.status_code != 200:
        raise BenchError(f"POST /v1/cache/reset answered {r.status_code}: {r.text[:300]}")
    return r.json()


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    if not after.get("enabled"):
        return {"enabled": False}
    keys = ("lookups", "query_tokens", "hit_tokens", "memory_hit_tokens", "disk_hit_tokens")
    d = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
    d["hit_rate"] = d["hit_tokens"] / d["query_tokens"] if d["query_tokens"] else 0.0
    return d


def client_for(server: Server, timeout: float, connections: int = 8) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(timeout, connect=10.0),
                             limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


async def warm_up(client: httpx.AsyncClient, model: str, warm_prompt: str) -> None:
    """Untimed: a tiny request, then an unrelated prompt twice (a prefill, then a cache hit)."""
    await stream_request(client, "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 2,
                                                     "temperature": 0})
    for _ in range(2):
        await stream_request(client, "/v1/completions", {"model": model, "prompt": warm_prompt, "max_tokens": 2,
                                                         "temperature": 0})


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def record(res: Result, delta: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    out = {**extra, "ttft_ms": round(res.ttft * 1e3, 2), "latency_ms": round(res.latency * 1e3, 2),
           "prompt_tokens": res.prompt_tokens, "cached_tokens": res.cached_tokens,
           "completion_tokens": res.completion_tokens}
    if delta is not None:
        out["stats_delta"] = delta
    return out


# --------------------------------------------------------------------------- part 1: TTFT

async def timed(client: httpx.AsyncClient, model: str, prompt: str | list[int], max_tokens: int,
                **extra: Any) -> dict[str, Any]:
    before = await get_json(client, "/v1/cache/stats")
    res = await stream_request(client, "/v1/completions", {"model": model, "prompt": prompt,
                                                           "max_tokens": max_tokens, "temperature": 0})
    after = await get_json(client, "/v1/cache/stats")
    return record(res, stats_delta(before, after), **extra)


def disk_files(folder: Path) -> tuple[int, int]:
    files = [p for p in folder.rglob("*.blk") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


async def ttft_scheme(args: argparse.Namespace, servers: Servers, scheme: str, prompts: list[str],
                      prompt_ids: list[list[int]], probe: str | None, warm_prompt: str, work: Path) -> dict[str, Any]:
    label, flags = SCHEMES[scheme]
    disk = work / f"disk-{scheme}"
    if disk.exists():
        shutil.rmtree(disk)
    disk.mkdir(parents=True)
    flags = [*flags, "--apc-disk-dir", str(disk)]
    out: dict[str, Any] = {"scheme": scheme, "label": label, "server_flags": flags[:-1] + ["<empty dir>"],
                           "max_tokens": args.ttft_max_tokens}
    t_phase = time.perf_counter()

    server = servers.start(f"ttft-{scheme}-1", flags)
    async with client_for(server, args.request_timeout) as client:
        model = (await get_json(client, "/v1/models"))["data"][0]
        out["kv_cache"], out["model"] = model["kv_cache"], model["id"]
        out["context_length"] = model["context_length"]
        await warm_up(client, model["id"], warm_prompt)
        out["reset"] = await cache_reset(client)
        cold, memory, rest1 = [], [], []
        for i, prompt in enumerate(prompts):
            r = await timed(client, model["id"], prompt, args.ttft_max_tokens, prompt_index=i)
            cold.append(r)
            log(f"{scheme} prompt {i}: cold {r['ttft_ms']:.0f} ms ({r['prompt_tokens']} tokens, "
                f"{r['cached_tokens']} cached)")
            if r["cached_tokens"]:
                log(f"!! {scheme} prompt {i}: a cold request found {r['cached_tokens']} cached tokens")
            for k in range(args.repeats):
                m = await timed(client, model["id"], prompt, args.ttft_max_tokens, prompt_index=i, repeat=k)
                memory.append(m)
            cut = prompt_ids[i][:memory[-1]["cached_tokens"] + 1]
            for k in range(args.repeats if memory[-1]["cached_tokens"] else 0):
                rest1.append(await timed(client, model["id"], cut, args.ttft_max_tokens, prompt_index=i, repeat=k))
            log(f"{scheme} prompt {i}: memory hit median "
                f"{median([m['ttft_ms'] for m in memory if m['prompt_index'] == i]):.0f} ms "
                f"({memory[-1]['cached_tokens']} cached); with a 1-token rest "
                f"{median([m['ttft_ms'] for m in rest1 if m['prompt_index'] == i]) or 0:.0f} ms "
                f"({rest1[-1]['cached_tokens'] if rest1 else '-'} of {len(cut)} cached)")
        out["stats_server1"] = await get_json(client, "/v1/cache/stats")
    out["server1_start_s"] = round(server.started_s, 2)
    out["server1_stop"] = servers.stop(server)
    out["disk_files_after_stop"], out["disk_bytes_after_stop"] = disk_files(disk)

    server = servers.start(f"ttft-{scheme}-2", flags)
    async with client_for(server, args.request_timeout) as client:
        await warm_up(client, out["model"], warm_prompt)
        restart = []
        for i, prompt in enumerate(prompts):
            r = await timed(client, out["model"], prompt, args.ttft_max_tokens, prompt_index=i)
            restart.append(r)
            d = r["stats_delta"]
            log(f"{scheme} prompt {i}: after restart {r['ttft_ms']:.0f} ms ({r['cached_tokens']} cached: "
                f"{d.get('disk_hit_tokens')} from disk, {d.get('memory_hit_tokens')} from memory)")
        if probe is not None:
            first = await timed(client, out["model"], probe, 1, probe="max_tokens=1, first")
            again = await timed(client, out["model"], probe, 1, probe="max_tokens=1, repeat")
            third = await timed(client, out["model"], probe, 2, probe="max_tokens=2 after them")
            fourth = await timed(client, out["model"], probe, 2, probe="max_tokens=2, repeat")
            out["probe_max_tokens_1"] = [first, again, third, fourth]
            log(f"{scheme} probe: max_tokens=1 repeat finds {again['cached_tokens']} cached "
                f"({again['ttft_ms']:.0f} ms); after a max_tokens=2 request {fourth['cached_tokens']} "
                f"({fourth['ttft_ms']:.0f} ms)")
        out["stats_server2"] = await get_json(client, "/v1/cache/stats")
    out["server2_start_s"] = round(server.started_s, 2)
    out["server2_stop"] = servers.stop(server)

    out["cold"], out["memory_hit"], out["disk_hit_after_restart"] = cold, memory, restart
    out["memory_hit_1_token_rest"] = rest1
    c = median([r["ttft_ms"] for r in cold])
    m = median([r["ttft_ms"] for r in memory])
    d = median([r["ttft_ms"] for r in restart])
    out["summary"] = {
        "prompt_tokens": median([r["prompt_tokens"] for r in cold]),
        "cold_ttft_ms": c, "memory_hit_ttft_ms": m, "disk_hit_ttft_ms": d,
        "uncached_tokens_memory_hit": median([r["prompt_tokens"] - r["cached_tokens"] for r in memory]),
        "memory_hit_1_token_rest_ttft_ms": median([r["ttft_ms"] for r in rest1]),
        "memory_hit_1_token_rest_cached_tokens": sorted({r["cached_tokens"] for r in rest1}),
        "cold_cached_tokens": sorted({r["cached_tokens"] for r in cold}),
        "memory_cached_tokens": sorted({r["cached_tokens"] for r in memory}),
        "disk_cached_tokens": sorted({r["cached_tokens"] for r in restart}),
        "disk_hit_tokens_from_stats": sum(r["stats_delta"].get("disk_hit_tokens", 0) for r in restart),
        "speedup_memory": c / m if c and m else None,
        "speedup_disk": c / d if c and d else None,
    }
    s = out["summary"]
    s["memory_target_met"] = bool(s["speedup_memory"] and s["speedup_memory"] >= TARGET_MEMORY_SPEEDUP)
    s["disk_target_met"] = bool(s["speedup_disk"] and s["speedup_disk"] >= TARGET_DISK_SPEEDUP)
    out["wall_s"] = round(time.perf_counter() - t_phase, 1)
    return out


# --------------------------------------------------------------------------- part 2: agent workload

@dataclass
class Conversation:
    index: int
    messages: list[dict[str, str]]
    pending: list[tuple[str, str]]  # (role, content) of the turns to come, in order


def make_workload(args: argparse.Namespace, tokens: Tokens, pool: list[int]) -> tuple[str, list[Conversation]]:
    """One shared system prompt and, per conversation, its turn messages (the replies come from
    the server). Deterministic given --seed."""
    rng = random.Random(args.seed)
    head = ("You are a coding agent working in the kvarn repository (an OpenAI-compatible LLM server on MLX "
            "with a quantized KV cache). You read files, run tools and answer precisely. Tool results arrive as "
            "messages of the tool role. Keep answers short. Reference material follows.\n\n")
    need = args.system_tokens - len(tokens.encode(head))
    system = head + fit_text(tokens, pool[len(pool) // 2:], max(need, 1))
    tools = ("cat", "grep -n", "sed -n 1,80p", "git show HEAD:", "less")
    convs = []
    for k in range(args.conversations):
        pending = []
        for t in range(args.turns):
            n = rng.randint(args.message_tokens[0], args.message_tokens[1])
            start = rng.randrange(0, len(pool) - n - 1)
            excerpt = fit_text(tokens, pool[start:], n - 24)
            if t == 0:
                pending.append(("user", f"Task {k}: read the excerpt below and explain what it does, then say "
                                        f"which file you want to look at next.\n\n{excerpt}"))
            elif t % 2 == 1:
                pending.append(("tool", f"$ {rng.choice(tools)} <file {rng.randrange(100)}>\n{excerpt}"))
            else:
                pending.append(("user", f"Good. Now compare that with this part and list the differences:\n\n"
                                        f"{excerpt}"))
        convs.append(Conversation(k, [{"role": "system", "content": system}], pending))
    return system, convs


def reuse_bounds(records: list[dict[str, Any]], common: int, G: int) -> None:
    """``bound``: the most prompt tokens a request could find cached in whole blocks: turn 1, the
    blocks of the prefix all conversations share (none for the first one sent); later turns, the
    blocks of the conversation's previous sequence (prompt + reply, less the last sampled token,
    whose KV is never computed). Both capped at the blocks before the prompt's last token."""
    by = {(r["conv"], r["turn"]): r for r in records}
    first = min((r for r in records if r["turn"] == 1), key=lambda r: r["start_s"], default=None)
    for r in records:
        cap = (r["prompt_tokens"] - 1) // G * G
        if r["turn"] == 1:
            r["bound"] = 0 if r is first else min(common // G * G, cap)
        else:
            prev = by.get((r["conv"], r["turn"] - 1))
            seen = prev["prompt_tokens"] + prev["completion_tokens"] - 1 if prev else 0
            r["bound"] = min(seen // G * G, cap)


async def agent_run(args: argparse.Namespace, server: Server, tokens: Tokens, system: str,
                    convs: list[Conversation], context: int, model: str, block_size: int) -> dict[str, Any]:
    sem = asyncio.Semaphore(args.agent_concurrency)
    records: list[dict[str, Any]] = []
    stops: dict[int, str] = {}

    async with client_for(server, args.request_timeout, args.agent_concurrency + 4) as client:
        async def converse(conv: Conversation) -> None:
            messages = [dict(m) for m in conv.messages]
            for turn, (role, content) in enumerate(conv.pending):
                message = agent_tools.turn_message(role, content, messages)
                candidate = messages + [message]
                estimate = tokens.chat_tokens(candidate)
                if estimate > args.agent_max_prompt_tokens or estimate + args.agent_max_tokens > context:
                    stops[conv.index] = f"before turn {turn + 1}: prompt would be ~{estimate} tokens"
                    return
                messages = candidate
                async with sem:
                    start = time.perf_counter() - t0
                    res = await stream_request(client, "/v1/chat/completions", {
                        "model": model, "messages": messages, "max_tokens": args.agent_max_tokens,
                        "temperature": 0, **(agent_tools.request_fields(messages) if args.tool_calls else {})})
                records.append(record(res, conv=conv.index, turn=turn + 1, role=message["role"], estimate=estimate,
                                      finish_reason=res.finish_reason, start_s=round(start, 3),
                                      end_s=round(time.perf_counter() - t0, 3), tool_calls=len(res.tool_calls)))
                messages = messages + [agent_tools.reply_message(res.text, res.tool_calls)]
            stops[conv.index] = f"after {len(conv.pending)} turns"

        before = await get_json(client, "/v1/cache/stats")
        t0 = time.perf_counter()
        await asyncio.gather(*(converse(c) for c in convs))
        wall = time.perf_counter() - t0
        after = await get_json(client, "/v1/cache/stats")

    records.sort(key=lambda r: (r["conv"], r["turn"]))
    firsts = [tokens.chat_ids([*c.messages, {"role": c.pending[0][0], "content": c.pending[0][1]}]) for c in convs]
    calls = sum(r["tool_calls"] for r in records)
    common = min(len(f) for f in firsts)
    for f in firsts[1:]:
        common = next((i for i, (a, b) in enumerate(zip(firsts[0][:common], f)) if a != b), common)
    reuse_bounds(records, common, block_size)
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    bound = sum(r["bound"] for r in records)
    turns = sorted({r["turn"] for r in records})
    per_turn = []
    for t in turns:
        rs = [r for r in records if r["turn"] == t]
        per_turn.append({"turn": t, "requests": len(rs),
                         "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in rs),
                         "mean_hit_rate": statistics.fmean(r["cached_tokens"] / r["prompt_tokens"] for r in rs),
                         "mean_bound_rate": statistics.fmean(r["bound"] / r["prompt_tokens"] for r in rs),
                         "ttft_ms_mean": statistics.fmean(r["ttft_ms"] for r in rs)})
    delta = stats_delta(before, after)
    check = None
    if delta.get("enabled", True) and after.get("enabled"):
        check = {"stats_hit_tokens": delta["hit_tokens"], "usage_cached_tokens": cached,
                 "stats_query_tokens": delta["query_tokens"], "usage_prompt_tokens": prompt,
                 "stats_lookups": delta["lookups"], "requests": len(records),
                 "agree": delta["hit_tokens"] == cached and delta["query_tokens"] == prompt
                 and delta["lookups"] == len(records)}
    return {"requests": len(records), "prompt_tokens": prompt, "cached_tokens": cached, "tool_calls": calls,
            "completion_tokens": sum(r["completion_tokens"] for r in records),
            "hit_rate": cached / prompt if prompt else 0.0, "wall_s": round(wall, 2),
            "reusable_bound_tokens": bound, "bound_rate": bound / prompt if prompt else 0.0,
            "shared_turn1_prefix_tokens": common,
            "ttft_ms_mean": statistics.fmean(r["ttft_ms"] for r in records) if records else None,
            "ttft_ms_median": median([r["ttft_ms"] for r in records]),
            "per_turn": per_turn, "stats_delta": delta, "stats_check": check,
            "stats_after": after, "conversation_ends": {str(k): v for k, v in sorted(stops.items())},
            "records": records}


async def agent_scheme(args: argparse.Namespace, servers: Servers, scheme: str, tokens: Tokens, system: str,
                       convs: list[Conversation], warm_prompt: str) -> dict[str, Any]:
    label, flags = SCHEMES[scheme]
    out: dict[str, Any] = {"scheme": scheme, "label": label}
    block_size = 128
    for mode, extra in (("apc", []), ("no_apc", ["--no-apc"])):
        server = servers.start(f"agent-{scheme}-{mode}", [*flags, *extra])
        try:
            async with client_for(server, args.request_timeout) as client:
                model = (await get_json(client, "/v1/models"))["data"][0]
                await warm_up(client, model["id"], warm_prompt)
                if mode == "apc":
                    await cache_reset(client)
                    block_size = (await get_json(client, "/v1/cache/stats")).get("block_size") or block_size
            log(f"agent {scheme} {mode}: {len(convs)} conversations x up to {args.turns} turns, "
                f"concurrency {args.agent_concurrency}")
            run = await agent_run(args, server, agent_tools.TemplateTokens(args.model_dir) if args.tool_calls
                                  else tokens, system, convs, model["context_length"], model["id"], block_size)
        finally:
            out[f"{mode}_stop"] = servers.stop(server)
        run["server_flags"] = [*flags, *extra]
        out[mode] = run
        out["model"], out["context_length"], out["block_size"] = model["id"], model["context_length"], block_size
        log(f"agent {scheme} {mode}: {run['requests']} requests, {run['prompt_tokens']} prompt tokens, "
            f"{run['cached_tokens']} cached ({run['hit_rate']:.1%}), wall {run['wall_s']:.1f}s")
    on, off = out["apc"], out["no_apc"]
    out["time_saved_s"] = round(off["wall_s"] - on["wall_s"], 2)
    out["wall_speedup"] = off["wall_s"] / on["wall_s"] if on["wall_s"] else None
    return out


# --------------------------------------------------------------------------- report

def f0(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def fx(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}x"


def stop_text(info: dict[str, Any]) -> str:
    """How a server ended, e.g. 'SIGINT, exit 0 in 0.4 s' or '..., killed by SIGABRT (-6) ...'."""
    if not info:
        return "(not recorded)"
    rc = info.get("returncode")
    if isinstance(rc, int) and rc < 0:
        try:
            end = f"killed by {signal.Signals(-rc).name} ({rc})"
        except ValueError:
            end = f"exit {rc}"
    else:
        end = f"exit {rc}"
    tail = info.get("log_tail") or []
    return f"{str(info.get('signal', '?')).upper()}, {end} in {info.get('stop_s')} s" + \
        ("" if info.get("clean") else " (NOT clean" + (f"; its log ends: `{tail[-1]}`" if tail else "") + ")")


def row(*cells: Any) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(head: list[str]) -> list[str]:
    return [row(*head), "|" + "---|" * len(head)]


def header_lines(report: dict[str, Any]) -> list[str]:
    g = report.get("git") or {}
    dirty = [line[3:] for line in g.get("status", []) if not line[3:].startswith("bench/")]
    code = f"Code: commit {g.get('head', '?')[:12]}"
    if dirty:
        code += f" plus uncommitted changes to {', '.join(dirty)}"
    machine = f"Machine: {report['machine']}."
    if report.get("model"):
        machine += (f" Model: {report['model']} (context {report.get('context_length')}, "
                    f"blocks of {report.get('block_size')} tokens).")
    return [f"Command: `{report['command']}`", "", code + ".", "", machine, ""]


def ttft_lines(report: dict[str, Any]) -> list[str]:
    a = report["settings"]
    lines = [f"### TTFT of a ~{a['prompt_tokens']:,}-token prompt: cold, memory hit, disk hit after restart", "",
             f"`/v1/completions`, streamed, temperature 0, max_tokens {a['ttft_max_tokens']}; cold = median over "
             f"{a['prompts']} distinct prompts, each the first request on a reset cache; memory hit = median of "
             f"{a['repeats']} repeats of each; disk = the first request of each prompt on a new server started "
             f"on the same `--apc-disk-dir` after the first one exited (SIGINT).", ""]
    lines += table(["layout", "prompt tokens", "cold TTFT ms", "memory hit ms", "cached (memory)",
                    "disk hit after restart ms", "cached (disk, of which from disk)", "cold / memory", "cold / disk",
                    "memory hit, 1-token rest ms"])
    for t in report["ttft"]:
        s = t["summary"]
        disk = (f"{'/'.join(map(str, s['disk_cached_tokens']))} ({s['disk_hit_tokens_from_stats']:,} over "
                f"{len(t['disk_hit_after_restart'])} requests)")
        lines.append(row(t["label"], f0(s["prompt_tokens"]), f0(s["cold_ttft_ms"]), f0(s["memory_hit_ttft_ms"]),
                         "/".join(map(str, s["memory_cached_tokens"])), f0(s["disk_hit_ttft_ms"]), disk,
                         f"**{fx(s['speedup_memory'])}**", f"**{fx(s['speedup_disk'])}**",
                         f0(s["memory_hit_1_token_rest_ttft_ms"])))
    lines += ["", "Last column: the cached prefix restored and one token computed (the prompt's token ids cut to "
                  "cached + 1), i.e. a hit's TTFT without the prefill of its uncached rest (prompt - cached tokens).",
              "", f"Targets: memory hit >= {TARGET_MEMORY_SPEEDUP:.0f}x faster than cold, disk hit after restart "
                  f">= {TARGET_DISK_SPEEDUP:.0f}x."]
    for t in report["ttft"]:
        s = t["summary"]
        lines.append(f"- {t['label']}: memory {fx(s['speedup_memory'])} "
                     f"({'met' if s['memory_target_met'] else 'NOT met'}), disk {fx(s['speedup_disk'])} "
                     f"({'met' if s['disk_target_met'] else 'NOT met'}); the first server stopped on "
                     f"{stop_text(t['server1_stop'])}, leaving {t['disk_files_after_stop']} block files "
                     f"({t['disk_bytes_after_stop'] / 2**20:.1f} MiB) on disk; the restarted one on "
                     f"{stop_text(t['server2_stop'])}.")
    probes = [t for t in report["ttft"] if t.get("probe_max_tokens_1")]
    if probes:
        lines += ["", f"Probe: one more distinct prompt of {a['probe_tokens']:,} tokens (after the restart), sent "
                      "with max_tokens 1 twice, then with max_tokens 2 twice (cached tokens / TTFT ms); the repeats "
                      "must find every whole block but the one holding the last token cached:", ""]
        lines += table(["layout", "1st, max_tokens 1", "repeat, max_tokens 1", "then max_tokens 2",
                        "repeat, max_tokens 2"])
        for t in probes:
            lines.append(row(t["label"], *(f"{p['cached_tokens']} / {f0(p['ttft_ms'])}"
                                           for p in t["probe_max_tokens_1"])))
    return lines


def agent_lines(report: dict[str, Any]) -> list[str]:
    a = report["settings"]
    lines = ["", "### Agent-like multi-turn workload", "",
             f"{a['conversations']} conversations x up to {a['turns']} turns on `/v1/chat/completions` (streamed, "
             f"max_tokens {a['agent_max_tokens']}, temperature 0), shared system prompt of "
             f"{report.get('system_prompt_tokens', '?')} tokens, new tool/user messages of "
             f"{a['message_tokens'][0]}-{a['message_tokens'][1]} tokens, conversations stop before "
             f"{a['agent_max_prompt_tokens']:,} prompt tokens; {a['agent_concurrency']} requests in flight. "
             f"Hit rate = cached / prompt tokens from `usage`; reusable = the most a request could find cached "
             f"in whole blocks (turn 1: the blocks of the prefix every conversation shares, "
             f"{report.get('shared_turn1_prefix_tokens', '?')} tokens, none for the first conversation sent; "
             f"later turns: the blocks of the conversation's previous prompt + reply).", ""]
    if a.get("tool_calls"):
        lines[-1:-1] = ["", f"With real tool calls (`--tool-calls`): every request carries {len(agent_tools.TOOLS)} "
                        f"tools; a request after a user message forces one call (`tool_choice: required`), whose "
                        f"result is the next (tool) message, answered by `tool_call_id`; after a result, "
                        f"`tool_choice: auto`. Calls made: "
                        + ", ".join(f"{g['label']} {g['apc']['tool_calls']} / {g['no_apc']['tool_calls']}"
                                    for g in report["agent"]) + " (cache on / off).", ""]
    lines += table(["layout", "prefix cache", "requests", "prompt tokens", "cached tokens", "hit rate",
                    "reusable (hit rate bound)", "/v1/cache/stats hit / query tokens", "mean TTFT ms", "wall s"])
    for g in report["agent"]:
        for mode, name in (("apc", "on"), ("no_apc", "off (`--no-apc`)")):
            r = g[mode]
            d, check = r["stats_delta"], r["stats_check"]
            st = "cache off" if check is None else \
                f"{d['hit_tokens']:,} / {d['query_tokens']:,} " + ("(agrees)" if check["agree"] else "(DIFFERS)")
            lines.append(row(g["label"], name, r["requests"], f"{r['prompt_tokens']:,}", f"{r['cached_tokens']:,}",
                             f"**{r['hit_rate']:.1%}**", f"{r['reusable_bound_tokens']:,} ({r['bound_rate']:.1%})",
                             st, f0(r["ttft_ms_mean"]), f"{r['wall_s']:.1f}"))
    for g in report["agent"]:
        lines.append(f"\n{g['label']}: time saved {g['time_saved_s']:.1f} s of {g['no_apc']['wall_s']:.1f} s "
                     f"({fx(g['wall_speedup'])} faster wall time with the prefix cache).")
        for mode in ("apc", "no_apc"):
            if not g.get(f"{mode}_stop", {}).get("clean", True):
                lines.append(f"The {mode.replace('_', '-')} server stopped on {stop_text(g[f'{mode}_stop'])}.")
    for g in report["agent"]:
        on = {p["turn"]: p for p in g["apc"]["per_turn"]}
        off = {p["turn"]: p for p in g["no_apc"]["per_turn"]}
        lines += ["", f"Per turn index, {g['label']} (means over the conversations that reached the turn):", ""]
        lines += table(["turn", "requests", "prompt tokens", "hit rate", "reusable", "TTFT ms, cache on",
                        "TTFT ms, `--no-apc`"])
        for t in sorted(on):
            p, q = on[t], off.get(t)
            lines.append(row(t, p["requests"], f"{p['prompt_tokens_mean']:,.0f}", f"{p['mean_hit_rate']:.1%}",
                             f"{p['mean_bound_rate']:.1%}", f"{p['ttft_ms_mean']:,.0f}",
                             f0(q["ttft_ms_mean"]) if q else "-"))
    return lines


def markdown(report: dict[str, Any]) -> str:
    lines = header_lines(report)
    if report["ttft"]:
        lines += ttft_lines(report)
    if report["agent"]:
        lines += agent_lines(report)
    load = report.get("loadavg") or {}
    lines += ["", f"Total bench wall time: {report['wall_s']:.0f} s (1-minute load average {load.get('start', '?')} "
                  f"at the start, {load.get('end', '?')} at the end). Raw: `{report['json_out']}`."]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)) + "\n"


# --------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--schemes", default="kvarn,fp16,affine",
                    help=f"comma-separated layouts for the TTFT part, of {', '.join(SCHEMES)}")
    ap.add_argument("--agent-schemes", default=None,
                    help="layouts for the agent workload (default: the first of --schemes; 'none' skips it)")
    ap.add_argument("--skip-ttft", action="store_true", help="run only the agent workload")
    ap.add_argument("--prompt-tokens", type=int, default=3500)
    ap.add_argument("--prompts", type=int, default=3, help="distinct prompts (each measured cold once)")
    ap.add_argument("--repeats", type=int, default=5, help="memory-hit repeats per prompt")
    ap.add_argument("--ttft-max-tokens", type=int, default=2,
                    help="max_tokens of the TTFT requests (1 leaves the last prefill chunk uncached: see --probe)")
    ap.add_argument("--probe", action=argparse.BooleanOptionalAction, default=False,
                    help="per layout, also record what a max_tokens=1 request leaves cached")
    ap.add_argument("--probe-tokens", type=int, default=1200, help="length of the probe's prompt")
    ap.add_argument("--conversations", type=int, default=4,
                    help="agent conversations (8 doubles the agent part's time: ~10 min on 2 CPU cores)")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=360)
    ap.add_argument("--message-tokens", type=int, nargs=2, default=(100, 300), metavar=("MIN", "MAX"))
    ap.add_argument("--agent-max-tokens", type=int, default=64)
    ap.add_argument("--agent-max-prompt-tokens", type=int, default=3200)
    ap.add_argument("--agent-concurrency", type=int, default=4)
    ap.add_argument("--tool-calls", action="store_true",
                    help="agent turns with real tool calls: tools on every request, a forced call after each user "
                         "message, its result sent back as a tool message (bench/agent_tools.py)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", type=Path, default=BUNDLED,
                    help="folder of the served model (its tokenizer.json cuts prompts to length)")
    ap.add_argument("--server-cmd", default=f"{shlex.quote(sys.executable)} -m server.cli serve",
                    help="how to run `kvarn serve` (run from the repo root), e.g. 'kvarn serve'")
    ap.add_argument("--server-args", default="", help="extra flags for every server (e.g. a model folder)")
    ap.add_argument("--ready-timeout", type=float, default=180.0, help="seconds for a server to answer /v1/models")
    ap.add_argument("--stop-timeout", type=float, default=60.0, help="seconds to wait for a SIGINT shutdown")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--work-dir", type=Path, default=None, help="disk tiers go here (default: a temporary folder)")
    ap.add_argument("--json-out", type=Path, default=ROOT / "bench" / "results" / "apc.json")
    ap.add_argument("--md-out", type=Path, default=ROOT / "bench" / "results" / "apc.md")
    ap.add_argument("--render", type=Path, default=None, metavar="JSON",
                    help="only write --md-out (and print it) from a report this script wrote; runs nothing")
    args = ap.parse_args(argv)
    names = [s.strip() for s in args.schemes.split(",") if s.strip()]
    agent = names[:1] if args.agent_schemes is None else \
        [s.strip() for s in args.agent_schemes.split(",") if s.strip() and s.strip() != "none"]
    for s in names + agent:
        if s not in SCHEMES:
            ap.error(f"unknown layout {s!r}: choose from {', '.join(SCHEMES)}")
    args.scheme_list, args.agent_list = ([] if args.skip_ttft else names), agent
    if args.prompts < 1 or args.repeats < 1 or args.prompt_tokens < 256:
        ap.error("--prompts and --repeats must be >= 1 and --prompt-tokens >= 256")
    if not 0 < args.message_tokens[0] <= args.message_tokens[1]:
        ap.error("--message-tokens MIN MAX with 0 < MIN <= MAX")
    return args


def git_state() -> dict[str, Any]:
    """The commit and the uncommitted changes the servers ran with (they run this working tree)."""
    def git(*cmd: str) -> str:
        try:
            return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"head": git("rev-parse", "HEAD").strip(), "status": git("status", "--porcelain").splitlines()}


async def main_async(args: argparse.Namespace, servers: Servers, work: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    tokens = Tokens(args.model_dir)
    pool = text_pool(tokens)
    n = args.prompt_tokens
    need = args.prompts * n + (args.probe_tokens if args.probe else 0) + 700
    if need > len(pool):
        raise BenchError(f"the text pool has {len(pool):,} tokens; {args.prompts} prompts of {n:,} tokens "
                         f"(+ probe + warm-up) need {need:,}: lower --prompts or --prompt-tokens")
    prompts = [fit_text(tokens, pool[i * n:], n) for i in range(args.prompts)]
    prompt_ids = [tokens.encode(p) for p in prompts]  # the server's tokenizer, the same file
    probe = fit_text(tokens, pool[args.prompts * n:], args.probe_tokens) if args.probe else None
    warm_prompt = fit_text(tokens, pool[-700:], 640)  # disjoint from the prompts
    cmd = os.environ.get("APC_BENCH_COMMAND") or shlex.join(["python", "bench/apc.py", *sys.argv[1:]])
    report: dict[str, Any] = {
        "command": cmd, "machine": f"{os.cpu_count()} CPU cores, {sys.platform}",
        "settings": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()
                     if k not in ("json_out", "md_out", "model_dir", "work_dir")},
        "json_out": str(args.json_out.relative_to(ROOT) if args.json_out.is_relative_to(ROOT) else args.json_out),
        "pool_tokens": len(pool), "ttft": [], "agent": [], "loadavg": {"start": round(os.getloadavg()[0], 2)}}
    report["git"] = git_state()
    try:  # metadata only: the bench process never imports MLX
        from importlib.metadata import version
        report["versions"] = {"mlx": version("mlx"), "mlx-lm": version("mlx-lm")}
    except Exception:  # noqa: BLE001
        pass
    for scheme in args.scheme_list:
        log(f"== TTFT: {scheme}")
        t = await ttft_scheme(args, servers, scheme, prompts, prompt_ids, probe, warm_prompt, work)
        report["ttft"].append(t)
        report.update(model=t["model"], context_length=t["context_length"],
                      block_size=t["stats_server1"].get("block_size"))
        s = t["summary"]
        log(f"{scheme}: cold {s['cold_ttft_ms']:.0f} ms, memory {s['memory_hit_ttft_ms']:.0f} ms, "
            f"disk {s['disk_hit_ttft_ms']:.0f} ms ({t['wall_s']:.0f}s)")
    if args.agent_list:
        system, convs = make_workload(args, tokens, pool)
        report["system_prompt_tokens"] = tokens.chat_tokens([{"role": "system", "content": system}]) - 3
        for scheme in args.agent_list:
            log(f"== agent workload: {scheme}")
            report["agent"].append(await agent_scheme(args, servers, scheme, tokens, system, convs, warm_prompt))
            g = report["agent"][-1]
            report["shared_turn1_prefix_tokens"] = g["apc"]["shared_turn1_prefix_tokens"]
            for key in ("model", "context_length", "block_size"):
                report.setdefault(key, g[key])
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    report["loadavg"]["end"] = round(os.getloadavg()[0], 2)
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.render is not None:
        text = markdown(json.loads(args.render.read_text()))
        args.md_out.write_text("# Prefix cache (APC) benchmark\n\n" + text)
        print(text)
        return 0
    servers = Servers(args)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="kvarn-apc-"))
    work.mkdir(parents=True, exist_ok=True)

    def on_term(signum, frame):  # noqa: ARG001 - a SIGTERM to the bench stops its servers too
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        report = asyncio.run(main_async(args, servers, work))
    except BenchError as exc:
        print(f"apc bench failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("apc bench interrupted", file=sys.stderr)
        return 130
    finally:
        servers.stop_all()
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    text = markdown(report)
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(report, indent=2) + "\n")
    args.md_out.write_text("# Prefix cache (APC) benchmark\n\n" + text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
