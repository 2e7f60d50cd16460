"""Sampler: exact effects of penalties, bias and filters on synthetic logits; per-request seeds."""

import mlx.core as mx
import numpy as np
import pytest

from engine.request import SamplingParams
from engine.sampler import batch_tokens, make_sampler_state, plain_greedy, sample, sample_greedy_batch

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


def test_a_batchs_greedy_rows_take_samples_tokens_from_one_argmax():
    """One argmax over a batch's logits gives each plain greedy row ``sample``'s token (ties: the
    first maximum, float16 logits too); rows read in batch order are the batch's own array."""
    logits = mx.array(np.random.default_rng(0).normal(size=(5, VOCAB)).astype(np.float32))
    logits[2, 3] = logits[2, 9] = 50.0  # a tie
    for batch in (logits, logits.astype(mx.float16)):
        params = SamplingParams(max_tokens=1, temperature=0.0)
        want = [sample(batch[b], params, make_sampler_state(params, VOCAB)).token.item() for b in range(5)]
        got = sample_greedy_batch(batch, [0, 1, 2, 3, 4])
        assert [got[b].row_token().item() for b in range(5)] == want and want[2] == 3
        assert batch_tokens([got[b] for b in range(5)]) is got[0].token
        assert batch_tokens([got[b] for b in (1, 0, 2, 3, 4)]).tolist() == [want[1], want[0], *want[2:]]


@pytest.mark.parametrize("params,plain", [
    (SamplingParams(max_tokens=1, temperature=0.0), True),
    (SamplingParams(max_tokens=1, temperature=0.7), False),
    (SamplingParams(max_tokens=1, temperature=0.0, logprobs=True), False),
    (SamplingParams(max_tokens=1, temperature=0.0, logit_bias=((3, 5.0),)), False),
    (SamplingParams(max_tokens=1, temperature=0.0, presence_penalty=0.5), False),
])
def test_only_plain_greedy_rows_are_batched(params, plain):
    assert plain_greedy(params, make_sampler_state(params, VOCAB)) is plain


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
