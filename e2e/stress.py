"""Stress and correctness run against a live kvarn server, over HTTP only.

    kvarn stress --base-url http://127.0.0.1:8123 --scheme kvarn --bits k4v2 --json out.json
    python -m e2e.stress ...    (the same, from any folder once kvarn is installed)

Before any load it reads ``GET /v1/models`` and refuses to run (exit 3) when the served KV
layout is not the one stated by ``--scheme``/``--bits``. Exit codes: 0 every check passed,
1 some check failed, 2 bad arguments, 3 KV layout or model mismatch, 4 server not reachable/ready.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from e2e.client import get_json, make_client
from e2e.context import Context
from e2e.report import markdown
from e2e.scenarios import SCENARIOS, run_scenario

logger = logging.getLogger("e2e.stress")

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_MISMATCH, EXIT_UNREACHABLE = 0, 1, 2, 3, 4
FP16_BITS = (16, 32)  # fp16 keeps K/V in the compute dtype: float16/bfloat16 on a GPU, float32 on the CPU


class SetupError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse_bits(text: str) -> tuple[int, int]:
    """``--bits``: one width for keys and values (``4``), or both as the layouts write them (``k4v2``)."""
    match = re.fullmatch(r"\s*(?:(\d+)|k(\d+)v(\d+))\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(f"not bits: {text!r} (e.g. 4, or k4v2 for 4-bit keys and 2-bit values)")
    if match[1] is not None:
        return int(match[1]), int(match[1])
    return int(match[2]), int(match[3])


def build_parser(prog: str = "python -m e2e.stress") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8080", help="server root (default %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("KVARN_API_KEY") or None,
                   help="sent as 'Authorization: Bearer KEY' (default: $KVARN_API_KEY)")
    p.add_argument("--model", default=None, help="model id (default: the first one /v1/models lists)")
    p.add_argument("--scheme", required=True, choices=("kvarn", "affine", "fp16"),
                   help="the KV cache scheme the server must be serving")
    p.add_argument("--bits", type=parse_bits, default=None, metavar="N|kXvY",
                   help="expected key and value bits: one width (4) or keys and values apart (k4v2) (default: "
                        "fp16: 16 or 32; other schemes: any)")
    p.add_argument("--key-bits", type=int, default=None, help="expected key bits")
    p.add_argument("--value-bits", type=int, default=None, help="expected value bits")
    p.add_argument("--scenario", action="append", choices=tuple(SCENARIOS), default=None,
                   help="scenario to run (repeatable; default: all, in the order "
                        f"{', '.join(SCENARIOS)})")
    p.add_argument("--concurrency", type=int, default=8, help="burst size, abort streams, determinism "
                                                              "copies, and mixed requests in flight")
    p.add_argument("--requests", type=int, default=24, help="requests in the mixed scenario")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of a normal request")
    p.add_argument("--seed", type=int, default=0, help="seeds the request plan and the sampled requests")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--idle-timeout", type=float, default=30.0, help="seconds for the server to get idle again")
    p.add_argument("--wait-ready", type=float, default=30.0, help="seconds to wait for /health to say 200")
    p.add_argument("--json", type=Path, default=None, metavar="PATH", help="write the report as JSON here")
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"))
    return p


def parse_args(argv: list[str] | None, prog: str = "python -m e2e.stress") -> argparse.Namespace:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.bits is not None and (args.key_bits is not None or args.value_bits is not None):
        parser.error("--bits cannot be combined with --key-bits/--value-bits")
    for name in ("concurrency", "requests", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    args.scenario = list(dict.fromkeys(args.scenario or SCENARIOS))
    return args


def expected_bits(args: argparse.Namespace) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """Accepted key bits and value bits (None: any)."""
    bits = (args.bits, args.bits) if isinstance(args.bits, int) else args.bits  # an int: the same for both
    key = bits[0] if bits is not None else args.key_bits
    value = bits[1] if bits is not None else args.value_bits
    default = FP16_BITS if args.scheme == "fp16" else None
    return ((key,) if key is not None else default), ((value,) if value is not None else default)


def layout_mismatch(args: argparse.Namespace, kv: Any) -> str | None:
    """Why the served ``kv_cache`` block is not the expected layout, or None when it is."""
    if not isinstance(kv, dict):
        return f"the model entry has no kv_cache block (got {kv!r})"
    problems = []
    if kv.get("scheme") != args.scheme:
        problems.append(f"scheme {kv.get('scheme')!r}, expected {args.scheme!r}")
    for field, accepted in zip(("key_bits", "value_bits"), expected_bits(args)):
        if accepted is not None and kv.get(field) not in accepted:
            problems.append(f"{field} {kv.get(field)!r}, expected {' or '.join(map(str, accepted))}")
    return "; ".join(problems) or None


async def wait_ready(client: httpx.AsyncClient, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while True:
        try:
            response = await client.get("/health")
            if response.status_code == 200:
                return
            detail = f"/health answered {response.status_code}: {response.text[:200]}"
        except httpx.TransportError as exc:
            detail = f"{type(exc).__name__}: {exc}"
        if time.monotonic() >= deadline:
            raise SetupError(EXIT_UNREACHABLE, f"server at {client.base_url} not ready: {detail}")
        await asyncio.sleep(0.25)


async def discover(client: httpx.AsyncClient, args: argparse.Namespace) -> dict[str, Any]:
    """The model entry to test, after checking its KV layout (raises ``SetupError``)."""
    await wait_ready(client, args.wait_ready)
    try:
        status, body = await get_json(client, "/v1/models")
    except httpx.TransportError as exc:
        raise SetupError(EXIT_UNREACHABLE, f"GET /v1/models failed: {exc}") from exc
    if status != 200 or not isinstance(body, dict) or not body.get("data"):
        raise SetupError(EXIT_UNREACHABLE, f"GET /v1/models answered {status}: {str(body)[:300]}")
    models = {m.get("id"): m for m in body["data"] if isinstance(m, dict)}
    model_id = args.model or next(iter(models))
    if model_id not in models:
        raise SetupError(EXIT_MISMATCH, f"model {model_id!r} is not served; the server lists {sorted(models)}")
    problem = layout_mismatch(args, models[model_id].get("kv_cache"))
    if problem:
        raise SetupError(EXIT_MISMATCH, f"refusing to run: model {model_id!r} is served with KV cache "
                                        f"{models[model_id].get('kv_cache')}: {problem}")
    return models[model_id]


def _base_report(args: argparse.Namespace) -> dict[str, Any]:
    key, value = expected_bits(args)
    return {"base_url": args.base_url, "model": args.model, "kv_cache": None, "scenarios": [],
            "expected": {"scheme": args.scheme, "key_bits": key, "value_bits": value},
            "settings": {k: getattr(args, k) for k in ("concurrency", "requests", "max_tokens", "seed")},
            "passed": False, "exit_code": EXIT_FAILED, "error": None}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole run as a report dict (``exit_code`` says how it went)."""
    report = _base_report(args)
    connections = max(args.concurrency, 8) * 2
    async with make_client(args.base_url, args.api_key, args.timeout, connections) as client:
        try:
            entry = await discover(client, args)
        except SetupError as exc:
            report.update(error=str(exc), exit_code=exc.code)
            return report
        report.update(model=entry["id"], kv_cache=entry.get("kv_cache"), attention=entry.get("attention"))
        ctx = Context(client, entry["id"], int(entry.get("context_length") or 2048), args.api_key,
                      args.concurrency, args.requests, args.max_tokens, args.seed, args.idle_timeout)
        for name in args.scenario:
            report["scenarios"].append((await run_scenario(name, ctx)).summary())
    report["passed"] = all(s["passed"] for s in report["scenarios"])
    report["exit_code"] = EXIT_OK if report["passed"] else EXIT_FAILED
    return report


async def amain(argv: list[str] | None = None, prog: str = "python -m e2e.stress") -> int:
    """The CLI inside a running event loop: print the summary, write ``--json``, return the exit code."""
    args = parse_args(argv, prog)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    report = await run(args)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if report["error"]:
        print(f"e2e.stress: {report['error']}", file=sys.stderr)
    else:
        print(markdown(report))
    return int(report["exit_code"])


def main(argv: list[str] | None = None, prog: str = "python -m e2e.stress") -> int:
    """The runner's command line (``kvarn stress`` passes its own ``prog``)."""
    try:
        return asyncio.run(amain(argv, prog))
    except SystemExit as exc:  # argparse: --help and usage errors
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
