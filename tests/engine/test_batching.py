"""Continuous batching through the real engine on the bundled model: parity of every row with
the same request alone (staggered arrivals, ragged lengths, chunked prefill interleaved with
decode), n > 1 forks, capacity pricing equal to measured bytes, admission and cancellation."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import engine.model_runner as model_runner
from engine.engine import RequestTooLarge, make_engine, make_layout, make_pricing
from engine.kv_config import ApcConfig, KVConfig
from engine.request import FinishReason, Request, RequestId, SamplingParams
from engine.scheduler import SchedulerConfig
from kvarn.rows import RowStore, make_batch_cache, make_cache


def cache_nbytes(cache: list) -> int:
    return sum(layer.nbytes for layer in cache)

NO_APC = ApcConfig(enabled=False)

KV_ARMS = {"fp16": KVConfig("fp16"), "kvarn-k4v2": KVConfig("kvarn", 4, 2),
           "affine-4": KVConfig("affine", 4, 4)}
# (prompt length, max_tokens, arrival step): ragged prompts (some under one tile, some several
# chunks long), arrivals while others prefill and decode
ARRIVALS = [(12, 40, 0), (300, 30, 0), (129, 48, 1), (5, 60, 2), (700, 20, 3), (64, 36, 5), (257, 28, 8),
            (40, 50, 13), (1000, 12, 21), (90, 24, 30)]
NEAR_TIE = 1e-3  # a top-2 logit gap under this may legitimately resolve differently
# float tolerance of a row's logits in a batch vs alone (see tests/kvarn/test_batch.py: one GEMM
# over the rows changes float32 summation order; quantized layouts amplify it where a value
# crosses a rounding boundary). Measured max here: fp16 1.8e-5, kvarn k4v2 1.4e-3 (0.011 in
# tests/kvarn/test_batch.py, whose bound this shares).
TOLERANCE = {"fp16": 1e-4, "kvarn-k4v2": 0.05}


class LogitRecorder:
    """Wraps the runner's samplers: the logits each row sampled from, per request, in order."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.by_state: list[tuple[str, mx.array]] = []
        self.logits: dict[str, list[np.ndarray]] = {}

    def __call__(self, logits, params, state, allowed=None):
        rid = next(rid for rid, row in self.engine.runner.rows.items() if row.sampler is state)
        self.by_state.append((rid, logits))
        return self.original(logits, params, state, allowed)

    def batch(self, logits, rows):
        """``sample_greedy_batch``: the decode batch's plain greedy rows, each one's row of logits."""
        ids = self.engine.runner.batch.ids
        self.by_state += [(ids[b], logits[b]) for b in rows]
        return self.original_batch(logits, rows)

    def install(self, monkeypatch) -> None:
        """In place of the runner's ``sample`` and ``sample_greedy_batch``."""
        self.original, self.original_batch = model_runner.sample, model_runner.sample_greedy_batch
        monkeypatch.setattr(model_runner, "sample", self)
        monkeypatch.setattr(model_runner, "sample_greedy_batch", self.batch)

    def flush(self) -> None:
        for rid, logits in self.by_state:
            self.logits.setdefault(rid, []).append(np.array(logits.astype(mx.float32)))
        self.by_state = []


def prompts(loaded) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(16, loaded.vocab_size, n).tolist() for n, _, _ in ARRIVALS]


def run(engine, requests: list[Request], arrivals: list[int], monkeypatch) -> tuple[dict, int]:
    recorder = LogitRecorder(engine)
    recorder.install(monkeypatch)
    step, widest = 0, 0
    pending = sorted(zip(arrivals, requests), key=lambda p: p[0])
    while pending or engine.has_work():
        while pending and pending[0][0] <= step:
            engine.add_request(pending.pop(0)[1])
        engine.step()
        recorder.flush()
        widest = max(widest, len(engine.runner.batch.ids))
        # what the rows hold never exceeds what admission reserved for them
        assert engine.runner.kv_nbytes() <= engine.scheduler.reserved_bytes
        step += 1
    monkeypatch.undo()
    return recorder.logits, widest


@pytest.mark.parametrize("arm", ["fp16", "kvarn-k4v2"])
def test_rows_in_a_batch_match_their_runs_alone(loaded, arm, monkeypatch):
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m, _ in ARRIVALS]
    ids = prompts(loaded)
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=160, prefill_chunk_size=128)
    engine = make_engine(loaded, config, KV_ARMS[arm], NO_APC)  # batch vs alone, nothing cached
    alone = {}
    for i, (prompt, p) in enumerate(zip(ids, params)):
        request = Request(RequestId(f"r{i}"), prompt, p)
        logits, _ = run(engine, [request], [0], monkeypatch)
        alone[request.request_id] = (logits[request.request_id], list(request.output_ids))
    requests = [Request(RequestId(f"r{i}"), prompt, p) for i, (prompt, p) in enumerate(zip(ids, params))]
    logits, widest = run(engine, requests, [a for _, _, a in ARRIVALS], monkeypatch)
    assert widest >= 6  # most rows really decoded together
    ties, worst = [], 0.0
    for request in requests:
        want_logits, want_tokens = alone[request.request_id]
        got_logits = logits[request.request_id]
        assert len(got_logits) == len(want_logits) == request.params.max_tokens
        diverged = next((k for k, (a, b) in enumerate(zip(request.output_ids, want_tokens)) if a != b), None)
        upto = len(want_tokens) if diverged is None else diverged + 1
        for step in range(upto):
            worst = max(worst, float(np.abs(got_logits[step] - want_logits[step]).max()))
            np.testing.assert_allclose(got_logits[step], want_logits[step], rtol=0, atol=TOLERANCE[arm])
        if diverged is not None:  # only after a near-tie, reported
            top2 = np.sort(want_logits[diverged])[-2:]
            ties.append((request.request_id, diverged, float(top2[1] - top2[0])))
            assert top2[1] - top2[0] < NEAR_TIE, (request.request_id, diverged, top2)
    print(f"\n{arm}: max |logit diff| batch vs alone {worst:.2e}; divergences after near-ties: {ties}")


def test_forks_share_the_prompt_and_sample_their_own_choices(loaded):
    engine = make_engine(loaded, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, prefill_chunk_size=128),
                         apc=NO_APC)  # the prompt is prefilled once per request, never restored
    prompt = prompts(loaded)[1]
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    single = Request(RequestId("one"), prompt, greedy)
    engine.add_request(single)
    while engine.has_work():
        engine.step()
    parent = Request(RequestId("p"), prompt, greedy)
    forks = tuple(Request(RequestId(f"p-{i}"), prompt, greedy, index=i) for i in (1, 2))
    engine.add_request(parent, forks)
    plan = engine.scheduler.plan()
    assert [c.forks for c in plan.prefills] == [()]  # first of three chunks: no forks yet
    result = engine.runner.run(plan, engine.requests)
    engine.update(plan, result)
    prefilled_tokens = sum(c.num_tokens for c in plan.prefills)
    while engine.has_work():
        plan = engine.scheduler.plan()
        prefilled_tokens += sum(c.num_tokens for c in plan.prefills)
        engine.update(plan, engine.runner.run(plan, engine.requests))
    assert prefilled_tokens == len(prompt)  # the prompt was prefilled once for three choices
    for request in (parent, *forks):
        assert request.output_ids == single.output_ids and request.finish_reason is FinishReason.LENGTH
    # seeded sampling: each choice is reproducible on its own seed
    sampled = [Request(RequestId(f"s{i}"), prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=40 + i))
               for i in range(3)]
    engine.add_request(sampled[0], tuple(sampled[1:]))
    while engine.has_work():
        engine.step()
    for i, request in enumerate(sampled):
        alone = Request(RequestId(f"alone{i}"), prompt, SamplingParams(max_tokens=12, temperature=1.0, seed=40 + i))
        engine.add_request(alone)
        while engine.has_work():
            engine.step()
        assert alone.output_ids == request.output_ids
    assert sampled[0].output_ids != sampled[1].output_ids
    assert engine.runner.rows == {} and engine.scheduler.reserved_bytes == 0


# --- capacity pricing ---

@pytest.mark.parametrize("arm", list(KV_ARMS))
def test_priced_bytes_equal_measured_bytes_single_and_batched(loaded, arm):
    """A row filled to its reservation holds exactly the priced bytes, alone and as a batch row."""
    layout = make_layout(KV_ARMS[arm], loaded)
    engine = make_engine(loaded, kv=KV_ARMS[arm])  # installs the seam
    pricing = make_pricing(loaded, layout, 512)
    model = loaded.model
    rng = np.random.default_rng(1)
    sizes = [1, 127, 128, 129, 256, 300]
    for tokens in sizes:  # alone: prefill tokens - 1, decode the last one
        cache = make_cache(model, layout, capacity=tokens)
        ids = rng.integers(16, 8000, tokens).tolist()
        if tokens > 1:
            model(mx.array([ids[:-1]]), cache=cache)
        mx.eval(model(mx.array([ids[-1:]]), cache=cache))
        assert cache_nbytes(cache) == pricing.sequence_bytes(tokens), (arm, tokens)
    # batched: rows of different reservations, filled through batched decode steps
    targets = [130, 140, 257]
    rows = []
    store = RowStore(model, layout)  # KVarN rows batch in one pool
    for target in targets:
        cache = store.new_row(target) if layout.scheme == "kvarn" else make_cache(model, layout, capacity=target)
        model(mx.array([rng.integers(16, 8000, 120).tolist()]), cache=cache)
        rows.append(cache)
    live = list(range(len(rows)))
    batch = [make_batch_cache([r[layer] for r in rows]) for layer in range(len(rows[0]))]
    while live:
        mx.eval(model(mx.array([[17]] * len(live)), cache=batch))
        done = [b for b, i in enumerate(live) if rows[i][0].offset == targets[i]]
        if done:
            keep = [b for b in range(len(live)) if b not in done]
            for layer in batch:
                layer.filter(keep)
            live = [live[b] for b in keep]
    assert sum(cache_nbytes(r) for r in rows) == sum(pricing.sequence_bytes(t) for t in targets)
    assert engine.pricing.sequence_bytes(4096) > 0


def test_admission_keeps_reservations_within_the_budget_and_cancel_frees(loaded):
    layout = make_layout(KVConfig(), loaded)
    pricing = make_pricing(loaded, layout, 128)
    one = pricing.reservation(200, 40).total
    budget = 2 * one + one // 2  # room for two requests of this size, not three
    engine = make_engine(loaded, SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, prefill_chunk_size=128,
                                                 kv_budget_bytes=budget), apc=NO_APC)  # the whole budget for rows
    assert engine.kv_budget_bytes == budget
    rng = np.random.default_rng(2)
    requests = [Request(RequestId(f"b{i}"), rng.integers(16, 8000, 200).tolist(),
                        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)) for i in range(5)]
    for request in requests:
        engine.add_request(request)
    most = 0
    engine.step()
    engine.step()
    assert engine.num_running == 2 and engine.num_waiting == 3
    held = engine.runner.kv_nbytes()
    assert 0 < held <= engine.scheduler.reserved_bytes <= budget
    # cancel one running request: its bytes are released at the next step, and a waiting one enters
    [final] = engine.abort_request(requests[0].request_id)
    assert final.finish_reason is FinishReason.ABORT
    assert engine.scheduler.reserved_bytes == pricing.reservation(200, 40).kv
    engine.step()
    assert requests[0].request_id not in engine.runner.rows and engine.num_running == 2
    while engine.has_work():
        engine.step()
        most = max(most, engine.num_running)
        assert engine.scheduler.reserved_bytes <= budget
    # prefilled rows hold only their KV (the transient is released), so more may decode at once
    # than prefill at once, but never more than the budget holds
    kv_only = pricing.reservation(200, 40).kv
    assert 2 <= most <= budget // kv_only
    assert all(r.finish_reason is FinishReason.LENGTH for r in requests[1:])
    assert engine.runner.kv_nbytes() == 0 and engine.scheduler.reserved_bytes == 0
    with pytest.raises(RequestTooLarge):
        engine.add_request(Request(RequestId("huge"), [20] * 200, SamplingParams(max_tokens=3000)))
    assert "huge" not in engine.requests
