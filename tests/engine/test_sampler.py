"""Sampler: exact effects of penalties, bias and filters on synthetic logits; per-request seeds."""

import mlx.core as mx
import numpy as np
import pytest

from engine.request import SamplingParams
from engine.sampler import make_sampler_state, sample

VOCAB = 16


def logits_row() -> mx.array:
    return mx.array(np.linspace(0.0, 3.0, VOCAB, dtype=np.float32))


def draw(params: SamplingParams, n: int = 1, logits=None) -> list[int]:
    state = make_sampler_state(params, VOCAB)
    out = []
    for _ in range(n):
        arrays = sample(logits if logits is not None else logits_row(), params, state)
        out.append(arrays.token.item())
    return out


def test_greedy_is_argmax():
    assert draw(SamplingParams(max_tokens=1, temperature=0.0)) == [VOCAB - 1]


def test_logit_bias_forces_a_token():
    params = SamplingParams(max_tokens=1, temperature=0.0, logit_bias=((3, 100.0),))
    assert draw(params) == [3]


def test_frequency_penalty_counts_generated_tokens():
    # 15 starts 0.2 above 14 and loses 0.15 per use: 1.2, 1.05 > 1.0, then 0.9 < 1.0, then 0.9 > 0.85
    logits = mx.array([0.0] * (VOCAB - 2) + [1.0, 1.2])
    params = SamplingParams(max_tokens=4, temperature=0.0, frequency_penalty=0.15)
    assert draw(params, 4, logits) == [15, 15, 14, 15]


def test_presence_penalty_applies_once_per_token():
    logits = mx.array([0.0] * (VOCAB - 2) + [1.0, 1.2])
    # after one use each: 15 -> 0.9, 14 -> 0.7; a second use costs nothing more
    params = SamplingParams(max_tokens=4, temperature=0.0, presence_penalty=0.3)
    assert draw(params, 4, logits) == [15, 14, 15, 15]


def test_top_k_one_is_greedy_even_hot():
    assert set(draw(SamplingParams(max_tokens=1, temperature=2.0, top_k=1, seed=3), 20)) == {VOCAB - 1}


def test_min_p_and_top_p_restrict_support():
    logits = mx.array([0.0] * (VOCAB - 3) + [5.0, 5.0, 20.0])
    assert set(draw(SamplingParams(max_tokens=1, temperature=1.0, min_p=0.01, seed=1), 30, logits)) == {15}
    assert set(draw(SamplingParams(max_tokens=1, temperature=1.0, top_p=0.5, seed=1), 30, logits)) == {15}


def test_seed_reproducible_and_distinct():
    params = SamplingParams(max_tokens=1, temperature=1.0, seed=1234)
    first = draw(params, 40)
    assert draw(params, 40) == first
    other = draw(SamplingParams(max_tokens=1, temperature=1.0, seed=99), 40)
    assert other != first


@pytest.mark.parametrize("k", [1, 3])
def test_logprobs_are_the_models_own(k):
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=k, logit_bias=((0, 50.0),))
    state = make_sampler_state(params, VOCAB)
    arrays = sample(logits_row(), params, state)
    reference = np.log(np.exp(np.array(logits_row())) / np.exp(np.array(logits_row())).sum())
    assert arrays.token.item() == 0  # the bias decides the token ...
    assert arrays.logprob.item() == pytest.approx(reference[0], abs=1e-5)  # ... not the reported logprob
    top = sorted(arrays.top_ids.tolist())
    assert top == sorted(np.argsort(-reference)[:k].tolist())
