"""Agent clients against ``kvarn serve``: Claude Code, Codex CLI and the three SDK agent loops,
three turns of one conversation each, and how much of every turn's prompt the prefix cache served.

    python3 bench/agent_clis.py [--clients claude,codex,sdk-chat,sdk-messages,sdk-responses]

The server runs a long-context copy of the bundled model (``tests/long_context_model.py``: the
same weights, a 65,536-token context; the CLIs' system prompts are tens of thousands of tokens),
one fresh server per client so no client's turn 1 is served from another's prompts. Every
request goes through a recording proxy (``bench/agent_proxy.py``) that keeps its route, status,
time to first generated token and reported usage; ``/metrics`` deltas around each turn give the
server's own count of prompt tokens and of those served from the prefix cache. Writes
``bench/results/agent-loop-cpu.md`` and ``.json`` (a CLI request kvarn refused is in both, with
its status, error and, in the JSON, its body).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from agent_cli_runs import (API_KEY, CliTurn, claude_env, cli_present, codex_env, run_claude, run_codex,
                            write_codex_config)
from agent_proxy import recording_proxy
from agent_report import write_report
from agent_sdk_loops import USER_TURNS, LoopConfig, loop_clients, system_prompt
from kvarn_server import REPO, free_port, served

sys.path.insert(0, str(REPO))
from tests.long_context_model import LONG_CONTEXT, make_long_context_model  # noqa: E402

MODEL_ID = "fixture-chat-29m-q8-64k"
CLIENTS = ("sdk-chat", "sdk-messages", "sdk-responses", "claude", "codex")
COUNTERS = {"prompt_tokens": "kvarn_prompt_tokens_total", "cached_tokens": "kvarn_prompt_cached_tokens_total",
            "apc_query_tokens": "kvarn_prefix_cache_query_tokens_total",
            "apc_hit_tokens": "kvarn_prefix_cache_hit_tokens_total"}


@dataclass
class TurnResult:
    """One turn of one client: whether it completed, what the server counted, every request."""

    client: str
    turn: int
    completed: bool
    detail: str
    wall_s: float
    metrics: dict[str, float]
    exchanges: list[dict[str, Any]] = field(default_factory=list)
    reported: dict[str, Any] = field(default_factory=dict)


def counters(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    values = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return {key: values.get(name, 0.0) for key, name in COUNTERS.items()}


def wait_idle(base: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = httpx.get(f"{base}/health", timeout=30).json()
        if health.get("running", 0) == 0 and health.get("waiting", 0) == 0:
            return
        time.sleep(0.2)


TurnRunner = Callable[[int], tuple[bool, str, dict[str, Any]]]  # turn index -> completed, detail, reported


def measure(client: str, runner: TurnRunner, base: str, proxy, turns: int) -> list[TurnResult]:
    """Run ``turns`` turns, each between two ``/metrics`` reads with the server idle."""
    results: list[TurnResult] = []
    for turn in range(turns):
        if results and not results[-1].completed:
            break  # the conversation has no answer to go on from
        before, mark, started = counters(base), proxy.mark(), time.monotonic()
        try:
            completed, detail, reported = runner(turn)
        except Exception as exc:  # noqa: BLE001 - an SDK's refusal is this turn's result
            completed, detail, reported = False, f"{type(exc).__name__}: {exc}"[:2000], {}
        wall = time.monotonic() - started
        wait_idle(base)
        after = counters(base)
        exchanges = [e.as_dict() for e in proxy.since(mark)]
        results.append(TurnResult(client, turn + 1, completed, detail, wall,
                                  {k: after[k] - before[k] for k in after}, exchanges, reported))
        print(f"{client} turn {turn + 1}: completed={completed} {wall:.1f} s "
              f"{[(e['path'], e['status']) for e in exchanges]} {results[-1].metrics}", flush=True)
    return results


def sdk_runner(client: str, proxy_base: str, config: LoopConfig) -> TurnRunner:
    loop, sdk = loop_clients(proxy_base, API_KEY)[client]
    turns: Iterator[str] = loop(sdk, config)

    def run(turn: int) -> tuple[bool, str, dict[str, Any]]:
        text = next(turns)
        return True, f"answer: {text[:200]!r}", {}
    return run


def cli_runner(client: str, proxy_base: str, home: Path, args: argparse.Namespace) -> TurnRunner:
    workdir = home / "work"
    workdir.mkdir(parents=True)
    if client == "claude":
        env = claude_env(home, proxy_base, MODEL_ID, args.cli_max_tokens)
    else:
        write_codex_config(home / ".codex", proxy_base, MODEL_ID, LONG_CONTEXT)
        env = codex_env(home)
    session: list[str | None] = [None]

    def run(turn: int) -> tuple[bool, str, dict[str, Any]]:
        prompt = USER_TURNS[turn]
        result: CliTurn = (run_claude(workdir, env, prompt, MODEL_ID, session[0], args.cli_timeout)
                           if client == "claude" else run_codex(workdir, env, prompt, session[0], args.cli_timeout))
        session[0] = result.session_id or session[0]
        detail = (f"exit {result.exit_code}; answer: {result.text[:200]!r}" if result.completed
                  else f"exit {result.exit_code}; stderr: {result.stderr[-1500:]!r}")
        return result.completed, detail, {**result.reported, "session_id": result.session_id}
    return run


def run_client(client: str, model_dir: Path, args: argparse.Namespace, scratch: Path) -> list[TurnResult]:
    """One client's turns against a fresh ``kvarn serve`` behind a recording proxy."""
    log = scratch / f"{client}-server.log"
    with served([str(model_dir), "--log-level", "info", "--default-max-tokens", str(args.server_max_tokens)], log) \
            as server, \
            recording_proxy(server.base, free_port()) as proxy:
        proxy_base = f"http://127.0.0.1:{proxy.port}"
        if client.startswith("sdk-"):
            runner = sdk_runner(client, proxy_base, LoopConfig(MODEL_ID, system_prompt(), args.max_tokens))
        else:
            runner = cli_runner(client, proxy_base, scratch / f"{client}-home", args)
        results = measure(client, runner, server.base, proxy, args.turns)
    routes = [line for line in log.read_text(errors="replace").splitlines() if '"POST /v1/' in line]
    for result in results:
        result.reported["server_log_posts"] = len(routes)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default=",".join(CLIENTS), help="comma-separated: " + ", ".join(CLIENTS))
    parser.add_argument("--turns", type=int, default=3, choices=(1, 2, 3))
    parser.add_argument("--max-tokens", type=int, default=32, help="answer cap of the SDK loops' turns")
    parser.add_argument("--cli-max-tokens", type=int, default=256,
                        help="Claude Code's answer cap (CLAUDE_CODE_MAX_OUTPUT_TOKENS: it fails a turn that reaches "
                             "it, so the model must stop on its own first)")
    parser.add_argument("--server-max-tokens", type=int, default=2048,
                        help="the server's cap of a request that sets none (kvarn serve --default-max-tokens): "
                             "Codex sets none and fails a turn that ends incomplete, so this leaves the model room "
                             "to stop on its own")
    parser.add_argument("--cli-timeout", type=float, default=900, help="seconds a CLI turn may take")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "agent-loop-cpu")
    args = parser.parse_args(argv)
    clients = [c for c in args.clients.split(",") if c]
    unknown = set(clients) - set(CLIENTS)
    if unknown:
        parser.error(f"unknown clients: {', '.join(sorted(unknown))}")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvarn-agents-") as tmp:
        scratch = Path(tmp)
        model_dir = make_long_context_model(scratch / MODEL_ID)
        for client in clients:
            if client in ("claude", "codex") and not cli_present(client):
                results[client] = {"skipped": f"`{client}` is not on PATH"}
                continue
            results[client] = {"turns": [asdict(t) for t in run_client(client, model_dir, args, scratch)]}
    command = "python3 bench/agent_clis.py" + ("" if argv is None and len(sys.argv) == 1 else
                                               " " + " ".join(sys.argv[1:] if argv is None else argv))
    meta = {"command": command, "model": MODEL_ID, "context_length": LONG_CONTEXT, "max_tokens": args.max_tokens,
            "cli_max_tokens": args.cli_max_tokens,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d")}
    write_report(args.out, meta, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
