"""Per-request sampling on one row of logits (penalties, logit bias, a grammar's mask,
temperature, top-k/top-p/min-p), and the matchers of constrained rows whose next-token masks
it applies, computed on a worker thread while the step's forward runs (``RowGrammars``).

Each request owns its random key (split once per token), so a seeded request samples the
same tokens alone or beside any other request. Log-probabilities reported to clients are the
model's own (log-softmax of the raw logits), as in OpenAI's API and vLLM's default, also for
rows under a grammar. A grammar's mask (``RowGrammars``, below) is one ``mx.where`` on the
row's logits before any filter, so greedy and sampled choices alike only see allowed tokens
(llguidance's ``llguidance.mlx.apply_token_bitmask`` is a Metal-only kernel; this runs on every
backend).

Constrained rows. One matcher per row (each choice of ``n > 1`` its own), made from the
request's compiled ``Constraint`` the first time the row samples. A step of the model runner:

    engine thread:  start(masks) --> build + dispatch the step's forward --> wait --> sample --> consume
    mask worker:          [ fill every constrained row's mask (llguidance, no GIL) ]

The mask for a row's next token depends only on the tokens it already sampled (consumed at the
end of the previous step), so it is computed while the model computes the logits it will mask.
Only one job runs at a time and the runner waits for it before the step ends: no matcher is
touched by two threads at once, and a row freed between steps (finished, aborted) is never in
a running job.

A row's step ends one of three ways after its token is consumed: the grammar is complete (the
matcher stopped: ``stop``), the token was refused or the matcher erred (``grammar_dead_end``),
or neither (the row goes on). A mask with no allowed token, or a matcher in error before
sampling, ends the row without a token (``grammar_dead_end``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx
import msgspec
import numpy as np
from llguidance import LLExecutor, LLMatcher
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask_par
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from engine.request import FinishReason, Request, RequestId, SamplingParams
from engine.step_types import PromptScores

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20
DEAD_END = None  # a row's mask entry when no token is allowed (or its matcher erred)


@dataclass
class SamplerState:
    """Random key and generated-token counts (for presence/frequency penalties) of one request."""

    key: mx.array
    counts: mx.array | None
    bias: tuple[mx.array, mx.array] | None


def make_sampler_state(params: SamplingParams, vocab_size: int) -> SamplerState:
    seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
    counts = mx.zeros((vocab_size,), dtype=mx.float32) if params.has_penalties else None
    bias = None
    if params.logit_bias:
        ids, values = zip(*params.logit_bias)
        bias = (mx.array(ids, dtype=mx.int32), mx.array(values, dtype=mx.float32))
    return SamplerState(key=mx.random.key(seed % (1 << 64)), counts=counts, bias=bias)


class SampleArrays(msgspec.Struct, frozen=True):
    """Lazy results of one sampling call (evaluated together with the rest of the step). With
    ``index``, ``token`` is a batch's tokens [B] (``sample_greedy_batch``) and the row's is
    ``token[index]``. A msgspec struct: one is made for every row of every step."""

    token: mx.array
    logprob: mx.array | None
    top_ids: mx.array | None
    top_logprobs: mx.array | None
    index: int | None = None

    def arrays(self) -> list[mx.array]:
        """The lazy arrays to evaluate."""
        return [a for a in (self.token, self.logprob, self.top_ids, self.top_logprobs) if a is not None]

    def row_token(self) -> mx.array:
        """The row's token (a scalar array)."""
        return self.token if self.index is None else self.token[self.index]


def plain_greedy(params: SamplingParams, state: SamplerState) -> bool:
    """Whether ``sample`` would take the argmax of the logits as they are: greedy, no logit bias,
    no penalties, no logprobs (a grammar's mask is the caller's to rule out)."""
    return params.is_greedy and state.bias is None and state.counts is None and not params.logprobs


def sample_greedy_batch(logits: mx.array, rows: list[int]) -> dict[int, SampleArrays]:
    """``sample``'s token for each of ``rows`` of a batch's logits [B, vocab] whose rows are
    ``plain_greedy``: one argmax for the whole batch (the same token, row by row, as ``sample``:
    float32 logits, the first of equal maxima), instead of a slice and an argmax a row."""
    tokens = mx.argmax(logits.astype(mx.float32), axis=-1)
    return {b: SampleArrays(tokens, None, None, None, index=b) for b in rows}


def sample(logits: mx.array, params: SamplingParams, state: SamplerState,
           allowed: mx.array | None = None) -> SampleArrays:
    """Sample one token from ``logits`` of shape [vocab]; updates ``state`` in place.
    ``allowed`` (bool, [vocab]): the only tokens it may pick (at least one is True)."""
    logits = logits.astype(mx.float32)
    processed = logits
    if state.bias is not None:
        processed = processed.at[state.bias[0]].add(state.bias[1])
    if state.counts is not None:
        processed = processed - params.frequency_penalty * state.counts
        processed = processed - params.presence_penalty * (state.counts > 0)
    if allowed is not None:
        processed = mx.where(allowed, processed, -mx.inf)
    if params.is_greedy:
        token = mx.argmax(processed, axis=-1)
    else:
        state.key, subkey = mx.random.split(state.key)
        scaled = processed / params.temperature
        filtered = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
        vocab_size = filtered.shape[-1]
        if 0 < params.top_k < vocab_size:
            filtered = apply_top_k(filtered, params.top_k)
        if params.top_p < 1.0:
            filtered = apply_top_p(filtered, params.top_p)
        if params.min_p > 0.0:
            filtered = apply_min_p(filtered, params.min_p)
        token = mx.random.categorical(filtered, key=subkey)
    if state.counts is not None:
        state.counts = state.counts.at[token].add(1.0)
    if not params.logprobs:
        return SampleArrays(token, None, None, None)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    top_ids = top_values = None
    if params.top_logprobs > 0:
        k = min(params.top_logprobs, logprobs.shape[-1])
        top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:k]
        top_values = logprobs[top_ids]
    return SampleArrays(token, logprobs[token], top_ids, top_values)


def batch_tokens(sampled: list[SampleArrays]) -> mx.array:
    """The tokens [B] of rows in batch order: a batch's own argmax where it is exactly theirs."""
    first = sampled[0]
    if first.index is not None and all(a.token is first.token and a.index == b for b, a in enumerate(sampled)) \
            and first.token.shape[0] == len(sampled):
        return first.token
    return mx.stack([a.row_token() for a in sampled])


@dataclass(frozen=True)
class PromptArrays:
    """Lazy scores of the prompt tokens ``[first, first + n)`` one chunk predicts (``score_prompt``)."""

    first: int
    logprobs: mx.array  # [n]
    top_ids: mx.array | None  # [n, k]
    top_logprobs: mx.array | None  # [n, k]

    def arrays(self) -> list[mx.array]:
        """The lazy arrays to evaluate."""
        return [a for a in (self.logprobs, self.top_ids, self.top_logprobs) if a is not None]

    def read(self) -> PromptScores:
        """The evaluated scores in Python (each position's alternatives most likely first)."""
        top: tuple[tuple[tuple[int, float], ...], ...] = ()
        if self.top_ids is not None:
            top = tuple(tuple(sorted(zip(ids, values), key=lambda p: -p[1]))
                        for ids, values in zip(self.top_ids.tolist(), self.top_logprobs.tolist()))
        return PromptScores(self.first, tuple(self.logprobs.tolist()), top)


def score_prompt(logits: mx.array, prompt_ids: list[int], start: int, end: int, top_k: int) -> PromptArrays | None:
    """The log-probabilities of the prompt tokens that chunk ``[start, end)``'s positions predict,
    from its logits ``[end - start, vocab]`` (position p predicts token p + 1; the prompt's last
    position predicts the first sampled token, not a prompt token), and each position's
    ``top_k`` alternatives. None when the chunk predicts no prompt token. Model's own
    log-softmax, as ``sample`` reports for sampled tokens."""
    stop = min(end, len(prompt_ids) - 1)
    count = stop - start
    if count <= 0:
        return None
    logprobs = logits[:count].astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    targets = mx.array(prompt_ids[start + 1: stop + 1], dtype=mx.int32)[:, None]
    chosen = mx.take_along_axis(logprobs, targets, axis=-1)[:, 0]
    top_ids = top_values = None
    if top_k > 0:
        k = min(top_k, logprobs.shape[-1])
        top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
        top_values = mx.take_along_axis(logprobs, top_ids, axis=-1)
    return PromptArrays(start + 1, chosen, top_ids, top_values)


# --- constrained rows: their matchers and next-token masks ---

@dataclass
class MaskStats:
    """Mask work since the engine started: masks computed, seconds the worker spent on them, and
    seconds the engine thread waited for them (what the overlap did not hide)."""

    masks: int = 0
    mask_s: float = 0.0
    wait_s: float = 0.0
    consume_s: float = 0.0


class MaskJob:
    """Masks being computed for one step: ``result()`` waits and gives ``{row: allowed}`` where
    ``allowed`` is a bool array over the model's vocabulary, or ``DEAD_END``."""

    def __init__(self, future: Future[dict[RequestId, np.ndarray | None]], stats: MaskStats) -> None:
        self._future, self._stats = future, stats

    def wait(self) -> None:
        """Wait for the job, whatever its outcome (a failed step)."""
        self._future.exception()

    def result(self) -> dict[RequestId, np.ndarray | None]:
        start = time.perf_counter()
        try:
            return self._future.result()
        finally:
            self._stats.wait_s += time.perf_counter() - start


class RowGrammars:
    """Matchers by row. Only the engine thread calls it (the worker gets the matchers of one
    job, and the engine waits for the job before touching them again)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.matchers: dict[RequestId, LLMatcher] = {}
        self.widths: dict[RequestId, int] = {}  # each row's mask width: llguidance's vocabulary (>= the model's)
        self.stats = MaskStats()
        self._pool: ThreadPoolExecutor | None = None  # made on first use: unconstrained servers start no thread
        self._executor: LLExecutor | None = None

    def start(self, sampling: Iterable[RequestId], requests: Mapping[RequestId, Request]) -> MaskJob | None:
        """Begin the masks of the rows in ``sampling`` that are constrained (making their
        matchers if they have none yet); None when no row is."""
        rows = []
        for request_id in sampling:
            matcher = self.matchers.get(request_id)
            if matcher is None:
                constraint = requests[request_id].params.constraint
                if constraint is None:
                    continue
                matcher = self.matchers[request_id] = constraint.new_matcher()
                self.widths[request_id] = constraint.mask_vocab
            rows.append((request_id, matcher))
        if not rows:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvarn-masks")
            self._executor = LLExecutor()
        return MaskJob(self._pool.submit(self._fill, rows), self.stats)

    def _fill(self, rows: list[tuple[RequestId, LLMatcher]]) -> dict[RequestId, np.ndarray | None]:
        """The worker: the rows' masks in one llguidance call per mask width (one, unless
        constraints were compiled for different vocabularies), unpacked to bools."""
        start = time.perf_counter()
        masks: dict[RequestId, np.ndarray | None] = {}
        for width in sorted({self.widths[request_id] for request_id, _ in rows}):
            group = [(request_id, m) for request_id, m in rows if self.widths[request_id] == width]
            words = allocate_token_bitmask(len(group), width)
            fill_next_token_bitmask_par(self._executor, [(m, k) for k, (_, m) in enumerate(group)], words)
            allowed = _fit(np.unpackbits(words.view(np.uint8), axis=1, bitorder="little").astype(bool),
                           self.vocab_size)
            for k, (request_id, matcher) in enumerate(group):
                if matcher.is_error() or not allowed[k].any():
                    logger.warning("constrained row %s has no allowed token: %s", request_id,
                                   matcher.get_error() or "empty mask")
                    masks[request_id] = DEAD_END
                else:
                    masks[request_id] = allowed[k]
        self.stats.masks += len(rows)
        self.stats.mask_s += time.perf_counter() - start
        return masks

    def consume(self, request_id: RequestId, token_id: int) -> FinishReason | None:
        """Advance a constrained row's matcher by its sampled token; the row's end, if this
        token ends it (None for unconstrained rows and rows that go on)."""
        matcher = self.matchers.get(request_id)
        if matcher is None:
            return None
        start = time.perf_counter()
        ok = matcher.consume_token(token_id)
        self.stats.consume_s += time.perf_counter() - start
        if not ok or matcher.is_error():
            logger.warning("constrained row %s: token %d refused: %s", request_id, token_id, matcher.get_error())
            return FinishReason.GRAMMAR_DEAD_END
        return FinishReason.STOP if matcher.is_stopped() else None

    def free(self, request_ids: Iterable[RequestId]) -> None:
        for request_id in request_ids:
            self.matchers.pop(request_id, None)
            self.widths.pop(request_id, None)


def _fit(allowed: np.ndarray, vocab_size: int) -> np.ndarray:
    """Masks cut (or padded with False) to the model's logits width."""
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    return np.pad(allowed, ((0, 0), (0, vocab_size - allowed.shape[1])))
