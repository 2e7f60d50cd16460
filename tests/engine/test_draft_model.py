"""The draft-model proposer (engine/draft_model.py) through the real engine, with a copy of the
bundled model keeping 2 of its 8 layers as the draft: greedy tokens identical with and without
speculation (fp16 and KVarN k4v2, rows of different lengths drafted together), a seeded sampled
row reproducible, drafts accepted; the draft's cache holds exactly the row's kept tokens after
every step (rejected drafts trimmed) and its drafts are the draft model's own continuation of
them; a draft model with another vocabulary refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest

from engine.draft_model import DraftProposer, VocabularyMismatch, check_draft_folder, write_layer_subset
from engine.engine import make_engine
from engine.kv_config import ApcConfig, KVConfig
from engine.loader import BUNDLED_MODEL_DIR
from engine.request import Request, RequestId, SamplingParams
from engine.scheduler import SchedulerConfig
from engine.speculator import SpecConfig

CONFIG = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, prefill_chunk_size=128)
NO_APC = ApcConfig(enabled=False)
LAYOUTS = {"fp16": KVConfig("fp16"), "kvarn-k4v2": KVConfig("kvarn", 4, 2)}
DRAFT_LAYERS = (0, 6)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_layer_subset(BUNDLED_MODEL_DIR, tmp_path_factory.mktemp("draft") / "draft-2l", DRAFT_LAYERS)


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    texts = ["Write a story about a cat who sleeps all day.", "List the days of the week, one per line.",
             "Explain how rain forms. " * 12]
    return [loaded.tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
            for t in texts]


def spec(draft_dir: Path) -> SpecConfig:
    return SpecConfig("draft", draft_model=str(draft_dir), adaptive=False)  # every draft verified whole


def generate(engine, prompts, params: SamplingParams) -> list[Request]:
    requests = [Request(RequestId(f"r{i}"), list(p), params) for i, p in enumerate(prompts)]
    for request in requests:
        engine.add_request(request)
    while engine.has_work():
        engine.step()
    return requests


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_the_draft_keeps_two_layers_and_the_tokenizer(loaded, draft_dir):
    config = json.loads((draft_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == len(DRAFT_LAYERS) and config["vocab_size"] == loaded.vocab_size
    check_draft_folder(BUNDLED_MODEL_DIR, draft_dir)  # the same tokenizer: no error


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_tokens_equal_decoding_without_speculation(loaded, prompts, draft_dir, layout):
    """Three rows of different lengths drafting in one batch, then verifying: the target's tokens,
    some drafts accepted, every row's draft state gone with it."""
    want = [r.output_ids for r in generate(make_engine(loaded, CONFIG, LAYOUTS[layout], NO_APC), prompts, greedy(40))]
    engine = make_engine(loaded, CONFIG, LAYOUTS[layout], NO_APC, spec(draft_dir))
    got = [r.output_ids for r in generate(engine, prompts, greedy(40))]
    assert got == want
    counters = engine.speculator.counters
    assert counters.verifies > 0 and 0 < counters.accepted < counters.proposed
    assert engine.speculator.describe()["method"] == "draft"
    assert engine.speculator.proposer.rows == {}
    assert engine.runner.rows == {}


def test_a_long_generation_with_many_rejections_keeps_the_draft_cache_exact(loaded, prompts, draft_dir):
    """After every step the draft's cache holds a prefix of each row's tokens (rejected drafts
    trimmed, nothing else), and at every verify the drafts are what the draft model continues
    that row with, computed from scratch: no drift over a long generation."""
    engine = make_engine(loaded, CONFIG, LAYOUTS["fp16"], NO_APC, spec(draft_dir))
    proposer: DraftProposer = engine.speculator.proposer
    asked = []
    propose = proposer.propose

    def recording(asks):
        drafts = propose(asks)
        asked.extend((a.request.prompt_ids + a.request.output_ids, drafts[a.request.request_id].tokens)
                     for a in asks)
        return drafts

    proposer.propose = recording
    requests = [Request(RequestId(f"r{i}"), list(p), greedy(160)) for i, p in enumerate(prompts[:2])]
    for request in requests:
        engine.add_request(request)
    while engine.has_work():
        engine.step()
        for request in requests:
            row = proposer.rows.get(request.request_id)
            if row is None:
                continue
            tokens = request.prompt_ids + request.output_ids
            assert row.tokens == tokens[: len(row.tokens)] and len(row.tokens) < len(tokens)
            assert all(layer.offset == len(row.tokens) for layer in row.layers)
    baseline = generate(make_engine(loaded, CONFIG, LAYOUTS["fp16"], NO_APC), prompts[:2], greedy(160))
    assert [r.output_ids for r in requests] == [r.output_ids for r in baseline]
    counters = engine.speculator.counters
    assert counters.proposed - counters.accepted > 100  # many rejections, every one trimmed
    model = proposer.draft.model
    for context, drafts in asked[:: max(1, len(asked) // 8)]:
        reference = []
        for _ in drafts:
            reference.append(mx.argmax(model(mx.array([context + reference]))[0, -1]).item())
        assert tuple(reference) == drafts


def test_seeded_sampling_is_reproducible_and_drafts_carry_their_distribution(loaded, prompts, draft_dir):
    """A sampled row drafts from the draft model's distribution (handed to the verify's rejection
    sampling): the same seed gives the same tokens in a fresh engine, another seed others."""
    outputs = {}
    for run, seed in (("a", 7), ("b", 7), ("c", 8)):
        engine = make_engine(loaded, CONFIG, LAYOUTS["kvarn-k4v2"], NO_APC, spec(draft_dir))
        plans = []
        plan_drafts = engine.speculator.plan_drafts

        def recording(*args, plan_drafts=plan_drafts, plans=plans):
            plans.append(plan_drafts(*args))
            return plans[-1]

        engine.speculator.plan_drafts = recording
        params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True)
        outputs[run] = [r.output_ids for r in generate(engine, prompts[:2], params)]
        with_probs = [p for p in plans if p.drafts]
        assert with_probs and all(set(p.draft_probs) == set(p.drafts) for p in with_probs)
        q = next(iter(with_probs[0].draft_probs.values()))
        assert q.shape == (len(next(iter(with_probs[0].drafts.values()))), loaded.vocab_size)
        assert mx.allclose(q.sum(axis=-1), mx.ones(q.shape[0]), atol=1e-4).item()
        assert engine.speculator.counters.accepted > 0
    assert outputs["a"] == outputs["b"] and outputs["a"] != outputs["c"]


def test_a_draft_model_with_another_vocabulary_is_refused(loaded, draft_dir, tmp_path):
    other = tmp_path / "other-vocab"
    shutil.copytree(draft_dir, other)
    spec_file = json.loads((other / "tokenizer.json").read_text())
    vocab = spec_file["model"]["vocab"]
    a, b = (s for s, i in vocab.items() if i in (100, 101))  # two tokens trade ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(spec_file))
    with pytest.raises(VocabularyMismatch, match="draft model's tokenizer differs from the target's"):
        check_draft_folder(BUNDLED_MODEL_DIR, other)
    with pytest.raises(VocabularyMismatch, match="2 token ids differ; id 100 is"):
        make_engine(loaded, CONFIG, LAYOUTS["fp16"], NO_APC, SpecConfig("draft", draft_model=str(other)))
    config = json.loads((draft_dir / "config.json").read_text())
    smaller = tmp_path / "smaller-vocab"
    shutil.copytree(draft_dir, smaller)
    (smaller / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] - 64}))
    with pytest.raises(VocabularyMismatch, match="vocabulary has 8128 entries, the target's 8192"):
        check_draft_folder(BUNDLED_MODEL_DIR, smaller)


@pytest.mark.parametrize("kwargs,message", [
    ({"method": "draft"}, "needs a draft model"),
    ({"method": "ngram", "draft_model": "x"}, "needs the draft method"),
    ({"method": "eagle"}, "unknown speculative method 'eagle' (ngram, draft)"),
])
def test_bad_spec_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpecConfig(**kwargs)
