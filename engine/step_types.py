"""What the scheduler asks of the model runner for one step, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.request import FinishReason, RequestId, TokenLogprob


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens ``[start_idx, end_idx)`` of one request; ``is_last`` samples a token, and
    then each request in ``forks`` (the other choices of ``n > 1``) becomes a row sharing this
    row's history and samples its own first token from the same logits. A request's first
    chunk after a prefix-cache hit carries the hit (``restore``, opaque here: the engine's
    ``PrefixReuse`` made it), and its row is rebuilt from it before the chunk runs.

    prompt:  |<- computed ->|<-- this chunk -->|<- later chunks ->|
             0          start_idx          end_idx           len(prompt)
    """

    request_id: RequestId
    start_idx: int
    end_idx: int
    is_last: bool
    forks: tuple[RequestId, ...] = ()
    restore: Any = None  # a request's first chunk: the prefix-cache hit its row is rebuilt from

    @property
    def num_tokens(self) -> int:
        return self.end_idx - self.start_idx


@dataclass(frozen=True)
class StepPlan:
    """One engine step: rows to free first, prompt chunks to prefill, rows to decode one token.
    ``drafts``: decoding rows that verify proposed tokens instead (``engine/speculator.py``): the
    row's last token and its drafts run as one chunk, and it may gain ``1 + len(drafts)`` tokens."""

    prefills: tuple[PrefillChunk, ...] = ()
    decodes: tuple[RequestId, ...] = ()
    freed: tuple[RequestId, ...] = ()
    drafts: dict[RequestId, tuple[int, ...]] = field(default_factory=dict)
    draft_probs: dict[RequestId, Any] = field(default_factory=dict)  # a draft model's distributions (opaque here)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefills) + len(self.decodes) + sum(map(len, self.drafts.values()))

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes and not self.freed


class SampledToken(msgspec.Struct, frozen=True):  # a msgspec struct: one a row a step
    """A row's new token; ``finish`` when its grammar ends the row with it (complete: STOP,
    token refused: GRAMMAR_DEAD_END)."""

    request_id: RequestId
    token_id: int
    logprob: TokenLogprob | None = None
    finish: FinishReason | None = None


@dataclass(frozen=True)
class PromptScores:
    """What one prompt chunk scored of its request's prompt (``SamplingParams.prompt_logprobs``):
    the log-probabilities of prompt tokens ``[first, first + len(logprobs))``, each predicted by
    the position before it, and for each its ``top`` alternatives as (token id, logprob).

    chunk [s, e) of a prompt of n tokens:  positions s .. min(e, n - 1) - 1  ->  tokens s + 1 .. min(e, n - 1)
    (token 0 has no score; the last position of the last chunk predicts the first sampled token)
    """

    first: int
    logprobs: tuple[float, ...]
    top: tuple[tuple[tuple[int, float], ...], ...] = ()


@dataclass(frozen=True)
class StepResult:
    """Sampled tokens by request, requests whose forward pass failed (with the reason),
    constrained rows that ended without a token (their grammar allowed none), and the scores of
    prompt tokens of requests that asked for them. ``accepted``: a verifying row's drafted tokens
    that were accepted, in order before its ``sampled`` token."""

    sampled: dict[RequestId, SampledToken] = field(default_factory=dict)
    accepted: dict[RequestId, tuple[SampledToken, ...]] = field(default_factory=dict)
    failed: dict[RequestId, str] = field(default_factory=dict)
    ended: dict[RequestId, FinishReason] = field(default_factory=dict)
    prompt_scores: dict[RequestId, PromptScores] = field(default_factory=dict)
