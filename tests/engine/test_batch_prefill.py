"""Prompt chunks of several rows in one forward (``ModelRunner.batch_prefill``) through the real
engine on the bundled model: which chunks run together, and a mixed workload (ragged prompts
arriving together, n > 1 forks, a prefix-cache hit, ``prompt_logprobs``, ``max_tokens`` 0) gives
every row the logits and tokens it gets with each chunk in its own forward."""

from __future__ import annotations

import numpy as np
import pytest

from engine.engine import make_engine
from engine.kv_config import ApcConfig, KVConfig
from engine.request import Request, RequestId, SamplingParams
from engine.scheduler import SchedulerConfig
from engine.step_types import PrefillChunk
from tests.engine.test_batching import NEAR_TIE, TOLERANCE, LogitRecorder

KV_ARMS = {"fp16": KVConfig("fp16"), "kvarn-k4v2": KVConfig("kvarn", 4, 2)}
CONFIG = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, prefill_chunk_size=128)
# prompt lengths arriving together: several chunks long, one tile, under a tile, a few tokens
LENGTHS = (400, 300, 128, 127, 64, 33, 5, 200)


def chunk(rid: str, n: int) -> PrefillChunk:
    return PrefillChunk(RequestId(rid), 0, n, is_last=True)


def test_chunks_of_similar_lengths_run_together(loaded):
    engine = make_engine(loaded, CONFIG, KV_ARMS["fp16"], ApcConfig(enabled=False))
    runner = engine.runner
    lengths = {"a": 128, "b": 128, "c": 120, "d": 100, "e": 30, "f": 28, "g": 5}
    requests = {RequestId(r): Request(RequestId(r), [1] * n, SamplingParams(max_tokens=1)) for r, n in lengths.items()}
    chunks = tuple(chunk(r, n) for r, n in lengths.items())
    groups = [[c.request_id for c in g] for g in runner._prefill_groups(chunks, requests)]
    # longest first; a group takes the next chunk while its padded positions stay within 1.25x
    # of its tokens: 4 x 128 = 512 <= 1.25 x 476 but 5 x 128 > 1.25 x 506; then 2 x 30 <= 1.25 x 58
    # but 3 x 30 > 1.25 x 63, so 5 runs alone
    assert groups == [["a", "b", "c", "d"], ["e", "f"], ["g"]]
    requests[RequestId("c")].params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    groups = [[c.request_id for c in g] for g in runner._prefill_groups(chunks, requests)]
    assert groups[0] == ["c"] and ["a", "b", "d"] in groups  # a scored chunk runs alone
    runner.batch_prefill = False
    assert [len(g) for g in runner._prefill_groups(chunks, requests)] == [1] * len(chunks)


def workload(loaded) -> tuple[list[Request], list[tuple]]:
    """Requests arriving at step 0 (and the forks of one): their prompts share nothing but the
    first, whose 256-token prefix a warm-up request put in the prefix cache."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(16, loaded.vocab_size, n).tolist() for n in LENGTHS]
    greedy = dict(temperature=0.0, ignore_eos=True)
    params = [SamplingParams(max_tokens=12, **greedy) for _ in LENGTHS]
    params[3] = SamplingParams(max_tokens=6, prompt_logprobs=2, **greedy)
    params[5] = SamplingParams(max_tokens=0, **greedy)
    requests = [Request(RequestId(f"r{i}"), p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    forks = [(requests[2], tuple(Request(RequestId(f"r2-{i}"), prompts[2], params[2], index=i) for i in (1, 2)))]
    return requests, forks


def drain(engine, monkeypatch) -> tuple[dict, dict]:
    """Steps until idle: the logits each row sampled from, and each request's outputs."""
    recorder = LogitRecorder(engine)
    recorder.install(monkeypatch)
    outputs: dict = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        recorder.flush()
    monkeypatch.undo()
    return recorder.logits, outputs


def serve(loaded, arm: str, batch_prefill: bool, monkeypatch):
    engine = make_engine(loaded, CONFIG, KV_ARMS[arm], ApcConfig())
    engine.runner.batch_prefill = batch_prefill
    requests, forks = workload(loaded)
    engine.add_request(Request(RequestId("warm"), requests[0].prompt_ids[:256] + [17, 18], SamplingParams(max_tokens=1)))
    drain(engine, monkeypatch)
    before = (engine.runner.prefill_forwards, engine.runner.prefill_chunks)
    forked = {parent.request_id: children for parent, children in forks}
    for request in requests:
        engine.add_request(request, forked.get(request.request_id, ()))
    logits, outputs = drain(engine, monkeypatch)
    assert requests[0].num_cached_tokens == 256  # the first prompt's prefix was restored
    counts = (engine.runner.prefill_forwards - before[0], engine.runner.prefill_chunks - before[1])
    everyone = [*requests, *(c for _, children in forks for c in children)]
    return logits, outputs, {r.request_id: r for r in everyone}, counts


@pytest.mark.parametrize("arm", list(KV_ARMS))
def test_a_batched_prefill_gives_every_row_its_chunks_alone(loaded, arm, monkeypatch):
    want_logits, want_outputs, want, (forwards, chunks) = serve(loaded, arm, False, monkeypatch)
    assert forwards == chunks >= len(LENGTHS)  # each chunk in its own forward
    got_logits, got_outputs, got, (forwards, chunks) = serve(loaded, arm, True, monkeypatch)
    assert chunks >= len(LENGTHS) and forwards < 0.75 * chunks  # rows' chunks really ran together
    worst = 0.0
    for rid, request in got.items():
        alone = want[rid]
        assert request.finish_reason == alone.finish_reason
        assert len(got_logits.get(rid, [])) == len(want_logits.get(rid, [])) == request.params.max_tokens
        diverged = next((k for k, (a, b) in enumerate(zip(request.output_ids, alone.output_ids)) if a != b), None)
        for step in range(len(alone.output_ids) if diverged is None else diverged + 1):
            worst = max(worst, float(np.abs(got_logits[rid][step] - want_logits[rid][step]).max()))
            np.testing.assert_allclose(got_logits[rid][step], want_logits[rid][step], rtol=0, atol=TOLERANCE[arm])
        if diverged is not None:  # only after a near-tie
            top2 = np.sort(want_logits[rid][diverged])[-2:]
            assert top2[1] - top2[0] < NEAR_TIE, (rid, diverged, top2)
        else:
            assert request.output_ids == alone.output_ids
    [scored] = [o.prompt_logprobs for o in got_outputs["r3"] if o.prompt_logprobs is not None]
    [alone_scored] = [o.prompt_logprobs for o in want_outputs["r3"] if o.prompt_logprobs is not None]
    assert len(scored) == LENGTHS[3]
    assert [e.token_id for e in scored] == [e.token_id for e in alone_scored]
    np.testing.assert_allclose([e.logprob for e in scored[1:]], [e.logprob for e in alone_scored[1:]],
                               rtol=0, atol=TOLERANCE[arm])
    print(f"\n{arm}: max |logit diff| batched vs alone prefill {worst:.2e}")
