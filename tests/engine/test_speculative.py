"""Speculative decoding through the real engine on the bundled model (engine/speculator.py,
engine/verify.py, engine/acceptance.py): greedy tokens identical with and without speculation
(fp16 and KVarN k4v2; a batch of rows, windows, n > 1 forks, prefix-cache hits, verifies up to
a tile's end and drafts rejected near it; KVarN in bfloat16 compute too), seeded sampling
identical too, logprobs as without speculation; a rejected draft leaves no record and no block;
an abort mid-verify frees the row; rows that must not speculate do not, a row whose drafts keep
failing stops drafting, and adaptive draft lengths give the same tokens."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from engine.engine import make_engine
from engine.kv_config import ApcConfig, KVConfig
from engine.loader import load_model
from engine.proposers import Ask, Draft
from engine.request import FinishReason, Request, RequestId, SamplingParams
from engine.scheduler import SchedulerConfig
from engine.speculator import SpecConfig

CONFIG = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, prefill_chunk_size=128)
NO_APC = ApcConfig(enabled=False)
LAYOUTS = {"fp16": KVConfig("fp16"), "kvarn-k4v2": KVConfig("kvarn", 4, 2)}
MAX_TOKENS = 120


class Replay:
    """A proposer that replays recorded continuations (by prompt): every draft accepted, or with
    ``wrong_after`` each draft's tokens after that many replaced (rejections at every step)."""

    name = "replay"

    def __init__(self, book: dict[tuple[int, ...], list[int]], wrong_after: int | None = None) -> None:
        self.book = book
        self.wrong_after = wrong_after

    def propose(self, asks: Sequence[Ask]) -> dict[RequestId, Draft]:
        out = {}
        for ask in asks:
            full, n = self.book[tuple(ask.request.prompt_ids)], len(ask.request.output_ids)
            tokens = list(full[n: n + ask.k])
            if self.wrong_after is not None:
                tokens = tokens[: self.wrong_after] + [(t + 7) % 8000 + 16 for t in tokens[self.wrong_after:]]
            if tokens:
                out[ask.request.request_id] = Draft(tuple(tokens))
        return out

    def feedback(self, request_id: RequestId, num_accepted: int) -> None:
        pass

    def forget(self, request_id: RequestId) -> None:
        pass


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    """Chat prompts of 20-odd tokens (the sink, then the first tile's end) and one long enough
    that its output passes the second tile's end."""
    tok = loaded.tokenizer
    texts = ["Write a story about a cat who sleeps all day.", "List the days of the week, one per line.",
             "Explain how rain forms. " * 36]
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True) for t in texts]


def generate(engine, prompts, params: SamplingParams | list[SamplingParams]) -> list[Request]:
    """Every prompt as one request, all added at once; run to the end."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    requests = [Request(RequestId(f"r{i}"), list(p), sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    for request in requests:
        engine.add_request(request)
    while engine.has_work():
        engine.step()
    return requests


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def assert_pool_empty(engine) -> None:
    assert engine.runner.rows == {}
    pool = engine.runner.store.pool
    if pool is not None:
        assert pool.records.num_held == 0  # no block leaked by a rejected draft


@pytest.fixture(scope="module")
def baselines(loaded, prompts):
    """Greedy tokens without speculation, per layout."""
    out = {}
    for name, kv in LAYOUTS.items():
        engine = make_engine(loaded, CONFIG, kv, NO_APC)
        out[name] = [r.output_ids for r in generate(engine, prompts, greedy())]
    return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("proposer", ["ngram", "replay", "replay-wrong"])
def test_greedy_tokens_equal_decoding_without_speculation(loaded, prompts, baselines, layout, proposer):
    """Three rows verifying as one batch: ngram drafts, recorded continuations (all accepted,
    verifies up to each tile's last position but one, which decodes alone) and drafts wrong after
    their first token (a rejection at every verify, next to every tile's end too)."""
    engine = make_engine(loaded, CONFIG, LAYOUTS[layout], NO_APC, SpecConfig(adaptive=False))
    if proposer != "ngram":
        book = {tuple(p): out for p, out in zip(prompts, baselines[layout])}
        engine.speculator.proposer = Replay(book, wrong_after=1 if proposer == "replay-wrong" else None)
    got = [r.output_ids for r in generate(engine, prompts, greedy())]
    assert got == baselines[layout]
    counters = engine.speculator.counters
    assert counters.verifies > 0
    # KVarN rows verify inside the planned decode batch (several tokens a row); slot rows in a chunk forward
    assert (engine.runner.graphs.verifies > 0) == (layout == "kvarn-k4v2")
    if proposer == "replay":
        assert counters.accepted == counters.proposed
        assert counters.verifies < 3 * MAX_TOKENS / 3  # ~4-5 tokens a step, not one
    if proposer == "replay-wrong":
        assert 0 < counters.accepted < counters.proposed
    assert_pool_empty(engine)


@pytest.mark.reference_blas
def test_greedy_tokens_equal_in_bfloat16_with_kvarn(prompts):
    """bfloat16 compute, KVarN k4v2: a verifying row attends the same float16 window and records
    as decoding and rounds its attention output to bfloat16 the same way, so its greedy tokens are
    decoding's (drafts wrong after two tokens: a rejection at every verify; the long prompt's row
    commits a tile mid-run). Under MLX's reference BLAS: OpenBLAS sums a product's elements in an
    order that depends on its row count, and a verify step's attention has T positions a query head
    (docs/speculative.md, Exactness)."""
    loaded = load_model(dtype="bfloat16")
    kv, n = LAYOUTS["kvarn-k4v2"], 128
    want = [r.output_ids for r in generate(make_engine(loaded, CONFIG, kv, NO_APC), prompts, greedy(n))]
    engine = make_engine(loaded, CONFIG, kv, NO_APC, SpecConfig(adaptive=False))
    engine.speculator.proposer = Replay({tuple(p): o for p, o in zip(prompts, want)}, wrong_after=2)
    assert [r.output_ids for r in generate(engine, prompts, greedy(n))] == want
    assert engine.runner.graphs.verifies > 0 and 0 < engine.speculator.counters.accepted
    assert_pool_empty(engine)


@pytest.mark.parametrize("records", ["codes", "dequantized"])
def test_kvarn_rows_verify_in_the_decode_batch_where_a_fused_kernel_attends(loaded, prompts, baselines, records,
                                                                             monkeypatch):
    """Where a fused decode kernel attends (one position a row: CUDA, Metal), a step in which rows
    verify drafts is planned without its launch, every row's positions attending through the
    reference path in the same graph: KVarN rows still verify inside the decode batch, with
    decoding's greedy tokens. (On this CPU the kernel's verdict is the reference, so a one-token
    step planned for the kernel falls back to it: the tokens are those of the plain decode step.)
    ``dequantized``: the reference path CUDA takes (records gathered and dequantized, one SDPA
    over every row's positions), against decoding through it."""
    import engine.model_runner as model_runner
    import kvarn.attention as attention
    import kvarn.decode_graph as decode_graph

    want = baselines["kvarn-k4v2"]
    if records == "dequantized":
        monkeypatch.setattr(attention, "reads_codes_directly", lambda: False)
        want = [r.output_ids for r in generate(make_engine(loaded, CONFIG, LAYOUTS["kvarn-k4v2"], NO_APC), prompts,
                                               greedy())]

    planned: list[tuple[int, int]] = []  # (tokens a row, the kernel's splits) of every planned step
    plan_paged = decode_graph.plan_paged

    def spy(*args, **kw):
        step = plan_paged(*args, **kw)
        planned.append((step.static[7], step.static[8]))
        return step

    separate: list[int] = []  # rows verified in a chunk forward of their own
    dispatch_verify = model_runner.dispatch_verify
    monkeypatch.setattr(decode_graph, "fused_attention", lambda: True)
    monkeypatch.setattr(decode_graph, "plan_paged", spy)
    monkeypatch.setattr(model_runner, "dispatch_verify",
                        lambda runner, drafts, *a: separate.extend(drafts) or dispatch_verify(runner, drafts, *a))
    engine = make_engine(loaded, CONFIG, LAYOUTS["kvarn-k4v2"], NO_APC, SpecConfig(adaptive=False))
    engine.speculator.proposer = Replay({tuple(p): o for p, o in zip(prompts, want)}, wrong_after=1)
    assert [r.output_ids for r in generate(engine, prompts, greedy())] == want
    assert engine.runner.graphs.verifies > 0 and separate == []  # every verify rode in the decode batch
    assert {splits > 0 for T, splits in planned if T == 1} == {True}  # one-token steps: the kernel's plan
    assert {splits for T, splits in planned if T > 1} == {0}  # verify steps: no launch planned
    assert_pool_empty(engine)


def test_greedy_equal_with_kvarn_windows(loaded, prompts):
    """KVarN rows with a 256-token window: the long prompt's row evicts records while verifying."""
    kv = KVConfig("kvarn", 4, 2, max_kv_size=256)
    want = [r.output_ids for r in generate(make_engine(loaded, CONFIG, kv, NO_APC), prompts, greedy(80))]
    for wrong_after in (None, 2):
        engine = make_engine(loaded, CONFIG, kv, NO_APC, SpecConfig(adaptive=False))
        engine.speculator.proposer = Replay({tuple(p): o for p, o in zip(prompts, want)}, wrong_after)
        assert [r.output_ids for r in generate(engine, prompts, greedy(80))] == want
        assert engine.speculator.counters.verifies > 0
        assert engine.runner.graphs.verifies == 0  # windowed rows verify in a chunk forward of their own
        assert_pool_empty(engine)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forks_and_prefix_cache_hits_verify_to_the_same_tokens(loaded, prompts, baselines, layout):
    """n = 3 choices of one prompt forked at its end, then the same prompt again restored from the
    prefix cache: every choice's greedy tokens are the ones decoded alone without speculation."""
    engine = make_engine(loaded, CONFIG, LAYOUTS[layout], ApcConfig(), SpecConfig(adaptive=False))
    engine.speculator.proposer = Replay({tuple(p): o for p, o in zip(prompts, baselines[layout])}, wrong_after=2)
    prompt = prompts[2]
    parent = Request(RequestId("p"), list(prompt), greedy())
    forks = tuple(Request(RequestId(f"p-{i}"), list(prompt), greedy(), index=i) for i in (1, 2))
    engine.add_request(parent, forks)
    while engine.has_work():
        engine.step()
    for request in (parent, *forks):
        assert request.output_ids == baselines[layout][2] and request.finish_reason is FinishReason.LENGTH
    again = generate(engine, [prompt], greedy())[0]
    assert again.num_cached_tokens > 0
    assert again.output_ids == baselines[layout][2]
    assert engine.runner.rows == {}


def test_seeded_sampling_and_logprobs_match_decoding_without_speculation(loaded, prompts):
    """Prompt lookup's drafts are one-hot: each position is sampled with the key plain decoding
    uses, so a seeded row's tokens are identical; logprobs (and top alternatives) are the
    model's own at each position, as without speculation."""
    params = [SamplingParams(max_tokens=48, temperature=0.7, seed=11 + i, logprobs=True, top_logprobs=3)
              for i in range(len(prompts))]
    plain = generate(make_engine(loaded, CONFIG, LAYOUTS["fp16"], NO_APC), prompts, params)
    engine = make_engine(loaded, CONFIG, LAYOUTS["fp16"], NO_APC, SpecConfig(adaptive=False))
    engine.speculator.proposer = Replay({tuple(p): r.output_ids for p, r in zip(prompts, plain)}, wrong_after=3)
    spec = generate(engine, prompts, params)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert engine.speculator.counters.accepted > 0
    greedy_lp = greedy(40, logprobs=True, top_logprobs=3)
    outputs = {}
    for arm, spec_config in (("plain", None), ("spec", SpecConfig(adaptive=False))):
        engine = make_engine(loaded, CONFIG, LAYOUTS["kvarn-k4v2"], NO_APC, spec_config)
        if spec_config is not None:
            engine.speculator.proposer = Replay({tuple(prompts[0]): outputs["plain"][0]}, wrong_after=2)
        request = Request(RequestId("lp"), list(prompts[0]), greedy_lp)
        engine.add_request(request)
        entries = []
        while engine.has_work():
            entries += [lp for out in engine.step() for lp in out.logprobs]
        outputs[arm] = (request.output_ids, entries)
    (want_ids, want), (got_ids, got) = outputs["plain"], outputs["spec"]
    assert got_ids == want_ids and [e.token_id for e in got] == [e.token_id for e in want] == want_ids
    np.testing.assert_allclose([e.logprob for e in got], [e.logprob for e in want], atol=2e-3)
    assert [[t for t, _ in e.top] for e in got] == [[t for t, _ in e.top] for e in want]


def test_an_abort_mid_verify_frees_the_row(loaded, prompts, baselines):
    """A step with drafts dispatched, the request aborted before it is read back: the row and its
    blocks are gone, and the collect skips it."""
    engine = make_engine(loaded, CONFIG, LAYOUTS["kvarn-k4v2"], NO_APC, SpecConfig())
    engine.speculator.proposer = Replay({tuple(prompts[2]): baselines["kvarn-k4v2"][2]})
    request = Request(RequestId("a"), list(prompts[2]), greedy())
    engine.add_request(request)
    while len(request.output_ids) < 3:
        engine.step()
    plan = engine.speculator.plan_drafts(engine.scheduler.plan(), engine.requests, engine._verify_room)
    assert plan.drafts
    step = engine.runner.dispatch(plan, engine.requests)
    assert step.verifying
    engine.abort_request(request.request_id)
    result = engine.runner.collect(step)
    assert request.request_id not in result.sampled
    assert request.finish_reason is FinishReason.ABORT
    assert_pool_empty(engine)
    assert engine.update(plan, result) == []
    assert engine.step() == [] and not engine.has_work()  # the next plan reports the freed row, nothing more


def test_rows_that_must_not_speculate_decode_as_usual(loaded, prompts):
    """A grammar-constrained row, one with a frequency penalty and one that opted out get no
    drafts; with more decoding rows than ``max_batch`` nobody speculates."""
    from engine.constraints import ConstraintCompiler, GrammarSpec

    engine = make_engine(loaded, CONFIG, LAYOUTS["fp16"], NO_APC, SpecConfig(max_batch=3))
    always = Replay({tuple(p): [17] * 200 for p in prompts})
    engine.speculator.proposer = always
    constraint = ConstraintCompiler(loaded.tokenizer, loaded.vocab_size).compile(GrammarSpec.regex("[a-z ]{4,40}"))
    params = [greedy(12, constraint=constraint), greedy(12, frequency_penalty=0.5), greedy(12, speculative=False)]
    generate(engine, prompts, params)
    assert engine.speculator.counters.verifies == 0
    wide = generate(engine, prompts[:2] * 2, greedy(12))  # four short prompts: prefilled in one step
    assert engine.speculator.counters.verifies == 0 and engine.speculator.counters.wide_steps > 0
    assert all(len(r.output_ids) == 12 for r in wide)


def test_a_row_whose_drafts_are_rejected_stops_drafting(loaded, prompts):
    """Drafts that are always wrong: the row's evidence soon says a draft does not pay for its
    verify, so most of its steps decode plainly; its state goes with it when it ends."""
    engine = make_engine(loaded, CONFIG, LAYOUTS["fp16"], NO_APC, SpecConfig())
    engine.speculator.proposer = Replay({tuple(prompts[0]): [5] * 200}, wrong_after=0)
    request = generate(engine, prompts[:1], greedy(60))[0]
    counters = engine.speculator.counters
    assert counters.accepted == 0 and 1 <= counters.verifies <= 12
    assert len(request.output_ids) == 60
    assert engine.speculator.acceptance.rows == {}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_adaptive_lookup_drafts_gives_the_same_greedy_tokens(loaded, prompts, baselines, layout):
    """Prompt lookup with adaptive draft lengths (up to 8 tokens, suffixes up to 8): the tokens
    are those decoded without speculation, drafts are cut to the step's sizes, and every row's
    state is freed with the row."""
    engine = make_engine(loaded, CONFIG, LAYOUTS[layout], NO_APC, SpecConfig(num_tokens=8, ngram_max=8))
    lengths = []
    original = engine.speculator.plan_drafts

    def spy(plan, requests, room):
        planned = original(plan, requests, room)
        lengths.extend(len(d) for d in planned.drafts.values())
        return planned

    engine.speculator.plan_drafts = spy
    got = [r.output_ids for r in generate(engine, prompts, greedy())]
    assert got == baselines[layout]
    assert engine.speculator.counters.verifies > 0 and set(lengths) <= {1, 2, 4, 8}
    assert engine.speculator.acceptance.rows == {}
    assert_pool_empty(engine)
