"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``) through the real engine on the
bundled model: every prompt token scored from the prefill's logits, per chunk, for every KV
layout; ``max_tokens`` 0; ``n > 1``; never served from the prefix cache."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.engine import make_engine
from engine.kv_config import ApcConfig, KVConfig
from engine.request import FinishReason, Request, RequestId, SamplingParams
from engine.scheduler import SchedulerConfig
from engine.output import text_pieces, token_bytes_of

CHUNKED = SchedulerConfig(max_num_batched_tokens=256, prefill_chunk_size=128)  # a 300-token prompt: 3 chunks
LAYOUTS = {"fp16": KVConfig("fp16"), "affine-4": KVConfig("affine", 4, 4), "kvarn-k4v2": KVConfig("kvarn", 4, 2)}
# top-1 of a scored position vs the greedy token of the prompt cut there: the same logits but in
# a chunk of another shape (float rounding), which a quantized cache can amplify at a rounding
# boundary (measured max 0 for fp16)
CONSISTENCY_TOL = {"fp16": 1e-4, "affine-4": 2e-2, "kvarn-k4v2": 2e-2}


@pytest.fixture(scope="module")
def prompt(loaded) -> list[int]:
    return np.random.default_rng(3).integers(16, loaded.vocab_size, 300).tolist()


def run(engine, *requests: Request) -> dict[str, list]:
    for request in requests:
        engine.add_request(request)
    outputs: dict[str, list] = {r.request_id: [] for r in requests}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def scored(loaded, prompt, kv: KVConfig, top: int = 2, max_tokens: int = 0, apc: ApcConfig | None = None):
    engine = make_engine(loaded, CHUNKED, kv, apc or ApcConfig(enabled=False))
    request = Request(RequestId("s"), list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                   prompt_logprobs=top, logprobs=True))
    outputs = run(engine, request)["s"]
    [first] = [o for o in outputs if o.prompt_logprobs is not None]
    assert first is outputs[0]  # with the choice's first output, once
    return first.prompt_logprobs, outputs, engine


def test_prompt_scores_equal_mlx_lms_own_forward(loaded, prompt):
    """fp16: each token's logprob is the log-softmax of one whole-prompt mlx-lm forward at the
    position before it (chunks of 128: three prefill steps; equal to float32 rounding of other
    matmul shapes, measured 2.3e-5), the first token None; top-2 sorted."""
    entries, outputs, engine = scored(loaded, prompt, LAYOUTS["fp16"])
    logits = loaded.model(mx.array([prompt]), cache=make_prompt_cache(loaded.model))[0].astype(mx.float32)
    reference = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    assert [e.token_id for e in entries] == prompt and entries[0].logprob is None and entries[0].top == ()
    got = np.array([e.logprob for e in entries[1:]])
    difference = np.abs(got - reference[np.arange(len(prompt) - 1), prompt[1:]])
    assert difference.max() < 1e-4
    for position, entry in enumerate(entries[1:]):
        best = np.argsort(-reference[position])[:2]
        assert [t for t, _ in entry.top] == best.tolist()
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
    table = token_bytes_of(loaded.tokenizer)
    assert [e.text for e in entries] == text_pieces(table, prompt) and [e.raw for e in entries] == \
        [table(t) for t in prompt]
    # max_tokens 0: one output, nothing generated, the row gone
    [final] = outputs
    assert final.finish_reason is FinishReason.LENGTH and final.token_ids == () and final.num_output_tokens == 0
    assert engine.runner.rows == {} and engine.requests == {} and not engine.has_work()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_scored_position_is_what_the_prompt_cut_there_samples(loaded, prompt, layout):
    """Every KV layout: the top alternative at position j - 1 of a scored prompt is the greedy
    token, with its logprob, of the same prompt cut to j tokens (first chunk, chunk ends and
    their neighbours, the last position)."""
    entries, _, _ = scored(loaded, prompt, LAYOUTS[layout], top=1)
    engine = make_engine(loaded, CHUNKED, LAYOUTS[layout], ApcConfig(enabled=False))
    cuts = [1, 2, 127, 128, 129, 256, 299]
    requests = [Request(RequestId(str(j)), prompt[:j], SamplingParams(max_tokens=1, temperature=0.0, logprobs=True,
                                                                      top_logprobs=2, ignore_eos=True))
                for j in cuts]
    outputs = run(engine, *requests)
    for j in cuts:
        [out] = outputs[str(j)]
        [sampled] = out.logprobs
        (best_id, best_lp), = entries[j].top
        gap = sampled.top[0][1] - sampled.top[1][1]
        assert best_id == sampled.token_id or gap < CONSISTENCY_TOL[layout], (j, best_id, sampled)
        if best_id == sampled.token_id:
            assert abs(best_lp - sampled.logprob) < CONSISTENCY_TOL[layout], (j, best_lp, sampled.logprob)


def test_choices_and_generation_after_a_scored_prompt(loaded, prompt):
    """n = 2 with max_tokens 3: both choices get the same prompt entries on their first output
    and then generate as an unscored request does (the scoring changes nothing else)."""
    engine = make_engine(loaded, CHUNKED, KVConfig("fp16"), ApcConfig(enabled=False))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    parent = Request(RequestId("p"), list(prompt), params)
    fork = Request(RequestId("p-1"), list(prompt), params, index=1)
    plain = Request(RequestId("plain"), list(prompt), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    for request, forks in ((parent, (fork,)), (plain, ())):
        engine.add_request(request, forks)
    outputs: dict[str, list] = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    first, second = outputs["p"][0].prompt_logprobs, outputs["p-1"][0].prompt_logprobs
    assert first is not None and first == second and len(first) == len(prompt)
    assert all(o.prompt_logprobs is None for o in outputs["p"][1:] + outputs["p-1"][1:] + outputs["plain"])
    assert all(e.top == () for e in first)  # prompt_logprobs 0: the tokens' own logprobs only
    assert parent.output_ids == fork.output_ids == plain.output_ids


def test_scored_requests_skip_the_prefix_cache_and_feed_it(loaded, prompt):
    """A scored prompt is computed in full even where the cache holds it (a cached prefix has
    no logits), with the same scores as cold, and is no lookup in the stats; the blocks it
    computed serve a later plain request."""
    kv = KVConfig("kvarn", 4, 2)
    engine = make_engine(loaded, CHUNKED, kv)
    run(engine, Request(RequestId("warm"), list(prompt), SamplingParams(max_tokens=1, temperature=0.0)))
    lookups = engine.prefix.cache.stats.lookups
    cold, _, _ = scored(loaded, prompt, kv)
    request = Request(RequestId("s"), list(prompt), SamplingParams(max_tokens=0, prompt_logprobs=2))
    [out] = run(engine, request)["s"]
    assert out.num_cached_tokens == 0 and engine.prefix.cache.stats.lookups == lookups
    assert out.prompt_logprobs == cold
    # a fresh cache: the scored request's blocks are what a plain request then reuses
    engine = make_engine(loaded, CHUNKED, kv)
    run(engine, Request(RequestId("s"), list(prompt), SamplingParams(max_tokens=0, prompt_logprobs=0)))
    [again] = run(engine, Request(RequestId("plain"), list(prompt), SamplingParams(max_tokens=1)))["plain"]
    assert again.num_cached_tokens == len(prompt) - 1  # its whole blocks and the float16 tail cached after them
