"""The engine on the real bundled model: interleaved requests, aborts, limits."""

from engine.engine import make_engine
from engine.request import FinishReason, Request, RequestId, SamplingParams
from engine.scheduler import SchedulerConfig

QUESTIONS = ["What does the ls command do?", "What is a decorator in Python?", "How do I create a table?",
             "Hello! Who are you?"]


def chat_ids(loaded, question: str) -> list[int]:
    return list(loaded.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                      add_generation_prompt=True))


def run_all(engine, requests) -> dict:
    for r in requests:
        engine.add_request(r)
    outputs = {r.request_id: [] for r in requests}
    while engine.has_work():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def test_interleaved_greedy_equals_alone(loaded):
    params = SamplingParams(max_tokens=24, temperature=0.0)
    alone = {}
    for i, q in enumerate(QUESTIONS):
        engine = make_engine(loaded)
        r = Request(RequestId(str(i)), chat_ids(loaded, q), params)
        run_all(engine, [r])
        alone[str(i)] = list(r.output_ids)
    # small chunks and budget force prefills to interleave with other rows' decodes
    engine = make_engine(loaded, SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=12, prefill_chunk_size=8))
    together = [Request(RequestId(str(i)), chat_ids(loaded, q), params) for i, q in enumerate(QUESTIONS)]
    outputs = run_all(engine, together)
    for r in together:
        assert r.output_ids == alone[r.request_id]
        assert outputs[r.request_id][-1].num_output_tokens == len(r.output_ids)
    assert engine.runner.rows == {} and engine.requests == {}


def test_abort_frees_the_row(loaded):
    engine = make_engine(loaded)
    r = Request(RequestId("a"), chat_ids(loaded, QUESTIONS[0]), SamplingParams(max_tokens=200, ignore_eos=True))
    engine.add_request(r)
    engine.step()
    engine.step()
    assert "a" in engine.runner.rows and engine.runner.kv_nbytes() > 0
    [final] = engine.abort_request(RequestId("a"))
    assert final.finish_reason is FinishReason.ABORT and final.num_output_tokens == 2
    engine.step()
    assert engine.runner.rows == {} and not engine.has_work() and engine.requests == {}


def test_max_tokens_and_context_end_with_length(loaded):
    engine = make_engine(loaded)
    prompt = [20 + i % 5000 for i in range(loaded.context_length - 3)]
    near_end = Request(RequestId("ctx"), prompt, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    short = Request(RequestId("len"), [20, 21, 22], SamplingParams(max_tokens=5, ignore_eos=True))
    outputs = run_all(engine, [near_end, short])
    assert len(near_end.output_ids) == 3 and outputs["ctx"][-1].finish_reason is FinishReason.LENGTH
    assert len(short.output_ids) == 5 and outputs["len"][-1].finish_reason is FinishReason.LENGTH


def test_kv_config_defaults(loaded):
    from engine.engine import make_layout
    from engine.kv_config import KVConfig

    def widths(kv):
        layout = make_layout(kv, loaded)
        return layout.scheme, layout.key_bits, layout.value_bits

    assert widths(KVConfig()) == ("kvarn", 4, 2)
    assert widths(KVConfig("kvarn", key_bits=3)) == ("kvarn", 3, 2)
    assert widths(KVConfig("kvarn", 8, 8)) == ("kvarn", 8, 8)
    assert widths(KVConfig("affine")) == ("affine", 4, 4)
    assert widths(KVConfig("affine", key_bits=8)) == ("affine", 8, 8)
    assert make_layout(KVConfig("fp16"), loaded).storage_dtype == loaded.compute_dtype
