"""The speculator: which decoding rows verify drafts this step, and how many tokens each.

After the scheduler plans a step, ``plan_drafts`` asks the proposer for drafts for the rows that
may speculate, keeps what is worth its cost and puts it on the plan (``StepPlan.drafts``); the
model runner verifies them (``engine/verify.py``) and ``observe`` learns from what was accepted
and what the step cost. A row may speculate only if

- the request allows it (``SamplingParams.speculative``), is not under a grammar (its matcher
  masks one position at a time on a worker thread: verifying k + 1 positions would walk the
  matcher along every draft and roll it back on rejection; such rows decode as usual) and has no
  presence/frequency penalty (each position's penalty depends on the drafts before it);
- its storage can drop rejected tokens and has room (``kvarn.rows.verify_room``: a KVarN row's
  verify stays inside its current tile), and ``max_tokens`` and the context leave room;
- the step is not compute-bound: with more than ``max_batch`` decoding rows nobody speculates
  (a wide batch already fills the matmuls; extra positions would only slow it).

How long a draft (``choose_length``, with ``adaptive``): a verify of T tokens a row costs more
than a one-token step, and every row of the batch pays for the longest draft (rows are padded to
it). Each draft token is kept with a probability ``p`` estimated per row (``Acceptance``):
evidence per matched-suffix length (longer matches hold longer), shared by every row, blended
with the row's own recent verifies, which fade step by step (a row that keeps rejecting drafts
nothing until its evidence fades or a longer match comes). The step drafts D tokens (one of
``DRAFT_SIZES``: few graph shapes) where the expected tokens per cost

    (B + sum over rows of p + p^2 + ... + p^min(len, D)) / cost(B rows, 1 + D tokens)

beat B, the one-token step; else nobody drafts. ``StepCosts`` measures cost(B, T) / cost(B, 1)
from the steps themselves (a prior until it has seen both), and what asking the proposer costs
against a one-token step (a draft model's forwards; a prompt lookup's is negligible): a row is
asked only where its drafts could pay for that too (once drafts are in hand, their cost is spent).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.proposers import Ask, Draft, NgramProposer, Proposer
from engine.request import Request, RequestId
from engine.step_types import StepPlan, StepResult

METHODS = ("ngram", "draft")
DRAFT_SIZES = (1, 2, 4, 8)  # draft lengths a step uses (with k): each is a compiled graph shape
MATCH_BUCKETS = 8  # matched-suffix lengths told apart by the acceptance evidence (longer: the last)
PRIOR_HITS, PRIOR_TRIALS = 1.0, 2.0  # a fresh match length's evidence: one in two kept
SHARED_DECAY = 0.98  # weight of the shared evidence's past at each new verify
ROW_FADE = 0.9  # weight of a row's own evidence after each step
ROW_WEIGHT = 4.0  # the shared evidence counts as this many draft tokens beside the row's own
VERIFY_FIXED, VERIFY_PER_TOKEN = 0.2, 0.1  # prior: cost(B, T) / cost(B, 1) = 1 + fixed + per token
COST_WINDOW = 16  # the newest steps' wall times kept per (rows, tokens)
COST_TRUST = 8  # measured steps after which a ratio no longer leans on the prior


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding, in plain values (``--speculative``, ``--num-speculative-tokens``,
    ``--speculative-ngram-min``/``-max``, ``--speculative-max-batch``, ``--draft-model``).
    ``adaptive`` False drafts every proposal whole (up to ``num_tokens``), whatever it costs."""

    method: str = "ngram"  # prompt lookup; "draft": a draft model (``draft_model``: its folder)
    num_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    max_batch: int = 8
    draft_model: str | None = None
    proposer: Any = None  # a ``Proposer`` of the embedding code's own (None: the method's)
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r} ({', '.join(METHODS)})")
        if self.num_tokens < 1 or self.max_batch < 1:
            raise ValueError("num_speculative_tokens and speculative_max_batch must be >= 1")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError("the n-gram sizes need 1 <= ngram_min <= ngram_max")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("the draft method needs a draft model (--draft-model PATH), and a draft model "
                             "needs the draft method (--speculative draft)")

    def describe(self) -> dict[str, object]:
        own = ({"ngram_min": self.ngram_min, "ngram_max": self.ngram_max} if self.method == "ngram"
               else {"draft_model": Path(self.draft_model).name})
        method = self.method if self.proposer is None else getattr(self.proposer, "name", type(self.proposer).__name__)
        return {"method": method, "num_speculative_tokens": self.num_tokens, "max_batch": self.max_batch, **own}


@dataclass
class Evidence:
    """Draft tokens kept (``hits``) out of draft tokens tried (``trials``: each kept one, and the
    first rejected one of a verify; tokens after it were never tried), both decaying."""

    hits: float = 0.0
    trials: float = 0.0

    def add(self, accepted: int, drafted: int, keep: float = 1.0) -> None:
        self.hits = self.hits * keep + accepted
        self.trials = self.trials * keep + accepted + (accepted < drafted)

    def fade(self, keep: float) -> None:
        self.hits *= keep
        self.trials *= keep


@dataclass
class RowState:
    """A row's own acceptance evidence, the step it was last faded at, and its last draft's
    matched-suffix bucket (what ``observe`` credits)."""

    evidence: Evidence = field(default_factory=Evidence)
    step: int = 0
    bucket: int = 0


class Acceptance:
    """Estimates of ``p``, the probability that a draft token is kept given those before it were:
    shared evidence per matched-suffix bucket (0: drafts without a match length), and per row."""

    def __init__(self) -> None:
        self.shared = [Evidence(PRIOR_HITS, PRIOR_TRIALS) for _ in range(MATCH_BUCKETS + 1)]
        self.rows: dict[RequestId, RowState] = {}
        self.seen: set[int] = set()

    def row(self, request_id: RequestId, step: int) -> RowState:
        """The row's state, its evidence faded up to ``step``."""
        state = self.rows.setdefault(request_id, RowState(step=step))
        if state.step < step:
            state.evidence.fade(ROW_FADE ** (step - state.step))
            state.step = step
        return state

    def rate(self, state: RowState, bucket: int) -> float:
        shared = self.shared[bucket]
        own = state.evidence
        return (ROW_WEIGHT * shared.hits / shared.trials + own.hits) / (ROW_WEIGHT + own.trials)

    def best_rate(self, state: RowState) -> float:
        """The row's ``p`` under the best match it may yet see: every bucket verified so far and,
        unless its proposer gives no match lengths (only bucket 0 seen), the longest, which a
        strong match may reach."""
        buckets = self.seen if self.seen == {0} else self.seen | {MATCH_BUCKETS}
        return max(self.rate(state, b) for b in buckets)

    def observe(self, state: RowState, accepted: int, drafted: int) -> None:
        self.shared[state.bucket].add(accepted, drafted, SHARED_DECAY)
        self.seen.add(state.bucket)
        state.evidence.add(accepted, drafted)


def bucket_of(draft: Draft) -> int:
    return min(draft.match, MATCH_BUCKETS)


class StepCosts:
    """cost(B, T) / cost(B, 1): a step of B decoding rows, the longest writing T tokens, against
    the same rows writing one. Measured per (row bucket, T) as the median wall time, from
    ``plan_drafts`` to ``observe``, of its last ``COST_WINDOW`` steps without prompt chunks (a
    median: a graph's first trace or a tile's commit is a rare step many times slower), leaning
    on the prior 1 + ``VERIFY_FIXED`` + ``VERIFY_PER_TOKEN`` * (T - 1) * (B + 2) / 3 until both
    have ``COST_TRUST`` steps. Never below 1: more tokens never make a step cheaper."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[int, int], deque[float]] = {}
        self.proposing: dict[int, deque[float]] = {}  # seconds the proposer took, per row bucket

    def ratio(self, rows: int, tokens: int) -> float:
        prior = 1 + VERIFY_FIXED + VERIFY_PER_TOKEN * (tokens - 1) * (rows + 2) / 3 if tokens > 1 else 1.0
        b = _row_bucket(rows)
        base, longer = self.seconds.get((b, 1)), self.seconds.get((b, tokens))
        if tokens <= 1 or not base or not longer:
            return prior
        n = min(len(base), len(longer), COST_TRUST)
        measured = statistics.median(longer) / statistics.median(base)
        return max(1.0, (n * measured + (COST_TRUST - n) * prior) / COST_TRUST)

    def add(self, rows: int, tokens: int, seconds: float) -> None:
        self.seconds.setdefault((_row_bucket(rows), tokens), deque(maxlen=COST_WINDOW)).append(seconds)

    def add_proposing(self, rows: int, seconds: float) -> None:
        self.proposing.setdefault(_row_bucket(rows), deque(maxlen=COST_WINDOW)).append(seconds)

    def proposing_ratio(self, rows: int) -> float:
        """Asking the proposer for a step of ``rows`` rows, in one-token steps (0 until both are
        measured)."""
        b = _row_bucket(rows)
        asked, base = self.proposing.get(b), self.seconds.get((b, 1))
        if not asked or not base:
            return 0.0
        return statistics.median(asked) / statistics.median(base)


def _row_bucket(rows: int) -> int:
    return 1 << (rows - 1).bit_length()  # 1, 2, 4, 8, ...


def choose_length(rates: list[float], lengths: list[int], rows: int, costs: StepCosts, sizes: tuple[int, ...],
                  extra: float = 0.0) -> int:
    """The draft length D (0: none) that maximizes expected tokens per cost for a step of ``rows``
    decoding rows, of which some hold drafts of ``lengths`` tokens with per-token ``rates``;
    ``extra``: what drafting adds to a step besides the verify (in one-token steps)."""
    best, best_value = 0, float(rows)
    for size in sizes:
        if size > max(lengths):
            break
        gain = 0.0
        for p, n in zip(rates, lengths):
            gain += sum(p ** j for j in range(1, min(n, size) + 1))
        value = (rows + gain) / (costs.ratio(rows, 1 + size) + extra)
        if value > best_value:
            best, best_value = size, value
    return best


@dataclass
class SpecCounters:
    """Totals since start (``/metrics``): drafted tokens verified, accepted, verifies run, and
    steps where the batch was too wide to speculate."""

    proposed: int = 0
    accepted: int = 0
    verifies: int = 0
    wide_steps: int = 0


@dataclass
class Speculator:
    config: SpecConfig
    proposer: Proposer
    context_length: int
    max_step_tokens: int
    acceptance: Acceptance = field(default_factory=Acceptance)
    costs: StepCosts = field(default_factory=StepCosts)
    counters: SpecCounters = field(default_factory=SpecCounters)
    steps: int = 0
    clock: Callable[[], float] = time.perf_counter
    _timing: tuple[int, int, float] | None = None  # the step in flight: (rows, tokens a row, start)

    def may_speculate(self, requests: list[Request]) -> bool:
        """Whether a step of these decoding rows could verify drafts (async scheduling then does
        not launch the next step before reading this one back)."""
        return len(requests) <= self.config.max_batch and any(self._eligible(r) for r in requests)

    def plan_drafts(self, plan: StepPlan, requests: Mapping[RequestId, Request],
                    room: Callable[[RequestId], int]) -> StepPlan:
        """``plan`` with drafts for the decoding rows that speculate (``room(id)``: tokens the
        row's storage takes in one verify)."""
        self.steps += 1
        self._timing = None
        if not plan.decodes:
            return plan
        if len(plan.decodes) > self.config.max_batch:
            self.counters.wide_steps += 1
            return plan
        asks = self._asks(plan, requests, room)
        drafts = {}
        if asks:
            start = self.clock()
            drafts = self.proposer.propose(asks)
            self.costs.add_proposing(len(plan.decodes), self.clock() - start)
        if drafts and self.config.adaptive:
            drafts = self._worth_it(drafts, len(plan.decodes))
        if not plan.prefills:
            tokens = 1 + max((len(d.tokens) for d in drafts.values()), default=0)
            self._timing = (len(plan.decodes), tokens, self.clock())
        if not drafts:
            return plan
        for request_id, draft in drafts.items():
            self.acceptance.row(request_id, self.steps).bucket = bucket_of(draft)
        return replace(plan, drafts={i: d.tokens for i, d in drafts.items()},
                       draft_probs={i: d.probs for i, d in drafts.items() if d.probs is not None})

    def _asks(self, plan: StepPlan, requests: Mapping[RequestId, Request],
              room: Callable[[RequestId], int]) -> list[Ask]:
        """The rows that may draft this step, each with the most tokens it may verify; with
        ``adaptive``, only rows whose best estimate could pay for a one-token draft."""
        budget, rows, sizes = self.max_step_tokens - plan.num_tokens, len(plan.decodes), self.draft_sizes()
        proposing = self.costs.proposing_ratio(rows)
        asks = []
        for request_id in plan.decodes:
            request = requests[request_id]
            if not self._eligible(request):
                continue
            if self.config.adaptive:  # hopeless even if every row drafted as well as this one could
                rate = self.acceptance.best_rate(self.acceptance.row(request_id, self.steps))
                if choose_length([rate] * rows, [sizes[-1]] * rows, rows, self.costs, sizes, proposing) == 0:
                    continue
            done = request.num_prompt_tokens + len(request.output_ids)
            k = min(self.config.num_tokens, room(request_id) - 1, budget,
                    request.params.max_tokens - len(request.output_ids) - 1, self.context_length - done - 1)
            if k >= 1:
                asks.append(Ask(request, k))
                budget -= k
        return asks

    def _worth_it(self, drafts: dict[RequestId, Draft], rows: int) -> dict[RequestId, Draft]:
        """The drafts cut to the step's length (``choose_length``), each to a size of
        ``DRAFT_SIZES`` (the verify's shape is one of few); none where drafting does not pay."""
        sizes = self.draft_sizes()
        lengths = {i: max(n for n in sizes if n <= len(d.tokens)) for i, d in drafts.items()}
        rates = [self.acceptance.rate(self.acceptance.row(i, self.steps), bucket_of(d)) for i, d in drafts.items()]
        size = choose_length(rates, list(lengths.values()), rows, self.costs, sizes)
        if size == 0:
            return {}
        out = {}
        for request_id, draft in drafts.items():
            n = max(m for m in sizes if m <= min(lengths[request_id], size))
            probs = None if draft.probs is None else draft.probs[:n]
            out[request_id] = Draft(draft.tokens[:n], probs, draft.match)
        return out

    def draft_sizes(self) -> tuple[int, ...]:
        return tuple(n for n in DRAFT_SIZES if n < self.config.num_tokens) + (self.config.num_tokens,)

    def _eligible(self, request: Request) -> bool:
        params = request.params
        return params.speculative and params.constraint is None and not params.has_penalties

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        """Count each verify's accepted drafts and learn from them; time the step."""
        if self._timing is not None and not result.failed:
            rows, tokens, start = self._timing
            self.costs.add(rows, tokens, self.clock() - start)
        self._timing = None
        for request_id, drafts in plan.drafts.items():
            if request_id not in result.sampled:
                continue
            accepted = len(result.accepted.get(request_id, ()))
            self.proposer.feedback(request_id, accepted)
            self.counters.proposed += len(drafts)
            self.counters.accepted += accepted
            self.counters.verifies += 1
            self.acceptance.observe(self.acceptance.row(request_id, self.steps), accepted, len(drafts))

    def forget(self, request_id: RequestId) -> None:
        self.acceptance.rows.pop(request_id, None)
        self.proposer.forget(request_id)

    def describe(self) -> dict[str, object]:
        c = self.counters
        return {**self.config.describe(), "proposed_tokens": c.proposed, "accepted_tokens": c.accepted,
                "verifies": c.verifies, "acceptance_rate": round(c.accepted / c.proposed, 4) if c.proposed else None}


def make_proposer(config: SpecConfig, target: Any = None) -> Proposer:
    """The proposer ``config`` names (``target``: the loaded target model, whose tokenizer a draft
    model must share), or the one it carries."""
    if config.proposer is not None:
        return config.proposer
    if config.method == "draft":
        from engine.draft_model import load_draft

        return load_draft(config.draft_model, target)
    return NgramProposer(config.ngram_min, config.ngram_max)


__all__ = ["Ask", "Draft", "SpecConfig", "Speculator", "make_proposer"]
