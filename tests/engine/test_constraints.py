"""Grammar-constrained decoding in the real engine on the bundled model: compilation and its
refusals, EOS allowed exactly when the grammar accepts, masks on the worker thread, constrained
and unconstrained rows in one batch (the unconstrained rows bit-identical to a batch without
grammars), n > 1, aborts and dead ends freeing everything."""

from __future__ import annotations

import json
import threading

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

import engine.model_runner as model_runner
from engine.constraints import JSON_OPTIONS, MAX_TOKEN_BYTES, ConstraintCompiler, ConstraintError, GrammarSpec, \
    tagged_json_lark
from engine.engine import make_engine
from engine.kv_config import ApcConfig, KVConfig
from engine.request import FinishReason, Request, RequestId, SamplingParams
from engine.sampler import RowGrammars
from engine.scheduler import SchedulerConfig
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

NO_APC = ApcConfig(enabled=False)
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler(loaded) -> ConstraintCompiler:
    return ConstraintCompiler(loaded.tokenizer, loaded.vocab_size)


def allowed_ids(matcher, vocab: int) -> np.ndarray:
    words = allocate_token_bitmask(1, vocab)
    fill_next_token_bitmask(matcher, words, 0)
    return np.flatnonzero(np.unpackbits(words[0].view(np.uint8), bitorder="little")[:vocab])


def chat_prompt(loaded, text: str) -> list[int]:
    return list(loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


def drain(engine, outputs=()) -> dict[str, dict]:
    """Step until idle; every request's text and finish reason (after ``outputs`` already seen)."""
    out: dict[str, dict] = {}
    pending = list(outputs)
    while pending or engine.has_work():
        for o in pending or engine.step():
            entry = out.setdefault(o.request_id, {"text": "", "finish": None})
            entry["text"] += o.text
            entry["finish"] = o.finish_reason or entry["finish"]
        pending = []
    return out


def assert_nothing_held(engine) -> None:
    runner = engine.runner
    assert runner.rows == {} and runner.grammars.matchers == {} and runner.batch.ids == []
    assert engine.requests == {} and runner.kv_nbytes() == 0 and engine.scheduler.reserved_bytes == 0


# --- compilation ---
@pytest.mark.parametrize("schema, words", [
    ({"type": "foo"}, "Invalid type"), ({"$ref": "#/$defs/x"}, "does not exist"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "Unsatisfiable"), ({"not": {"type": "null"}}, "not"),
    ({"type": "string", "pattern": "(unclosed"}, "regex"),
])
def test_bad_schemas_are_refused_at_compile_time(compiler, schema, words):
    with pytest.raises(ConstraintError, match="Invalid JSON schema") as err:
        compiler.compile(GrammarSpec.json_schema(schema))
    assert words in str(err.value)


@pytest.mark.parametrize("spec", [GrammarSpec.lark("start: nothing_defined"), GrammarSpec.regex("(a"),
                                  GrammarSpec.grammar("root ::= (")])
def test_bad_grammars_are_refused_at_compile_time(compiler, spec):
    with pytest.raises(ConstraintError, match="Invalid"):
        compiler.compile(spec)


def test_schema_must_be_an_object():
    for schema in ([1, 2], True, "x"):
        with pytest.raises(ConstraintError, match="JSON object"):
            GrammarSpec.json_schema(schema)


def test_compilations_are_cached_by_spec(compiler):
    first = compiler.compile(GrammarSpec.json_schema(PERSON))
    again = compiler.compile(GrammarSpec.json_schema(dict(PERSON)))
    assert again.matcher is first.matcher and again.compile_s == 0.0
    assert first.new_matcher() is not first.matcher


def test_overlong_tokens_are_never_allowed(loaded, compiler):
    vocab = loaded.tokenizer._tokenizer.get_vocab()
    backend = json.loads(loaded.tokenizer._tokenizer.backend_tokenizer.to_str())["model"]["vocab"]
    overlong = sorted(i for text, i in backend.items() if len(text.encode()) > MAX_TOKEN_BYTES)
    assert len(overlong) == 6 and len(vocab) == loaded.vocab_size  # the bundled model's box-drawing runs
    matcher = compiler.compile(GrammarSpec.regex("(.|\n){0,4000}")).new_matcher()
    allowed = set(allowed_ids(matcher, loaded.vocab_size).tolist())
    assert len(allowed) > 7000 and not allowed & set(overlong)


@pytest.mark.parametrize("schema, text", [
    ({"type": "integer"}, "1234"), (PERSON, '{"name": "Ann", "age": 42}'),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, "[1, 22]"),
])
def test_eos_is_allowed_exactly_when_the_grammar_accepts(loaded, compiler, schema, text):
    matcher = compiler.compile(GrammarSpec.json_schema(schema)).new_matcher()
    eos = sorted(loaded.tokenizer.eos_token_ids)
    for token in [*loaded.tokenizer.encode(text, add_special_tokens=False), eos[0]]:
        allowed = set(allowed_ids(matcher, loaded.vocab_size).tolist())
        assert all((e in allowed) == matcher.is_accepting() for e in eos), (text, token)
        assert token in allowed
        assert matcher.consume_token(token)
    assert matcher.is_stopped() and not matcher.is_error()


def test_tagged_json_lark_takes_hermes_calls_in_json_dumps_form(loaded, compiler):
    call = {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments": PERSON},
            "required": ["name", "arguments"]}
    spec = GrammarSpec.lark(tagged_json_lark(call, "<tool_call>\n", "\n</tool_call>", max_count=2))
    args = {"name": "Ann", "age": 3}
    one = f"<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': args})}\n</tool_call>"
    encode = lambda text: loaded.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    for text, ok in [(one, True), (one + "\n" + one, True), (one + "\n" + one + "\n" + one, False),
                     (one.replace('": ', '":'), False), (one.replace("get_weather", "get_time"), False)]:
        matcher = compiler.compile(spec).new_matcher()
        tokens = encode(text)
        assert (matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()) == ok, text
    assert JSON_OPTIONS["item_separator"] == ", " and JSON_OPTIONS["key_separator"] == ": "


# --- in the engine ---
def test_constrained_rows_give_valid_json_and_free_their_matchers(loaded, compiler):
    engine = make_engine(loaded, SchedulerConfig(max_num_seqs=8), apc=NO_APC)
    constraint = compiler.compile(GrammarSpec.json_schema(PERSON))
    prompt = chat_prompt(loaded, "A person as JSON.")
    for i, t in enumerate((0.0, 1.0, 1.0)):
        engine.add_request(Request(RequestId(f"c{i}"), prompt, SamplingParams(max_tokens=64, temperature=t, seed=i,
                                                                               constraint=constraint)))
    out = drain(engine)
    for i in range(3):
        assert out[f"c{i}"]["finish"] is FinishReason.STOP
        jsonschema.validate(json.loads(out[f"c{i}"]["text"]), PERSON)
    stats = engine.runner.grammars.stats
    assert stats.masks >= 3 * 10 and stats.mask_s > 0
    assert_nothing_held(engine)


def test_masks_are_computed_on_the_worker_thread(loaded, compiler, monkeypatch):
    threads: list[str] = []
    fill = RowGrammars._fill

    def recording(self, rows):
        threads.append(threading.current_thread().name)
        return fill(self, rows)

    monkeypatch.setattr(RowGrammars, "_fill", recording)
    engine = make_engine(loaded, SchedulerConfig(max_num_seqs=4), apc=NO_APC)
    constraint = compiler.compile(GrammarSpec.json_schema(PERSON))
    engine.add_request(Request(RequestId("c"), chat_prompt(loaded, "JSON"), SamplingParams(
        max_tokens=32, temperature=0.0, constraint=constraint)))
    drain(engine)
    assert threads and all(name.startswith("kvarn-masks") for name in threads)
    assert threading.current_thread().name not in threads


# Bit-identical logits across two runs of the same plan: under OpenBLAS on an AMD EPYC the fp16 rows' logits
# differed in their last bits between runs whose plans (prefill groups, decode batches) were the same step for
# step; under MLX's reference BLAS they are identical, so the comparison runs there (tests/openblas_plugin.py).
@pytest.mark.reference_blas
@pytest.mark.parametrize("kv", [KVConfig("fp16"), KVConfig("kvarn", 4, 2)], ids=["fp16", "kvarn-k4v2"])
def test_unconstrained_rows_are_untouched_by_constrained_neighbours(loaded, compiler, kv, monkeypatch):
    """The same batch twice: rows 0-2 free in both runs, rows 3-5 under a grammar in one and free
    in the other (same prompts, same lengths: the batch has the same shape at every step). The
    free rows' logits are bit-identical and so are their tokens; they also match runs alone."""
    recorded: dict[str, list[np.ndarray]] = {}
    original = model_runner.sample

    def recorder(logits, params, state, allowed=None):
        rid = next(rid for rid, row in engine.runner.rows.items() if row.sampler is state)
        recorded.setdefault(rid, []).append(logits)
        return original(logits, params, state, allowed)

    monkeypatch.setattr(model_runner, "sample", recorder)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(16, loaded.vocab_size, n).tolist() for n in (40, 150, 9, 70, 33, 200)]
    letters = compiler.compile(GrammarSpec.regex("[a-z ]{400}"))  # never complete within max_tokens
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = make_engine(loaded, SchedulerConfig(max_num_seqs=8), kv, NO_APC)

    def run(constrained: bool, rows: range) -> dict[str, tuple[list[int], list[np.ndarray]]]:
        recorded.clear()
        requests = [Request(RequestId(f"r{i}"), prompts[i], SamplingParams(
            max_tokens=24, temperature=0.0, ignore_eos=True, constraint=letters) if constrained and i >= 3 else free)
            for i in rows]
        for request in requests:
            engine.add_request(request)
        out = drain(engine)
        assert_nothing_held(engine)
        for request in requests:
            assert out[request.request_id]["finish"] is FinishReason.LENGTH
        return {r.request_id: (list(r.output_ids), [np.array(x) for x in recorded[r.request_id]]) for r in requests}

    mixed, plain = run(True, range(6)), run(False, range(6))
    for i in range(3):
        tokens, logits = mixed[f"r{i}"]
        assert tokens == plain[f"r{i}"][0]
        assert all(np.array_equal(a, b) for a, b in zip(logits, plain[f"r{i}"][1], strict=True))
        assert tokens == run(False, range(i, i + 1))[f"r{i}"][0]  # and alone
    decode = loaded.tokenizer.decode
    for i in range(3, 6):
        text = decode(mixed[f"r{i}"][0])
        assert len(text) >= 24 and set(text) <= set("abcdefghijklmnopqrstuvwxyz "), text
        assert mixed[f"r{i}"][0] != plain[f"r{i}"][0]


def test_n_choices_each_run_their_own_matcher(loaded, compiler):
    engine = make_engine(loaded, SchedulerConfig(max_num_seqs=8), apc=NO_APC)
    constraint = compiler.compile(GrammarSpec.json_schema(PERSON))
    params = SamplingParams(max_tokens=64, temperature=1.0, seed=11, constraint=constraint)
    prompt = chat_prompt(loaded, "Three people as JSON.")
    parent = Request(RequestId("p"), prompt, params)
    forks = tuple(Request(RequestId(f"p-{i}"), prompt, SamplingParams(max_tokens=64, temperature=1.0, seed=11 + i,
                                                                      constraint=constraint), index=i) for i in (1, 2))
    engine.add_request(parent, forks)
    first = engine.step()  # the prompt and every choice's first token
    assert len(engine.runner.grammars.matchers) == 3
    assert len({id(m) for m in engine.runner.grammars.matchers.values()}) == 3
    out = drain(engine, first)
    texts = [out[r]["text"] for r in ("p", "p-1", "p-2")]
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert all(out[r]["finish"] is FinishReason.STOP for r in ("p", "p-1", "p-2"))
    assert_nothing_held(engine)


def test_an_abort_mid_constrained_stream_frees_the_row(loaded, compiler):
    engine = make_engine(loaded, SchedulerConfig(max_num_seqs=8), apc=NO_APC)
    letters = compiler.compile(GrammarSpec.regex("[a-z ]{400}"))
    prompt = chat_prompt(loaded, "Write letters.")
    engine.add_request(Request(RequestId("a"), prompt, SamplingParams(max_tokens=300, temperature=1.0,
                                                                      constraint=letters)))
    engine.add_request(Request(RequestId("b"), prompt, SamplingParams(max_tokens=300, temperature=0.0,
                                                                      ignore_eos=True)))
    for _ in range(6):
        engine.step()
    assert set(engine.runner.grammars.matchers) == {"a"} and engine.runner.kv_nbytes() > 0
    outputs = engine.abort_request(RequestId("a")) + engine.abort_request(RequestId("b"))
    assert [o.finish_reason for o in outputs] == [FinishReason.ABORT, FinishReason.ABORT]
    assert engine.runner.grammars.matchers == {}
    drain(engine)  # the freed rows leave at the next step
    assert_nothing_held(engine)


def test_a_dead_end_ends_the_row_with_grammar_dead_end(loaded):
    """A grammar whose next token lies beyond the model's logits (a tokenizer with more ids than
    the model: here 64 extra): the mask has no allowed token, the row ends without one."""
    engine = make_engine(loaded, SchedulerConfig(max_num_seqs=4), apc=NO_APC)
    wide = ConstraintCompiler(loaded.tokenizer, loaded.vocab_size + 64)
    constraint = wide.compile(GrammarSpec.lark(f'start: "The answer" <[{loaded.vocab_size + 8}]>'))
    request = Request(RequestId("d"), chat_prompt(loaded, "hi"), SamplingParams(max_tokens=50, temperature=0.0,
                                                                                 constraint=constraint))
    engine.add_request(request)
    out = drain(engine)
    assert out["d"] == {"text": "The answer", "finish": FinishReason.GRAMMAR_DEAD_END}
    assert loaded.tokenizer.decode(request.output_ids) == "The answer"
    assert_nothing_held(engine)


def test_the_sampler_picks_only_allowed_tokens(loaded):
    from engine.sampler import make_sampler_state, sample

    logits = mx.array(np.linspace(0, 1, loaded.vocab_size, dtype=np.float32))
    allowed = np.zeros(loaded.vocab_size, dtype=bool)
    allowed[[5, 17]] = True

    def pick(t: float, seed: int, mask: np.ndarray | None) -> int:
        params = SamplingParams(max_tokens=1, temperature=t, seed=seed)
        state = make_sampler_state(params, loaded.vocab_size)
        return sample(logits, params, state, None if mask is None else mx.array(mask)).token.item()

    assert pick(0.0, 0, allowed) == 17 and pick(0.0, 0, None) == loaded.vocab_size - 1
    assert {pick(1.0, seed, allowed) for seed in range(16)} == {5, 17}
