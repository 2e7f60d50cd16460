"""Requests and their sampling parameters: the one mutable per-request record of the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NewType

import msgspec

if TYPE_CHECKING:
    from engine.constraints import Constraint

RequestId = NewType("RequestId", str)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Validated by the server; the engine trusts it.

    Invariants: ``max_tokens >= 1``, or 0 with ``prompt_logprobs`` (the prompt is scored, nothing
    is generated: the request ends with ``length`` after its prompt); ``temperature == 0`` means greedy; ``top_k == 0``,
    ``top_p == 1`` and ``min_p == 0`` switch their filters off; ``seed`` makes sampling
    reproducible for this request whatever else runs beside it. ``constraint`` (compiled by
    ``EngineClient.compile_constraint``) forces the output into a grammar: every choice runs its
    own matcher, EOS is allowed exactly when the grammar accepts, and the row ends when the
    grammar is complete (``stop``) or has no allowed token left (``grammar_dead_end``).
    ``prompt_logprobs`` (None: off) scores every prompt token but the first with ``k`` top
    alternatives: the prefill keeps every position's logits, and the prefix cache is not asked
    for such a request (a cached prefix has no logits); its blocks are still cached for others.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False  # a matched stop string ends the text instead of being cut
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    ignore_eos: bool = False
    prompt_logprobs: int | None = None
    speculative: bool = True  # False: this request never verifies drafts (``engine/speculator.py``)
    constraint: Constraint | None = field(default=None, compare=False, repr=False)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"
    GRAMMAR_DEAD_END = "grammar_dead_end"  # a constrained row with no allowed token (a grammar error or limit)


@dataclass
class Request:
    """A prompt and its generated tokens.

    ``num_computed_tokens`` counts tokens already in the KV cache: prompt tokens during
    prefill, then ``len(prompt_ids) + len(output_ids) - 1`` while decoding (the newest
    sampled token is fed at the next step).
    """

    request_id: RequestId
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    finish_reason: FinishReason | None = None
    fork_of: RequestId | None = None  # choice ``index`` > 0 of an ``n > 1`` request: forked at prefill end
    index: int = 0
    cache_salt: str | None = None  # the prefix cache serves only blocks cached under the same salt
    snapshot_at: tuple[int, ...] = ()  # prompt lengths worth a whole-row snapshot (checkpoint tier)
    num_cached_tokens: int = 0  # prompt tokens restored from the prefix cache

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= len(self.prompt_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass(frozen=True)
class TokenLogprob:
    """One token with its log-probability under the model, and the top alternatives.

    ``logprob`` is None only for a prompt's first token (nothing predicts it). ``text`` is the
    token's piece of its sequence's text (``engine/output.py``: the characters it completes,
    "" inside a multi-byte character), ``raw`` its own bytes; ``top_text`` gives each of ``top``
    its piece in this place and its bytes. ``eos``: the EOS token that ended a choice (no text)."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()
    text: str = ""
    raw: bytes = b""
    top_text: tuple[tuple[str, bytes], ...] = ()
    eos: bool = False


class RequestOutput(msgspec.Struct, frozen=True):
    """What one engine step produced for one request: new text, new tokens, and the end if any
    (a msgspec struct: one a row a step)."""

    request_id: RequestId
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]
    num_prompt_tokens: int
    num_output_tokens: int
    finish_reason: FinishReason | None = None
    error: str | None = None
    index: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (not computed)
    # SamplingParams.prompt_logprobs: every prompt token's entry (the first with logprob None),
    # on the choice's first output, once
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
