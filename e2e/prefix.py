"""The prefix scenario: multi-turn conversations sharing a system prompt, against the server's
prefix cache. It reads ``GET /v1/cache/stats`` first: with the cache on, later turns must report
``usage.prompt_tokens_details.cached_tokens`` (fewer than the prompt's tokens), a repeated
prompt must answer exactly as it did before (greedy, restored from the cache), and a request with
its own ``cache_salt`` must find nothing cached; with the cache off, nothing is ever cached."""

from __future__ import annotations

import asyncio
from typing import Any

from e2e.client import Call, Outcome, get_json
from e2e.context import Context, prompt_text
from e2e.report import ScenarioReport

CONVERSATIONS = 3
TURNS = 3


def _body(ctx: Context, messages: list[dict[str, str]], stream: bool, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": ctx.model, "messages": messages, "max_tokens": ctx.max_tokens,
                            "temperature": 0, "stream": stream, **extra}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _conversation(ctx: Context, k: int, system: str) -> tuple[list[Outcome], list[dict[str, str]]]:
    rng = ctx.rng(f"prefix-{k}")
    messages = [{"role": "system", "content": system}]
    outcomes = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": prompt_text(rng, "medium")})
        outcome = await ctx.send(Call(f"prefix-c{k}-t{turn}", "chat", _body(ctx, list(messages), k % 2 == 1)))
        outcomes.append(outcome)
        messages.append({"role": "assistant", "content": outcome.text})
    return outcomes, messages[:-1]  # the last prompt as it was sent


async def prefix(ctx: Context, report: ScenarioReport) -> None:
    status, stats = await get_json(ctx.client, "/v1/cache/stats")
    enabled = status == 200 and isinstance(stats, dict) and bool(stats.get("enabled"))
    block = stats.get("block_size", 1) if enabled else 1
    system = prompt_text(ctx.rng("prefix-system"), "long")
    runs = await asyncio.gather(*(_conversation(ctx, k, system) for k in range(CONVERSATIONS)))
    turns = [o for outcomes, _ in runs for o in outcomes]
    last_prompt, last = runs[0][1], runs[0][0][-1]
    scored = {"logprobs": True, "top_logprobs": 2}
    again = [await ctx.send(Call(f"prefix-repeat-{i}", "chat", _body(ctx, last_prompt, False, **scored)))
             for i in range(2)]
    salted = await ctx.send(Call("prefix-salted", "chat", _body(ctx, last_prompt, False, **scored,
                                                                  cache_salt=f"e2e-{ctx.seed}-{id(report)}")))
    report.outcomes = [*turns, *again, salted]
    good = [o for o in report.outcomes if o.ok]
    reported = [o for o in good if o.cached_tokens is not None]
    report.check("cached_tokens reported in every usage", len(reported) == len(good),
                 f"{len(reported)} of {len(good)} responses carry prompt_tokens_details.cached_tokens")
    if not enabled:
        report.check("nothing cached with the cache off", all(o.cached_tokens in (None, 0) for o in good),
                      f"cached_tokens seen: {sorted({o.cached_tokens for o in good})}")
        return
    later = [o for outcomes, _ in runs for o in outcomes[1:]]
    reused = [o for o in later if o.ok and (o.cached_tokens or 0) >= block]
    report.check("later turns reuse their conversation's history", len(reused) == len(later),
                 f"{len(reused)} of {len(later)} later turns had >= {block} cached tokens: "
                 f"{[o.cached_tokens for o in later]}")
    fewer = all(o.prompt_tokens is not None and 0 <= (o.cached_tokens or 0) < o.prompt_tokens for o in reported)
    report.check("cached tokens are fewer than the prompt's (its last token is computed)", fewer,
                 f"cached / prompt tokens: {[(o.cached_tokens, o.prompt_tokens) for o in reported]}")
    same = all(o.ok and o.text == last.text for o in again) and last.ok
    report.check("a repeated prompt answers as before (greedy, from the cache)", same,
                 f"texts: {[last.text[:40], *(o.text[:40] for o in again)]}")
    grew = all((o.cached_tokens or 0) >= (last.cached_tokens or 0) and (o.cached_tokens or 0) > 0 for o in again)
    report.check("the repeat is served from the cache", grew,
                 f"cached_tokens: turn {last.cached_tokens}, repeats {[o.cached_tokens for o in again]}")
    report.check("another cache_salt finds nothing cached", salted.ok and salted.cached_tokens == 0,
                 f"cached_tokens {salted.cached_tokens}")
    same, detail = same_up_to_rounding(again[0], salted)
    report.check("computed cold (another salt), the prompt answers as from the cache, up to rounding", same, detail)


NEAR_TIE = 0.3  # nats: a quantized cache's rounding moves a logprob by up to ~0.1 (docs/apc.md)


def same_up_to_rounding(cached: Outcome, cold: Outcome) -> tuple[bool, str]:
    """The same greedy text, or the same tokens up to one where the cached run's top two choices
    were within NEAR_TIE of each other (a quantized KV cache's rounding may resolve a near-tie the
    other way: the prompt's earlier turns were computed in decode on one side, in prefill on the
    other)."""
    if cached.ok and cold.ok and cached.text == cold.text:
        return True, "same text"
    if not (cached.ok and cold.ok and cached.logprobs and cold.logprobs):
        return False, f"texts differ and no logprobs to tell: {cached.text[:40]!r} vs {cold.text[:40]!r}"
    for k, (a, b) in enumerate(zip(cached.logprobs, cold.logprobs)):
        if a.get("token") != b.get("token"):
            top = a.get("top_logprobs") or []
            gap = top[0]["logprob"] - top[1]["logprob"] if len(top) >= 2 else float("inf")
            return gap < NEAR_TIE, f"first different token {k}: top-2 gap {gap:.3f} in the cached run"
    return False, "texts differ but the tokens agree"
