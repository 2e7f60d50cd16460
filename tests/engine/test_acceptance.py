"""The verify's choices (engine/acceptance.py): speculative rejection sampling keeps the target's
distribution whatever the draft's (a chi-square test over many draws), one-hot drafts are
sampled with the key plain decoding uses, greedy choices are the argmax, and the key chain
matches the sampler's splits."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.acceptance import choose, key_chain, rejection_sample
from engine.request import SamplingParams
from engine.sampler import make_sampler_state, sample

V = 6
DRAWS = 6000
# chi-square 0.999 quantiles: 5 degrees of freedom (one position's V outcomes), 35 (a pair's V^2)
CHI2_5, CHI2_35 = 20.52, 66.62


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # nothing drawn where the target has no mass
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("draft", ["close", "far", "one-hot", "close-filtered"])
def test_rejection_sampling_keeps_the_target_distribution_of_two_tokens(draft):
    """k = 2 drafts drawn from q, verified against p: the first kept token follows p_0 and the
    pair (first, second) follows p_0(a) p_1(b | a accepted or not, the target's own next
    distribution), here independent of a by construction, so the pair follows p_0 x p_1.
    ``close-filtered``: the target's log-probabilities come as a filter leaves them (the
    filtered-out mass missing, not renormalized)."""
    rng = np.random.default_rng({"close": 1, "far": 2, "one-hot": 3, "close-filtered": 5}[draft])
    p = rng.dirichlet(np.ones(V), size=3)  # target at positions 0, 1, 2
    p[1, 4] = 0.0  # a token the target never takes at position 1
    p[1] /= p[1].sum()
    if draft.startswith("close"):
        q = 0.7 * p[:2] + 0.3 * rng.dirichlet(np.ones(V), size=2)
    elif draft == "far":
        q = rng.dirichlet(np.ones(V) * 0.3, size=2)
    else:
        q = np.eye(V)[[2, 3]]
    unnormalized = p * (0.8 if draft == "close-filtered" else 1.0)
    logp = mx.array(np.log(np.maximum(unnormalized, 1e-30)).astype(np.float32))
    q_mx = mx.array(q.astype(np.float32))
    pairs = np.zeros((V, V))
    base = mx.random.key(7)
    for n in range(DRAWS):
        drafts = [int(rng.choice(V, p=q[i])) for i in range(2)]
        base, key = mx.random.split(base)
        _, subs = key_chain(key, 3)
        c = rejection_sample(logp, mx.array(drafts, dtype=mx.int32), q_mx, subs).tolist()
        first = c[0]
        second = c[1] if first == drafts[0] else None
        if second is None:  # a rejection ends the step: the next token comes from the target's next step
            second = int(rng.choice(V, p=p[1]))
        pairs[first, second] += 1
    assert chi_square(pairs.sum(axis=1), p[0]) < CHI2_5
    assert chi_square(pairs.ravel(), np.outer(p[0], p[1]).ravel()) < CHI2_35


def test_one_hot_drafts_are_sampled_as_plain_decoding_samples_and_greedy_is_the_argmax():
    rng = np.random.default_rng(4)
    logits = mx.array(rng.standard_normal((4, 50)).astype(np.float32) * 3)
    params = SamplingParams(max_tokens=8, temperature=0.8, top_k=20, top_p=0.9, seed=5, logit_bias=((3, 2.0),))
    state = make_sampler_state(params, 50)
    choices = choose(logits, (1, 2, 3), params, state)
    plain = make_sampler_state(params, 50)
    want = [sample(logits[i], params, plain).token.item() for i in range(4)]
    assert choices.tokens.tolist() == want
    assert np.array_equal(np.array(choices.keys[4]), np.array(plain.key))  # the chain is the sampler's splits
    g = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True, top_logprobs=2)
    got = choose(logits, (0, 0, 0), g, make_sampler_state(g, 50))
    assert got.tokens.tolist() == np.argmax(np.array(logits), axis=-1).tolist() and got.keys is None
    lp = np.array(logits) - np.log(np.exp(np.array(logits, dtype=np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.array(got.logprobs), lp.max(-1), atol=1e-5)
