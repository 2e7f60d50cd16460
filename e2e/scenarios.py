"""The load scenarios: burst, mixed, abort, determinism (bad_input lives in e2e.bad_input, prefix in
e2e.prefix).

Each takes a ``Context``, fills a ``ScenarioReport`` and never raises for a server fault.
``run_scenario`` times it and then checks the server went back to idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from e2e.bad_input import bad_input
from e2e.client import Call, Outcome
from e2e.context import Context, chat_body, completion_body, health, metric_total, prompt_text, run_calls, \
    wait_idle
from e2e.prefix import prefix
from e2e.report import ScenarioReport

logger = logging.getLogger(__name__)

ABORT_AFTER_CHUNKS = 3


async def burst(ctx: Context, report: ScenarioReport) -> None:
    """``concurrency`` streamed chat requests sent at the same moment."""
    rng = ctx.rng("burst")
    calls = [Call(f"burst-{i}", "chat", chat_body(ctx, prompt_text(rng, "short"), ctx.max_tokens, True,
                                                  seed=ctx.seed + i))
             for i in range(ctx.concurrency)]
    report.outcomes = await run_calls(ctx, calls)


def mixed_plan(ctx: Context) -> list[Call]:
    """``requests`` calls cycling chat/completion x streamed/not; of every 12, two streams (one chat,
    one completion) disconnect mid-stream, one chat has a stop string, one completion sends token ids."""
    rng = ctx.rng("mixed")
    calls = []
    for i in range(ctx.requests):
        endpoint = "chat" if i % 2 == 0 else "completion"
        stream, abort = i % 4 < 2, i % 12 in (4, 9)
        max_tokens = long_max_tokens(ctx) if abort else rng.randint(1, ctx.max_tokens)
        extra = {"temperature": rng.choice((0.0, 0.7, 1.0)), "seed": ctx.seed + i}
        if abort:
            extra["ignore_eos"] = True
        if i % 12 == 10:
            extra["stop"] = ["."]
        text = prompt_text(rng, rng.choice(("short", "medium", "long")))
        usage = i % 3 != 2
        if endpoint == "chat":
            body = chat_body(ctx, text, max_tokens, stream, usage, **extra)
        else:
            prompt: str | list[int] = list(range(100, 132)) if i % 12 == 7 else text
            body = completion_body(ctx, prompt, max_tokens, stream, usage, **extra)
        kind = f"{endpoint}-{'stream' if stream else 'plain'}{'-abort' if abort else ''}"
        calls.append(Call(f"mixed-{i}-{kind}", endpoint, body, rng.randint(2, 4) if abort else None))
    return calls


def long_max_tokens(ctx: Context) -> int:
    """Long enough that a stream still runs when the client leaves: the abort is what ends it."""
    return max(16, min(1024, ctx.context_length // 2))


async def mixed(ctx: Context, report: ScenarioReport) -> None:
    calls = mixed_plan(ctx)
    report.outcomes = await run_calls(ctx, calls, ctx.concurrency)
    expected = sum(c.abort_after is not None for c in calls)
    aborted = sum(o.aborted for o in report.outcomes)
    report.check("planned aborts happened", aborted == expected, f"{aborted} of {expected} streams aborted")


class _Rendezvous:
    """Holds each aborting stream until all have streamed, then samples /health once."""

    def __init__(self, ctx: Context, count: int, timeout: float) -> None:
        self.ctx, self.count, self.timeout = ctx, count, timeout
        self.arrived = 0
        self.all_in = asyncio.Event()
        self.seen: dict[str, object] = {}

    async def __call__(self) -> None:
        self.arrived += 1
        if self.arrived == self.count:
            self.seen = await health(self.ctx)
            self.all_in.set()
        try:
            await asyncio.wait_for(self.all_in.wait(), self.timeout)
        except asyncio.TimeoutError:
            logger.warning("abort: only %d of %d streams reached the abort point", self.arrived, self.count)


async def abort(ctx: Context, report: ScenarioReport) -> None:
    """Streams that disconnect after a few chunks: the server must drop them (back to idle, counted
    as disconnects in /metrics) and keep serving."""
    n, rng = ctx.concurrency, ctx.rng("abort")
    before = await metric_total(ctx, "kvarn_requests_total", {"finish_reason": "disconnect"})
    calls = [Call(f"abort-{i}", "chat" if i % 2 == 0 else "completion",
                  (chat_body if i % 2 == 0 else completion_body)(
                      ctx, prompt_text(rng, "short"), long_max_tokens(ctx), True, ignore_eos=True),
                  ABORT_AFTER_CHUNKS) for i in range(n)]
    meet = _Rendezvous(ctx, n, ctx.idle_timeout)
    report.outcomes = list(await asyncio.gather(*(ctx.send(c, meet) for c in calls)))
    for outcome in report.outcomes:
        if not outcome.aborted and outcome.ok:
            outcome.fail("the stream ended before the client could abort it")
    running, waiting = meet.seen.get("running"), meet.seen.get("waiting")
    live = isinstance(running, int) and isinstance(waiting, int) and running + waiting >= n
    report.check("streams were live before the abort", live,
                 f"/health before the abort: running={running}, waiting={waiting}, expected {n} in all"
                 if meet.seen else "/health was never sampled: not every stream reached the abort point")
    idle, detail = await wait_idle(ctx)
    report.check("back to running=0, waiting=0", idle, detail)
    report.check(*await _disconnects_counted(ctx, before, n))
    report.outcomes.append(await ctx.send(Call("abort-after", "chat", chat_body(ctx, "Hello", 8, True))))


async def _disconnects_counted(ctx: Context, before: float, n: int) -> tuple[str, bool, str]:
    deadline = time.monotonic() + ctx.idle_timeout
    while True:
        now = await metric_total(ctx, "kvarn_requests_total", {"finish_reason": "disconnect"})
        if now - before >= n or time.monotonic() > deadline:
            return ("disconnects counted in /metrics", now - before == n,
                    f"kvarn_requests_total{{finish_reason=\"disconnect\"}} rose by {now - before:g}, expected {n}")
        await asyncio.sleep(0.1)


async def determinism(ctx: Context, report: ScenarioReport) -> None:
    """One greedy request alone, then ``concurrency`` copies at once (streamed and not): one text.
    Then seeded sampled copies at once: one text."""
    text = prompt_text(ctx.rng("determinism"), "medium")
    solo = await ctx.send(Call("greedy-solo", "chat", chat_body(ctx, text, ctx.max_tokens, False, temperature=0)))
    copies = [Call(f"greedy-{i}", "chat", chat_body(ctx, text, ctx.max_tokens, i % 2 == 1, temperature=0))
              for i in range(ctx.concurrency)]
    greedy = await run_calls(ctx, copies)
    _same(report, "greedy copies match the solo request", [solo, *greedy])
    seeded_body = completion_body(ctx, text, ctx.max_tokens, False, temperature=0.9, top_p=0.95,
                                  seed=ctx.seed + 1234)
    seeded = await run_calls(ctx, [Call(f"seeded-{i}", "completion", seeded_body)
                                   for i in range(max(2, ctx.concurrency // 2))])
    _same(report, "seeded sampled copies match", seeded)
    report.outcomes = [solo, *greedy, *seeded]


def _same(report: ScenarioReport, name: str, outcomes: list[Outcome]) -> None:
    good = [o for o in outcomes if o.ok]
    keys = {(o.text, o.finish_reason, o.completion_tokens, o.prompt_tokens) for o in good}
    detail = f"{len(keys)} distinct (text, finish, tokens) among {len(good)} good responses"
    if len(keys) > 1:
        detail += ": " + " | ".join(repr(k[0][:60]) for k in sorted(keys))
    report.check(name, len(good) == len(outcomes) and len(keys) == 1, detail)


Scenario = Callable[[Context, ScenarioReport], Awaitable[None]]
SCENARIOS: dict[str, Scenario] = {"burst": burst, "mixed": mixed, "abort": abort, "bad_input": bad_input,
                                  "determinism": determinism, "prefix": prefix}


async def run_scenario(name: str, ctx: Context) -> ScenarioReport:
    """Run one scenario, time it, then require the server to be idle again."""
    report = ScenarioReport(name)
    logger.info("scenario %s: start", name)
    start = time.monotonic()
    await SCENARIOS[name](ctx, report)
    report.wall_s = time.monotonic() - start
    if name != "abort":  # abort checks idleness itself
        report.check("idle afterwards", *await wait_idle(ctx))
    logger.info("scenario %s: %s in %.2fs", name, "passed" if report.passed else "FAILED", report.wall_s)
    return report
