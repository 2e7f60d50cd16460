"""The report of ``bench/agent_clis.py``: markdown tables and the full JSON.

The headline table puts the clients side by side, one row a turn: prompt tokens served from the
prefix cache over the turn's prompt tokens, as ``/metrics`` counted them (every request of the
turn, a CLI's background calls included). The target is that every turn after the first reuses
at least ``TARGET`` of its prompt.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

TARGET = 0.90


def cached_share(turn: dict[str, Any]) -> float | None:
    prompt = turn["metrics"]["prompt_tokens"]
    return turn["metrics"]["cached_tokens"] / prompt if prompt else None


def _cell(turn: dict[str, Any] | None) -> str:
    if turn is None:
        return "-"
    metrics, share = turn["metrics"], cached_share(turn)
    if not turn["completed"] and not metrics["prompt_tokens"]:
        return f"failed ({_first_error(turn)})"
    cell = f"{metrics['cached_tokens']:,.0f} / {metrics['prompt_tokens']:,.0f}"
    cell += f" ({share:.0%})" if share is not None else ""
    return cell if turn["completed"] else f"{cell}, failed ({_first_error(turn)})"


def _first_error(turn: dict[str, Any]) -> str:
    for exchange in turn["exchanges"]:
        if exchange["error"] or (exchange["status"] or 0) >= 400:
            return f"{exchange['status']} on {exchange['path'].split('?')[0]}"
    return "see details"


def _routes(turn: dict[str, Any]) -> str:
    counts = Counter(f"{e['method']} {e['path'].split('?')[0]} {e['status']}" for e in turn["exchanges"])
    return "<br>".join(f"{route} x{n}" if n > 1 else route for route, n in counts.items()) or "none"


def _ttft(turn: dict[str, Any]) -> str:
    times = [e["ttft_s"] for e in turn["exchanges"] if e["ttft_s"] is not None]
    return ", ".join(f"{t:.2f}" for t in times) or "-"


def _api_usage(turn: dict[str, Any]) -> str:
    cells = []
    for e in turn["exchanges"]:
        usage = e["usage"]
        if usage["prompt_tokens"] is not None:
            cells.append(f"{usage['cached_tokens'] or 0:,} / {usage['prompt_tokens']:,}")
    return ", ".join(cells) or "-"


def meets_target(turns: list[dict[str, Any]]) -> bool:
    later = turns[1:]
    return bool(later) and all(t["completed"] and (cached_share(t) or 0) >= TARGET for t in later)


def markdown(meta: dict[str, Any], results: dict[str, Any]) -> str:
    ran = {name: r["turns"] for name, r in results.items() if "turns" in r}
    lines = [f"# Agent loops against kvarn serve: prompt tokens cached per turn ({meta['date']})", "",
             f"Command: `{meta['command']}`", "",
             f"Model: `{meta['model']}` (the bundled 29M weights with a {meta['context_length']:,}-token context; "
             "its answers past 4k tokens are noise, the protocol is what is measured), CPU "
             f"({meta['machine']}). The SDK loops' answers are capped at {meta['max_tokens']} tokens, Claude Code's at "
             f"{meta['cli_max_tokens']} (CLAUDE_CODE_MAX_OUTPUT_TOKENS), Codex sends no cap. "
             "One fresh server per client.", "",
             "## Prompt tokens cached per turn, side by side", "",
             f"Cached / prompt tokens of each turn, from `/metrics` (`kvarn_prompt_cached_tokens_total` over "
             f"`kvarn_prompt_tokens_total`, every request of the turn). Target: every turn after the first "
             f"reuses >= {TARGET:.0%}.", "",
             "| turn | " + " | ".join(ran) + " |", "|---|" + "---|" * len(ran)]
    for k in range(max((len(t) for t in ran.values()), default=0)):
        lines.append(f"| {k + 1} | " + " | ".join(_cell(t[k] if k < len(t) else None) for t in ran.values()) + " |")
    lines.append("| target met | " + " | ".join("yes" if meets_target(t) else "**no**" for t in ran.values()) + " |")
    for name, r in results.items():
        if "skipped" in r:
            lines += ["", f"{name}: skipped ({r['skipped']})."]
    lines += ["", "## Per turn", "",
              "| client | turn | completed | requests (route, status) | API usage cached / prompt | "
              "TTFT s (per request) | wall s | prefix cache hit / looked up |", "|---|---|---|---|---|---|---|---|"]
    for name, turns in ran.items():
        for t in turns:
            m = t["metrics"]
            lines.append(f"| {name} | {t['turn']} | {'yes' if t['completed'] else 'no'} | {_routes(t)} | "
                         f"{_api_usage(t)} | {_ttft(t)} | {t['wall_s']:.1f} | "
                         f"{m['apc_hit_tokens']:,.0f} / {m['apc_query_tokens']:,.0f} |")
    lines += _failures(ran)
    return "\n".join(lines) + "\n"


def _failures(ran: dict[str, list[dict[str, Any]]]) -> list[str]:
    lines = ["", "## Requests kvarn refused or failed", ""]
    seen = 0
    for name, turns in ran.items():
        for t in turns:
            for e in t["exchanges"]:
                if not (e["error"] or (e["status"] or 0) >= 400):
                    continue
                seen += 1
                lines.append(f"- {name} turn {t['turn']}: `{e['method']} {e['path']}` -> {e['status']}: "
                             f"`{(e['error'] or '')[:600]}`. Request: {_body_summary(e['request_body'])} "
                             "(the whole body is in the JSON).")
            if not t["completed"]:
                lines.append(f"- {name} turn {t['turn']} did not complete: {t['detail'][:800]}")
                seen += 1
    return lines + ([] if seen else ["None: every request was answered 200 and every turn completed."])


def _body_summary(body: str | None) -> str:
    if not body:
        return "(no body kept)"
    try:
        payload = json.loads(body)
    except json.JSONDecodeError:
        return f"{len(body):,} characters, not JSON"
    if not isinstance(payload, dict):
        return f"{len(body):,} characters"
    keys = ", ".join(sorted(payload))
    return f"{len(body):,} characters, fields: {keys}"


def write_report(out: Path, meta: dict[str, Any], results: dict[str, Any]) -> None:
    """``out``.md and ``out``.json."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "target": TARGET, "clients": results}, indent=1))
    out.with_suffix(".md").write_text(markdown(meta, results))
