"""A synthetic workload run through a new engine before it serves, so the first users do not pay
what a GPU backend builds on first use.

On MLX's CUDA backend the first step of each *kind* stops the whole batch while kernels are
built: the first decode step of several rows beside a prompt chunk took 3.5 s (KVarN) and 6.0 s
(fp16) on the H200 at the 8B shape, against ~15 ms once built (docs/benchmarks.md, "Prefill speed");
each new attention shape costs cuDNN 45-95 ms once. ``warm_up`` runs every kind once, with the
engine's own scheduler and kernels:

* ``rows`` short requests (a full sink and half a tail each) prefill together and decode
  across a tile boundary, so several rows commit a tile in one decode step;
* meanwhile one longer request (a full prompt chunk and a continuation chunk) prefills beside
  them: chunks of a prompt with history, mixed with decode rows;
* with speculative decoding on, one row, then 2 and 4 rows verify drafts of every length
  the speculator may choose (random tokens, so mostly rejected: every verify shape is built,
  and rejections trimmed); the speculator is left as it was (no evidence, no measured cost, no
  count);
* then everything is aborted. The prefix cache is paused for the duration (nothing is
  looked up, cached, counted or written to disk), and the block pool gets every block back.

Prompts are random token ids with ``ignore_eos``. A warm-up that cannot run (a budget too small
for its requests, a context too short) is skipped with a log line: it never stops a server from
starting.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from engine.proposers import Draft
from engine.request import Request, RequestId, SamplingParams
from engine.speculator import Acceptance, SpecCounters, StepCosts

logger = logging.getLogger(__name__)

MAX_STEPS = 4096  # a bound on the loop, far above what the workload takes


@dataclass
class WarmUpReport:
    ran: bool
    seconds: float = 0.0
    steps: int = 0
    slowest_step_s: float = 0.0
    reason: str = ""  # why it did not run
    step_seconds: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"ran": self.ran, "seconds": round(self.seconds, 4), "steps": self.steps,
                "slowest_step_s": round(self.slowest_step_s, 4), "reason": self.reason}


def on_gpu() -> bool:
    """Whether MLX's default device is a GPU (where ``kvarn serve --warm-up auto`` warms up)."""
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu


def warm_up(engine: Any, rows: int = 2, seed: int = 0) -> WarmUpReport:
    """Run the warm-up workload through ``engine`` (idle, on its own thread) and leave it as it was:
    no request, no cached prefix, every pool block free. Returns what it took."""
    if engine.has_work():
        return WarmUpReport(False, reason="the engine has work")
    G = engine.layout.tile_size
    config = engine.scheduler.config
    chunk = config.prefill_chunk_size
    context = engine.loaded.context_length
    rows = max(1, min(rows, config.max_num_seqs - 1))
    short_len, short_new = G + G // 2, G // 2 + 2  # decode crosses the tile boundary at the same step in every row
    long_len = min(chunk + G + 3, context - 2)  # a full chunk, then a continuation chunk over its history
    if short_len + short_new > context or long_len < 2:
        return WarmUpReport(False, reason=f"context {context} too short")
    rng = random.Random(seed)
    vocab = engine.loaded.vocab_size

    def request(tag: str, n: int, new: int) -> Request:
        return Request(RequestId(f"kvarn-warm-up-{tag}-{time.monotonic_ns()}"), [rng.randrange(vocab) for _ in range(n)],
                       SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))

    shorts = [request(f"s{i}", short_len, short_new) for i in range(rows)]
    long = request("long", long_len, 2)
    group = [*shorts, long]
    if not all(engine.scheduler.fits_alone(r, 1) for r in group):
        return WarmUpReport(False, reason="a warm-up request does not fit the KV budget")
    report = WarmUpReport(True)
    start = time.perf_counter()
    with engine.prefix_cache_paused(), _speculator_set_aside(engine.speculator):
        _run(engine, shorts, long, report)
        if report.ran and engine.speculator is not None:
            for n in (1, 2, 4):  # a lone row's verify shapes, then batches' (up to the speculator's widest)
                if n <= min(engine.speculator.config.max_batch, config.max_num_seqs) and report.ran:
                    _verify(engine, [request(f"v{n}-{i}", short_len, 2 * G) for i in range(n)], rng, vocab, report)
    report.seconds = time.perf_counter() - start
    report.slowest_step_s = max(report.step_seconds, default=0.0)
    return report


def _run(engine: Any, shorts: list[Request], long: Request, report: WarmUpReport) -> None:
    """The short rows decode, then the long prompt runs beside them; every request is gone after."""
    group = [*shorts, long]
    try:
        for r in shorts:
            engine.add_request(r)
        long_added = False
        while engine.has_work() and report.steps < MAX_STEPS:
            if not long_added and all(r.output_ids for r in shorts):  # the short rows decode: start the long prompt
                engine.add_request(long)
                long_added = True
            _timed_step(engine, report)
    except Exception as exc:  # noqa: BLE001 (a warm-up must never stop the server; requests will show any real fault)
        _failed(report, exc)
    finally:
        _abort(engine, group)


def _timed_step(engine: Any, report: WarmUpReport) -> None:
    t = time.perf_counter()
    engine.step()
    report.step_seconds.append(time.perf_counter() - t)
    report.steps += 1


def _failed(report: WarmUpReport, exc: Exception) -> None:
    logger.warning("warm-up failed (%s); serving without it", exc, exc_info=True)
    report.ran, report.reason = False, f"failed: {exc}"


def _abort(engine: Any, group: list[Request]) -> None:
    """Every request of ``group`` still in the engine aborted, and the aborts settled."""
    for r in group:
        if r.request_id in engine.requests:
            engine.abort_request(r.request_id)
    for _ in range(8):
        if not engine.has_work():
            break
        engine.step()


@contextmanager
def _speculator_set_aside(spec: Any) -> Iterator[None]:
    """The speculator (if any) learns nothing from the warm-up: its evidence, measured step costs
    and counts are fresh ones for the duration, its own put back after."""
    if spec is None:
        yield
        return
    saved = spec.acceptance, spec.costs, spec.counters
    spec.acceptance, spec.costs, spec.counters = Acceptance(), StepCosts(), SpecCounters()
    try:
        yield
    finally:
        spec.acceptance, spec.costs, spec.counters = saved


class _Drafts:
    """A warm-up proposer: random drafts, of the speculator's sizes in turn (one a step)."""

    name = "warm-up"

    def __init__(self, sizes: tuple[int, ...], rng: random.Random, vocab: int) -> None:
        self.sizes, self.rng, self.vocab, self.steps = sizes, rng, vocab, 0

    def propose(self, asks: Any) -> dict[RequestId, Any]:
        n = self.sizes[self.steps % len(self.sizes)]
        self.steps += 1
        return {a.request.request_id: Draft(tuple(self.rng.randrange(self.vocab) for _ in range(min(n, a.k))))
                for a in asks}

    def feedback(self, request_id: RequestId, num_accepted: int) -> None:
        pass

    def forget(self, request_id: RequestId) -> None:
        pass


def _verify(engine: Any, group: list[Request], rng: random.Random, vocab: int, report: WarmUpReport) -> None:
    """``group`` prefills, then verifies a draft of each of the speculator's sizes (``_Drafts``,
    every proposal verified whole); the speculator's proposer, rule and learned state are put
    back after, and every request is gone."""
    spec = engine.speculator
    saved = spec.proposer, spec.config
    sizes = spec.draft_sizes()
    spec.config = replace(spec.config, adaptive=False)
    spec.proposer = drafts = _Drafts(sizes, rng, vocab)
    verifies = spec.counters.verifies
    try:
        for r in group:
            engine.add_request(r)
        for _ in range(4 * len(sizes) + 32):  # a bound: the group prefills, then verifies each size once
            if not engine.has_work() or spec.counters.verifies - verifies >= len(sizes) * len(group):
                break
            if not all(r.output_ids for r in group):
                drafts.steps = 0  # drafts only once every row decodes
            _timed_step(engine, report)
    except Exception as exc:  # noqa: BLE001 (a warm-up must never stop the server; requests will show any real fault)
        _failed(report, exc)
    finally:
        spec.proposer, spec.config = saved
        _abort(engine, group)
