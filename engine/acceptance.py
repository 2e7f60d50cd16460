"""Which tokens a verify keeps: the target's choice at every position of a verified chunk.

At position i the target's distribution ``p_i`` (the row's logit bias, temperature and filters,
as ``engine/sampler.py`` samples) chooses ``c_i``; drafts ``d_1 .. d_k`` are accepted while
``c_i == d_{i+1}`` and the first differing ``c_j`` ends the row's tokens (``engine/verify.py``).

- greedy: ``c_i = argmax p_i``, the token plain decoding picks.
- drafts without a distribution (prompt lookup: ``q`` is one-hot at the draft): ``c_i`` is
  sampled from ``p_i`` with the key plain decoding uses for that token, so a seeded row's tokens
  are the ones it samples without speculation. The draft is accepted with probability
  ``p_i(d)``, and a rejection's token is ``p_i`` without ``d``: exactly standard speculative
  rejection sampling for a one-hot ``q``.
- drafts with a distribution ``q_i`` (a draft model): standard speculative rejection sampling:
  accept ``d`` with probability ``min(1, p_i(d) / q_i(d))``, else sample the residual
  ``max(p_i - q_i, 0)`` renormalized; after k accepted drafts the bonus token is sampled from
  ``p_k``. The output follows the target's distribution whatever ``q`` is.

Every position's randomness comes from the row's own key chain, one split per token as the
sampler does; the chain advances by the tokens the row keeps (``Choices.keys``).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from engine.request import SamplingParams
from engine.sampler import SamplerState


@dataclass(frozen=True)
class Choices:
    """Lazy results for a verified chunk of n = k + 1 positions: the target's choice at each
    (``tokens`` [n]); the key chain (``keys`` [n + 1, 2]: the row's key after keeping m tokens is
    ``keys[m]``, None for greedy rows); the model's log-probability of each choice and the top
    alternatives (when the request asked for log-probabilities)."""

    tokens: mx.array
    keys: mx.array | None
    logprobs: mx.array | None
    top_ids: mx.array | None
    top_logprobs: mx.array | None


def target_logprobs(logits: mx.array, params: SamplingParams, state: SamplerState) -> mx.array:
    """[n, vocab] log-probabilities the row samples from at each position: logit bias,
    temperature, then top-k, top-p and min-p (``engine/sampler.py``'s order). Not for greedy."""
    processed = logits.astype(mx.float32)
    if state.bias is not None:
        processed = processed.at[:, state.bias[0]].add(state.bias[1])
    scaled = processed / params.temperature
    filtered = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    if 0 < params.top_k < filtered.shape[-1]:
        filtered = apply_top_k(filtered, params.top_k)
    if params.top_p < 1.0:
        filtered = apply_top_p(filtered, params.top_p)
    if params.min_p > 0.0:
        filtered = apply_min_p(filtered, params.min_p)
    return filtered


def key_chain(key: mx.array, n: int) -> tuple[mx.array, mx.array]:
    """(keys [n + 1, 2], subkeys [n, 2]): the row's key after each of n tokens and the subkey
    each token is sampled with, as n calls of ``engine/sampler.py: sample`` split them."""
    keys, subs = [key], []
    for _ in range(n):
        key, sub = mx.random.split(key)
        keys.append(key)
        subs.append(sub)
    return mx.stack(keys), mx.stack(subs)


def choose(logits: mx.array, drafts: tuple[int, ...], params: SamplingParams, state: SamplerState,
           draft_probs: mx.array | None = None) -> Choices:
    """The target's choice at each of the k + 1 positions of ``logits`` [k + 1, vocab] given the
    k ``drafts`` (``draft_probs`` [k, vocab]: their proposer's distributions, None for one-hot)."""
    logits = logits.astype(mx.float32)
    keys = None
    if params.is_greedy:
        processed = logits if state.bias is None else logits.at[:, state.bias[0]].add(state.bias[1])
        tokens = mx.argmax(processed, axis=-1)
    else:
        keys, subs = key_chain(state.key, logits.shape[0])
        logp = target_logprobs(logits, params, state)
        if draft_probs is None:
            tokens = mx.stack([mx.random.categorical(logp[i], key=subs[i]) for i in range(logp.shape[0])])
        else:
            tokens = rejection_sample(logp, mx.array(drafts, dtype=mx.int32), draft_probs, subs)
    if not params.logprobs:
        return Choices(tokens, keys, None, None, None)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, tokens[:, None].astype(mx.int32), axis=-1)[:, 0]
    top_ids = top_values = None
    if params.top_logprobs > 0:
        k = min(params.top_logprobs, logprobs.shape[-1])
        top_ids = mx.argpartition(-logprobs, kth=k - 1, axis=-1)[:, :k]
        top_values = mx.take_along_axis(logprobs, top_ids, axis=-1)
    return Choices(tokens, keys, chosen, top_ids, top_values)


def rejection_sample(logp: mx.array, drafts: mx.array, draft_probs: mx.array, subs: mx.array) -> mx.array:
    """Standard speculative rejection sampling: [k + 1] choices for target log-probabilities
    ``logp`` [k + 1, vocab], drafts [k] drawn from ``draft_probs`` [k, vocab], subkeys [k + 1, 2]
    (position i's accept draw and residual draw both from ``subs[i]``). ``c_i = d_{i+1}`` where
    accepted, else a residual draw; ``c_k`` is drawn from ``p_k``. ``logp`` may leave out the mass
    that top-k/top-p/min-p filtered (mlx-lm's filters do not renormalize): it is renormalized here,
    since ``p(d) / q(d)`` and ``p - q`` compare probabilities; ``draft_probs`` rows sum to 1."""
    k = drafts.shape[0]
    logp = logp - mx.logsumexp(logp, axis=-1, keepdims=True)
    p = mx.exp(logp[:k])
    q = draft_probs.astype(mx.float32)
    p_d = mx.take_along_axis(p, drafts[:, None], axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, drafts[:, None], axis=-1)[:, 0]
    accept = mx.minimum(p_d / mx.maximum(q_d, 1e-30), 1.0)
    residual = mx.maximum(p - q, 0.0)
    residual_log = mx.where(residual > 0, mx.log(mx.maximum(residual, 1e-38)), -mx.inf)
    draws = []
    for i in range(k):
        u_key, r_key = mx.random.split(subs[i])
        u = mx.random.uniform(key=u_key)
        replacement = mx.random.categorical(residual_log[i], key=r_key)
        draws.append(mx.where(u < accept[i], drafts[i], replacement.astype(mx.int32)))
    draws.append(mx.random.categorical(logp[k], key=subs[k]).astype(mx.int32))
    return mx.stack(draws)
