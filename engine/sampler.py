"""Per-request sampling on one row of logits: penalties, logit bias, a grammar's mask,
temperature, top-k/top-p/min-p.

Each request owns its random key (split once per token), so a seeded request samples the
same tokens alone or beside any other request. Log-probabilities reported to clients are the
model's own (log-softmax of the raw logits), as in OpenAI's API and vLLM's default, also for
rows under a grammar. A grammar's mask (``engine/grammar_rows.py``) is one ``mx.where`` on the
row's logits before any filter, so greedy and sampled choices alike only see allowed tokens
(llguidance's ``llguidance.mlx.apply_token_bitmask`` is a Metal-only kernel; this runs on every
backend).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from engine.request import SamplingParams

MAX_TOP_LOGPROBS = 20


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


@dataclass(frozen=True)
class SampleArrays:
    """Lazy results of one sampling call (evaluated together with the rest of the step)."""

    token: mx.array
    logprob: mx.array | None
    top_ids: mx.array | None
    top_logprobs: mx.array | None


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


@dataclass(frozen=True)
class PromptArrays:
    """Lazy scores of the prompt tokens ``[first, first + n)`` one chunk predicts (``score_prompt``)."""

    first: int
    logprobs: mx.array  # [n]
    top_ids: mx.array | None  # [n, k]
    top_logprobs: mx.array | None  # [n, k]


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
