"""The engine on the real bundled model: interleaved requests, aborts, limits."""

from engine.kv_config import KVConfig
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


def test_idle_release_gives_back_what_a_burst_of_rows_grew_the_pool_to(loaded):
    """A burst of rows grows the block pool's arrays by doubling; once the engine is idle
    ``release_idle_memory`` shrinks them past the last id in use (the prefix cache's blocks stay
    until a reset) and MLX's freed buffers go back, on MLX's own counters; the pool then serves
    as before."""
    import mlx.core as mx

    engine = make_engine(loaded)
    pool = engine.runner.store.pool
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    system = "You are a careful assistant for a team that runs Linux servers. " * 30  # past the sink: records

    def prompt(question: str) -> list[int]:
        return list(loaded.tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": question}], add_generation_prompt=True))

    first = Request(RequestId("first"), prompt(QUESTIONS[0]), params)
    run_all(engine, [first])
    engine.reset_prefix_cache()
    engine.release_idle_memory()
    floor = pool.nbytes()  # the pad ids alone
    assert (pool.records.capacity, pool.windows.capacity, pool.sinks.capacity) == (1, 1, 1)
    for i in range(12):  # 24 rows at once (n = 2)
        parent = Request(RequestId(f"b{i}"), prompt(f"{QUESTIONS[i % 4]} ({i})"), params)
        engine.add_request(parent, (Request(RequestId(f"b{i}-1"), list(parent.prompt_ids), params, index=1),))
    while engine.has_work():
        engine.step()
    assert pool.windows.capacity > 24 and pool.records.num_held == pool.windows.num_held == 0
    assert pool.records.num_cached > 0  # the shared system prompt's blocks, kept by the prefix cache
    grown = pool.nbytes()
    mx.eval([])
    before = mx.get_active_memory()
    released = engine.release_idle_memory()
    assert pool.windows.capacity == 1 and pool.records.capacity > 1 and pool.records.num_cached > 0
    engine.reset_prefix_cache()  # the cached blocks become free ids: the next release takes them
    released += engine.release_idle_memory()
    assert released == grown - floor > 0 and pool.nbytes() == floor
    assert mx.get_cache_memory() == 0 and before - mx.get_active_memory() >= 0.95 * released
    again = Request(RequestId("again"), list(first.prompt_ids), params)
    run_all(engine, [again])
    assert again.output_ids == first.output_ids and engine.runner.rows == {}


def test_idle_release_gives_back_the_fp16_slot_buffers_once_no_row_holds_a_slot(loaded):
    """The baselines' slot buffers grow (slots double, T_cap follows the largest reservation) and
    are given back whole by ``release_idle_memory`` once no row holds a slot; rows made after it
    allocate them again and decode as before."""
    import mlx.core as mx

    engine = make_engine(loaded, kv=KVConfig("fp16"))
    stores = [s for s in engine.runner.store.slots if s is not None]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = Request(RequestId("first"), list(loaded.tokenizer.encode(QUESTIONS[0])), params)
    run_all(engine, [first])
    burst = [Request(RequestId(f"b{i}"), list(loaded.tokenizer.encode(f"{QUESTIONS[i % 4]} ({i})")), params)
             for i in range(12)]
    for r in burst:
        engine.add_request(r)
    busy = 0
    while engine.has_work():
        engine.step()
        busy = max(busy, engine.runner.kv_allocated_bytes())
    grown = engine.runner.kv_allocated_bytes()
    assert grown == busy > 0 and all(s.num_slots >= 12 for s in stores) and engine.runner.rows == {}
    mx.eval([])
    before = mx.get_active_memory()
    assert engine.release_idle_memory() == grown
    assert engine.runner.kv_allocated_bytes() == 0 and all(s.num_slots == 4 and s.token_capacity == 0 for s in stores)
    assert mx.get_cache_memory() == 0 and before - mx.get_active_memory() >= 0.95 * grown
    again = Request(RequestId("again"), list(first.prompt_ids), params)
    run_all(engine, [again])
    assert again.output_ids == first.output_ids
