"""The speculator: which decoding rows verify drafts this step, and how many tokens each.

After the scheduler plans a step, ``plan_drafts`` asks the proposer for drafts for the rows that
may speculate and puts them on the plan (``StepPlan.drafts``); the model runner verifies them
(``engine/verify.py``) and ``observe`` counts what was accepted. A row speculates only if

- the request allows it (``SamplingParams.speculative``), is not under a grammar (its matcher
  masks one position at a time on a worker thread: verifying k + 1 positions would walk the
  matcher along every draft and roll it back on rejection; such rows decode as usual) and has no
  presence/frequency penalty (each position's penalty depends on the drafts before it);
- its storage can drop rejected tokens and has room (``kvarn.rows.verify_room``: a KVarN row's
  verify stays inside its current tile), and ``max_tokens`` and the context leave room;
- its acceptance has not stayed low: per row, an average of accepted / proposed over its recent
  verifies; below ``min_acceptance`` after ``min_verifies`` the row stops proposing for
  ``backoff`` steps, doubled each time it fails again;
- the step is not compute-bound: with more than ``max_batch`` decoding rows nobody speculates
  (a wide batch already fills the matmuls; extra positions would only slow it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.proposers import Ask, Draft, NgramProposer, Proposer
from engine.request import Request, RequestId
from engine.step_types import StepPlan, StepResult

EMA = 0.5  # weight of a row's newest verify in its acceptance average
METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding, in plain values (``--speculative``, ``--num-speculative-tokens``,
    ``--speculative-ngram-min``/``-max``, ``--speculative-max-batch``, ``--draft-model``)."""

    method: str = "ngram"  # prompt lookup; "draft": a draft model (``draft_model``: its folder)
    num_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    max_batch: int = 8
    draft_model: str | None = None
    proposer: Any = None  # a ``Proposer`` of the embedding code's own (None: the method's)
    min_acceptance: float = 0.3
    min_verifies: int = 4
    backoff: int = 16

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
class RowStats:
    """A row's acceptance: average of accepted / proposed, verifies, and its pause."""

    rate: float = 1.0
    verifies: int = 0
    paused_until: int = 0
    backoff: int = 0


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
    rows: dict[RequestId, RowStats] = field(default_factory=dict)
    counters: SpecCounters = field(default_factory=SpecCounters)
    steps: int = 0

    def may_speculate(self, requests: list[Request]) -> bool:
        """Whether a step of these decoding rows could verify drafts (async scheduling then does
        not launch the next step before reading this one back)."""
        return len(requests) <= self.config.max_batch and any(self._eligible(r) for r in requests)

    def plan_drafts(self, plan: StepPlan, requests: Mapping[RequestId, Request],
                    room: Callable[[RequestId], int]) -> StepPlan:
        """``plan`` with drafts for the decoding rows that speculate (``room(id)``: tokens the
        row's storage takes in one verify)."""
        self.steps += 1
        if not plan.decodes:
            return plan
        if len(plan.decodes) > self.config.max_batch:
            self.counters.wide_steps += 1
            return plan
        budget = self.max_step_tokens - plan.num_tokens
        asks = []
        for request_id in plan.decodes:
            request = requests[request_id]
            if not self._eligible(request):
                continue
            done = request.num_prompt_tokens + len(request.output_ids)
            k = min(self.config.num_tokens, room(request_id) - 1, budget,
                    request.params.max_tokens - len(request.output_ids) - 1, self.context_length - done - 1)
            if k >= 1:
                asks.append(Ask(request, k))
                budget -= k
        if not asks:
            return plan
        drafts = self.proposer.propose(asks)
        if not drafts:
            return plan
        return replace(plan, drafts={i: d.tokens for i, d in drafts.items()},
                       draft_probs={i: d.probs for i, d in drafts.items() if d.probs is not None})

    def _eligible(self, request: Request) -> bool:
        params = request.params
        if not params.speculative or params.constraint is not None or params.has_penalties:
            return False
        stats = self.rows.get(request.request_id)
        return stats is None or stats.paused_until <= self.steps

    def observe(self, plan: StepPlan, result: StepResult) -> None:
        """Count each verify's accepted drafts; pause rows whose acceptance stays low."""
        for request_id, drafts in plan.drafts.items():
            if request_id not in result.sampled:
                continue
            accepted = len(result.accepted.get(request_id, ()))
            self.proposer.feedback(request_id, accepted)
            self.counters.proposed += len(drafts)
            self.counters.accepted += accepted
            self.counters.verifies += 1
            stats = self.rows.setdefault(request_id, RowStats())
            stats.rate = (1 - EMA) * stats.rate + EMA * accepted / len(drafts)
            stats.verifies += 1
            if stats.verifies >= self.config.min_verifies and stats.rate < self.config.min_acceptance:
                stats.backoff = stats.backoff * 2 if stats.backoff else self.config.backoff
                stats.paused_until = self.steps + stats.backoff
                stats.verifies, stats.rate = 0, self.config.min_acceptance  # a fresh trial after the pause

    def forget(self, request_id: RequestId) -> None:
        self.rows.pop(request_id, None)
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
