"""kvarn replicas and a router on loopback, as processes ``bench/scale_out.py`` starts and stops.

Replica i serves ``http://127.0.0.1:BASE+i`` and publishes KV events on ``tcp://127.0.0.1:EV+2i``
(replay on the next port), as ``bench/scale_out.sh`` lays them out. The routers: SMG
(``smg launch``, health checked every second so a draining replica leaves its pool at once, with
retries) and vllm-router (``kv_aware`` fed by every replica's events, block size 16).
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger("scale_out")
REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "engine" / "bundled" / "fixture-chat-29m-q8"
EVENTS_BLOCK_SIZE = 16
START_TIMEOUT_S = 300.0


@dataclass
class FleetConfig:
    replicas: int
    base_port: int
    events_port: int
    router_port: int
    apc_memory_bytes: int | None
    log_dir: Path
    disk_dir: Path | None = None  # a shared --apc-disk-dir (None: memory tier only)
    restart_after_s: float = 20.0


async def prompt_counters(urls: list[str]) -> list[dict[str, float]]:
    """Each replica's prompt tokens and prompt tokens served from its prefix cache, so far."""
    names = {"kvarn_prompt_tokens_total": "prompt", "kvarn_prompt_cached_tokens_total": "cached"}
    out = []
    async with httpx.AsyncClient(timeout=30) as client:
        for url in urls:
            values = {"prompt": 0.0, "cached": 0.0}
            for family in text_string_to_metric_families((await client.get(url + "/metrics")).text):
                for sample in family.samples:
                    if sample.name in names:
                        values[names[sample.name]] = sample.value
            out.append(values)
    return out


async def wait_ok(url: str, proc: subprocess.Popen[bytes] | None = None, timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{url}: the process exited with {proc.returncode}")
            try:
                if (await client.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} was not ready in {timeout:.0f} s")
            await asyncio.sleep(0.3)


class Fleet:
    """N replicas (and a router unless ``router`` is None) for the length of an ``async with``."""

    def __init__(self, config: FleetConfig, router: str | None, policy: str | None) -> None:
        self.config, self.router, self.policy = config, router, policy
        self.procs: list[subprocess.Popen[bytes]] = []
        self.router_proc: subprocess.Popen[bytes] | None = None
        self.urls = [f"http://127.0.0.1:{config.base_port + i}" for i in range(config.replicas)]
        self.router_url = f"http://127.0.0.1:{config.router_port}"

    def _replica(self, i: int) -> subprocess.Popen[bytes]:
        c = self.config
        pub = c.events_port + 2 * i
        cmd = [sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port", str(c.base_port + i),
               "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}",
               "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{pub + 1}",
               "--kv-events-block-size", str(EVENTS_BLOCK_SIZE), "--kv-events-layout", "map",  # vllm-router's
               "--log-level", "warning"]
        if c.apc_memory_bytes:
            cmd += ["--apc-memory-bytes", str(c.apc_memory_bytes)]
        if c.disk_dir is not None:
            cmd += ["--apc-disk-dir", str(c.disk_dir)]
        log = (c.log_dir / f"replica-{i}.log").open("ab")
        return subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def _router_cmd(self) -> list[str]:
        c = self.config
        common = ["--host", "127.0.0.1", "--port", str(c.router_port), "--policy", str(self.policy),
                  "--prometheus-host", "127.0.0.1", "--prometheus-port", str(c.router_port + 1000),
                  "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                  "--health-success-threshold", "1", "--worker-urls", *self.urls]
        if self.router == "smg":
            return ["smg", "launch", *common]
        cmd = ["vllm-router", *common]
        if self.policy == "kv_aware":
            for i, url in enumerate(self.urls):
                pub = c.events_port + 2 * i
                cmd += ["--kv-event-source", f"{url}=tcp://127.0.0.1:{pub}",
                        "--kv-event-replay-source", f"{url}=tcp://127.0.0.1:{pub + 1}"]
            cmd += ["--kv-event-block-size", str(EVENTS_BLOCK_SIZE), "--kv-event-model", str(MODEL_DIR)]
        return cmd

    async def __aenter__(self) -> Fleet:
        self.procs = [self._replica(i) for i in range(self.config.replicas)]
        for url, proc in zip(self.urls, self.procs):
            await wait_ok(url + "/health", proc)
        if self.router is not None:
            log = (self.config.log_dir / "router.log").open("ab")
            self.router_proc = subprocess.Popen(self._router_cmd(), cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
            await wait_ok(self.router_url + "/v1/models", self.router_proc, timeout=120)
        logger.info("fleet up: %s behind %s %s (logs %s)", self.urls, self.router, self.policy, self.config.log_dir)
        return self

    async def __aexit__(self, *exc: object) -> None:
        for proc in ([self.router_proc] if self.router_proc else []) + self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in ([self.router_proc] if self.router_proc else []) + self.procs:
            try:
                await asyncio.to_thread(proc.wait, 60)
            except subprocess.TimeoutExpired:
                proc.kill()

    async def restart(self, i: int) -> int:
        """SIGTERM replica i, wait until it drained and exited, start it again; its exit code."""
        self.procs[i].send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(self.procs[i].wait, 120)
        self.procs[i] = self._replica(i)
        await wait_ok(self.urls[i] + "/health", self.procs[i])
        return code

    async def add_replica(self) -> str:
        """One more replica on the next port (same flags, same disk folder); its URL once served."""
        i = len(self.procs)
        self.procs.append(self._replica(i))
        self.urls.append(f"http://127.0.0.1:{self.config.base_port + i}")
        await wait_ok(self.urls[i] + "/health", self.procs[i])
        return self.urls[i]

    async def settle_disk(self, timeout: float = 120.0) -> None:
        """Wait until the disk tier's queued writes landed (its byte count holds still)."""
        last, deadline = None, time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=30) as client:
            while time.monotonic() < deadline:
                stats = [(await client.get(url + "/v1/cache/stats")).json().get("disk") or {} for url in self.urls]
                now = sum(s.get("bytes", 0) for s in stats)
                if now and now == last:
                    return
                last = now
                await asyncio.sleep(1.0)

    @staticmethod
    async def size_cache(args: Any, system: str, chatml: Any) -> dict[str, Any]:
        """A replica's ``--apc-memory-bytes`` for ``args.cache_share`` of the tenants' prefixes:
        one tenant's prompt is sent to a scratch replica, and its cache's bytes per block read back."""
        config = FleetConfig(1, args.base_port, args.events_port, args.router_port, None,
                             Path(tempfile.mkdtemp(prefix="kvarn-size-")))
        async with Fleet(config, None, None) as fleet:
            url = fleet.urls[0]
            async with httpx.AsyncClient(timeout=600) as client:
                prompt = chatml(system, [("hello", None)])
                tokens = (await client.post(url + "/tokenize", json={"prompt": prompt})).json()["count"]
                await client.post(url + "/v1/completions", json={"model": "fixture-chat-29m-q8", "prompt": prompt,
                                                                 "max_tokens": 1})
                memory = (await client.get(url + "/v1/cache/stats")).json()["memory"]
        block_bytes = memory["bytes"] / memory["blocks"]
        blocks_per_tenant = tokens // 128
        tenants_held = max(1, math.floor(args.tenants * args.cache_share))
        return {"prefix_tokens": tokens, "block_tokens": 128, "block_bytes": round(block_bytes),
                "blocks_per_tenant": blocks_per_tenant, "tenants_held_per_replica": tenants_held,
                "apc_memory_bytes": int(tenants_held * blocks_per_tenant * block_bytes)}
