"""CPU figures of two revisions side by side in one run: engine decode and aggregate tokens/s, and
streamed chat over HTTP, each measured in its own subprocess of its own tree.

    python bench/revision_ab.py --base e5a6a71 [--rounds 3] [--out bench/out/revision-ab.json]

The base revision is checked out in a temporary ``git worktree`` (removed at the end); the
current tree is this checkout (``--current DIR``: another one). Every measurement runs with
``PYTHONPATH`` and cwd its tree, through the ``kvarn`` command (``python -m server.cli``), so each
preloads OpenBLAS as ``kvarn`` does. Rounds alternate the order (odd rounds base first, even rounds
current first); a figure is the median over ``--rounds`` (>= 3 for a verdict), its ratio is
current / base (tok/s: above 1 is faster; TTFT: below 1 is faster), and each side's range over
the rounds is shown beside it as the noise to judge the ratio by. Per tree and round:

* ``kvarn bench --kv-layout L --depths 0,2048 --decode-tokens N --repeats 1`` for L in fp16 and
  KVarN k4v2: decode tok/s at depth 0 and 2048 (after a prompt of that length, EOS ignored;
  ``engine.bench.run_bench``) and, as it comes with them, prefill tok/s of 512 tokens;
* ``kvarn bench --kv-layout L --concurrency 16 --concurrency-prompt-tokens 128 --decode-tokens M``:
  aggregate tok/s of 16 simultaneous requests (``engine.bench.run_concurrency_bench``);
* a fresh ``kvarn serve`` of the tree (its defaults: KVarN k4v2, prefix cache on) and
  ``bench/serve_load.py``: streamed greedy chat of ~128-token distinct prompts, ``--serve-tokens``
  max tokens (EOS ends a reply, as for a client), c = 1 (``--serve-requests-c1`` requests one after
  another) and c = 16 (32 requests through 16 workers): aggregate tok/s and TTFT p50.

At the defaults (N = 128, M = 64, 64 served tokens, 3 rounds) a run should take 12-15 minutes on
2 CPU cores (estimated: one round at 8 decode, 4 concurrent and 8 served tokens took 2 minutes,
most of it process and server starts and the 2048-token prompts); the settings are written in the
markdown. ``--rounds 1`` with a few tokens checks that both trees run. Writes ``OUT`` (JSON: settings, both
revisions, every round's figures, medians and ratios) and ``OUT.md`` beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from kvarn_server import free_port  # bench/kvarn_server.py (this script's folder is on sys.path)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LAYOUTS = {"fp16": "fp16", "k4v2": "kvarn:k4v2"}  # name in the figures -> --kv-layout
LOWER_IS_BETTER = "ttft"  # figures whose name holds this: a ratio below 1 is the faster side


@dataclass(frozen=True)
class Settings:
    rounds: int = 3
    decode_tokens: int = 128  # kvarn bench at depths 0 and 2048
    depths: tuple[int, ...] = (0, 2048)
    concurrency: int = 16
    concurrency_prompt_tokens: int = 128
    concurrency_decode_tokens: int = 64
    serve_tokens: int = 64
    serve_prompt_tokens: int = 128
    serve_requests_c1: int = 6


def tree_env(tree: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1"}
    for name in ("KVARN_OPENBLAS_REEXEC", "KVARN_API_KEY"):  # each kvarn command preloads OpenBLAS itself
        env.pop(name, None)
    return env


def run_logged(command: list[str], tree: Path, log: Path) -> None:
    """Run ``command`` in ``tree``; its output goes to ``log``, whose tail a failure shows."""
    with log.open("ab") as out:
        code = subprocess.run(command, cwd=tree, env=tree_env(tree), stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise RuntimeError(f"{' '.join(command[:6])} ... in {tree} exited with {code}:\n{log.read_text()[-3000:]}")


def engine_figures(tree: Path, s: Settings, work: Path) -> dict[str, float]:
    """``kvarn bench`` decode (and prefill) and concurrency figures of both layouts."""
    figures: dict[str, float] = {}
    for name, spec in LAYOUTS.items():
        depth_json, level_json = work / f"bench-{name}.json", work / f"concurrency-{name}.json"
        cli = [sys.executable, "-m", "server.cli", "bench", "--kv-layout", spec]
        run_logged([*cli, "--depths", ",".join(map(str, s.depths)), "--decode-tokens", str(s.decode_tokens),
                    "--repeats", "1", "--json", str(depth_json)], tree, work / "bench.log")
        report = json.loads(depth_json.read_text())
        figures[f"prefill {name} {report['prefill']['tokens']} tok/s"] = report["prefill"]["tokens_per_s"]
        for row, depth in zip(report["decode"], s.depths):
            figures[f"decode {name} depth {depth} tok/s"] = row["tokens_per_s"]
        run_logged([*cli, "--concurrency", str(s.concurrency), "--concurrency-prompt-tokens",
                    str(s.concurrency_prompt_tokens), "--decode-tokens", str(s.concurrency_decode_tokens),
                    "--json", str(level_json)], tree, work / "bench.log")
        level = json.loads(level_json.read_text())["concurrency"][0]
        figures[f"aggregate {name} c={s.concurrency} tok/s"] = level["tokens_per_s"]
    return figures


@contextmanager
def served(tree: Path, log: Path, timeout: float = 180.0) -> Iterator[str]:
    """``kvarn serve`` of ``tree`` on a free loopback port; yields its base URL once ``/health``
    answers 200; stopped (SIGINT, then SIGKILL) when the block ends."""
    port = free_port()
    with log.open("ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--host", "127.0.0.1", "--port",
                                 str(port)], cwd=tree, env=tree_env(tree), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvarn serve of {tree} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvarn serve of {tree} not ready in {timeout:.0f} s")
            time.sleep(0.2)
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def serve_figures(tree: Path, s: Settings, work: Path, seed: int) -> dict[str, float]:
    """Streamed greedy chat at c = 1 and c = ``s.concurrency`` against a fresh server of ``tree``
    (distinct seeded prompts per level, so the prefix cache finds nothing to reuse)."""
    figures: dict[str, float] = {}
    with served(tree, work / "serve.log") as url:
        for level, requests in ((1, s.serve_requests_c1), (s.concurrency, 2 * s.concurrency)):
            out = work / f"serve-c{level}.json"
            run_logged([sys.executable, str(HERE / "serve_load.py"), "--url", url, "--concurrency", str(level),
                        "--requests-per-level", str(requests), "--max-tokens", str(s.serve_tokens),
                        "--prompt-tokens", str(s.serve_prompt_tokens), "--seed", str(seed * 1000 + level),
                        "--json-out", str(out)], REPO, work / "serve_load.log")
            row = json.loads(out.read_text())["levels"][0]
            if row["failed"]:
                raise RuntimeError(f"{row['failed']} of {row['requests']} requests failed at c={level} "
                                   f"against {tree}: {row['errors']} {row['error_samples']}")
            figures[f"serve c={level} tok/s"] = row["agg_tps"]
            figures[f"serve c={level} TTFT p50 ms"] = row["ttft_p50_s"] * 1e3
    return figures


def measure(tree: Path, s: Settings, work: Path, seed: int) -> dict[str, float]:
    work.mkdir(parents=True, exist_ok=True)
    return {**engine_figures(tree, s, work), **serve_figures(tree, s, work, seed)}


def revision_of(tree: Path) -> dict[str, Any]:
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=True)
        return done.stdout.strip()

    status = git("status", "--porcelain")
    return {"tree": str(tree), "revision": git("rev-parse", "HEAD"), "dirty": bool(status),
            "changes": status.splitlines()[:50]}


def summarize(base: list[dict[str, float]], current: list[dict[str, float]]) -> dict[str, dict[str, Any]]:
    """Per figure: the medians, current / base, and every round's value of each side."""
    figures = {}
    for name in base[0]:
        a, b = [r[name] for r in base], [r[name] for r in current]
        ma, mb = statistics.median(a), statistics.median(b)
        figures[name] = {"base": ma, "current": mb, "ratio": mb / ma if ma else None,
                         "lower_is_better": LOWER_IS_BETTER in name.lower(), "base_rounds": a, "current_rounds": b}
    return figures


def markdown(report: dict[str, Any]) -> str:
    s, base, current = report["settings"], report["base"], report["current"]
    label = lambda r: f"`{r['revision'][:12]}`{' + uncommitted changes' if r['dirty'] else ''}"  # noqa: E731
    lines = [f"CPU figures, base {label(base)} vs current {label(current)}: medians of {s['rounds']} rounds "
             f"(order alternating), {report['wall_seconds']:.0f} s in all", "",
             f"`kvarn bench` decode {s['decode_tokens']} tokens at depths {', '.join(map(str, s['depths']))}; "
             f"{s['concurrency']} requests of {s['concurrency_prompt_tokens']} prompt + "
             f"{s['concurrency_decode_tokens']} tokens at once; `kvarn serve` (KVarN k4v2, prefix cache on) "
             f"streamed greedy chat, ~{s['serve_prompt_tokens']}-token prompts, at most {s['serve_tokens']} "
             f"tokens, c=1 ({s['serve_requests_c1']} requests) and c={s['concurrency']} "
             f"({2 * s['concurrency']} requests). Ratio current/base: tok/s above 1 is faster, TTFT below 1.", "",
             "| figure | base | current | current/base | base range | current range |",
             "|---|---|---|---|---|---|"]
    for name, f in report["figures"].items():
        ratio = "-" if f["ratio"] is None else f"{f['ratio']:.3f}"
        lines.append(f"| {name} | {f['base']:.1f} | {f['current']:.1f} | {ratio} | "
                     f"{min(f['base_rounds']):.1f}-{max(f['base_rounds']):.1f} | "
                     f"{min(f['current_rounds']):.1f}-{max(f['current_rounds']):.1f} |")
    return "\n".join(lines) + "\n"


def run(base_rev: str, current: Path, s: Settings, out: Path) -> dict[str, Any]:
    started = time.perf_counter()
    rounds: dict[str, list[dict[str, float]]] = {"base": [], "current": []}
    with tempfile.TemporaryDirectory(prefix="revision-ab-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), base_rev], check=True)
        try:
            trees = {"base": base, "current": current}
            info = {side: revision_of(tree) for side, tree in trees.items()}
            for r in range(s.rounds):
                for side in ("base", "current") if r % 2 == 0 else ("current", "base"):
                    work = Path(tmp) / f"{side}-{r}"
                    rounds[side].append(measure(trees[side], s, work, seed=r))
                    sys.stderr.write(f"round {r + 1}/{s.rounds} {side}: {json.dumps(rounds[side][-1])}\n")
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=True)
    report = {"settings": asdict(s), **info, "rounds": rounds, "figures": summarize(rounds["base"], rounds["current"]),
              "wall_seconds": time.perf_counter() - started}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    return report


def main(argv: list[str] | None = None) -> int:
    d = Settings()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, metavar="REV", help="the base revision (checked out in a worktree)")
    p.add_argument("--current", type=Path, default=REPO, metavar="DIR",
                   help="the current tree (default: this checkout)")
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--decode-tokens", type=int, default=d.decode_tokens, help="kvarn bench decode tokens a depth")
    p.add_argument("--concurrency-decode-tokens", type=int, default=d.concurrency_decode_tokens)
    p.add_argument("--serve-tokens", type=int, default=d.serve_tokens, help="max_tokens of a served request")
    p.add_argument("--serve-requests-c1", type=int, default=d.serve_requests_c1)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "revision-ab.json")
    args = p.parse_args(argv)
    if args.rounds < 1 or min(args.decode_tokens, args.concurrency_decode_tokens, args.serve_tokens,
                               args.serve_requests_c1) < 1:
        p.error("--rounds and the token and request counts must be >= 1")
    s = Settings(rounds=args.rounds, decode_tokens=args.decode_tokens,
                 concurrency_decode_tokens=args.concurrency_decode_tokens, serve_tokens=args.serve_tokens,
                 serve_requests_c1=args.serve_requests_c1)
    report = run(args.base, args.current.resolve(), s, args.out)
    sys.stdout.write(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
