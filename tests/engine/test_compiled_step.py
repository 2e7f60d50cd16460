"""The compiled decode step (``engine/model_runner.py``, ``kvarn/decode_graph.py``): a decode
step planned as arrays and replayed from a graph traced once per shape bucket must give exactly
what the step built in Python gives, for fp16 slots and KVarN rows, through ragged rows, rows
committing tiles, windows, prefix-cache hits, ``n > 1`` forks, seeded sampling and grammar rows;
padding rows never change a real row's logits; a bucket's graph is reused (counted)."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

import engine.model_runner as model_runner
from engine.constraints import ConstraintCompiler, GrammarSpec
from engine.engine import make_engine
from engine.kv_config import ApcConfig, KVConfig
from engine.request import Request, RequestId, SamplingParams
from engine.scheduler import SchedulerConfig
import kvarn.rows as rows_module
from kvarn.decode_graph import table_bucket
from kvarn.rows import DecodeBatch, plan_decode

ARMS = {"fp16": KVConfig("fp16"), "kvarn-k4v2": KVConfig("kvarn", 4, 2),
        "kvarn-window": KVConfig("kvarn", 4, 2, max_kv_size=256)}
# (prompt length, max_tokens, arrival step): ragged rows, tiles filling during decode (130 + 120,
# 250 + 60), rows arriving while others decode, and one prompt repeated later (a prefix-cache hit)
WORKLOAD = [(12, 70, 0), (130, 120, 0), (250, 60, 1), (5, 90, 6), (300, 40, 20), ("repeat", 50, 45)]
DIGITS = GrammarSpec.grammar('start: /[0-9]{1,6}/')


def _engine(loaded, arm: str, mode: str, monkeypatch, apc: bool = True, commit_after: int = 0):
    """``mode``: "compiled" (graphs by bucket), "eager" (the same planned step uncompiled) or "host"
    (no plan: the forward through the batch caches, as where a fused kernel attends). Steps that
    commit tiles are compiled after ``commit_after`` uses (0: at once, so the tests cover them)."""
    if mode == "host":
        monkeypatch.setattr(model_runner, "plan_decode", lambda caches, **kw: None)
    else:
        monkeypatch.setattr(model_runner, "plan_decode", plan_decode)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8 + 256, prefill_chunk_size=256,
                          compile_decode=mode == "compiled")
    engine = make_engine(loaded, cfg, ARMS[arm], ApcConfig(enabled=apc))
    engine.runner.graphs.commit_after = commit_after
    engine.runner.graphs.compile_after = 0  # ordinary structures compile at their first use (a GPU's rule)
    return engine


def _run(engine, loaded, grammar=None) -> dict[str, tuple[int, ...]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(16, loaded.vocab_size) for _ in range(n if n != "repeat" else 1)]
               for n, _, _ in WORKLOAD]
    prompts[-1] = list(prompts[1])  # the repeated prompt
    outputs: dict[str, list[int]] = {}
    pending = sorted(enumerate(WORKLOAD), key=lambda x: x[1][2])
    step = 0
    while pending or engine.has_work():
        while pending and pending[0][1][2] <= step:
            i, (_, max_tokens, _) = pending.pop(0)
            seeded = i % 2 == 1
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8 if seeded else 0.0,
                                    seed=40 + i if seeded else None,
                                    constraint=grammar if (grammar is not None and i == 3) else None)
            request = Request(RequestId(f"r{i}"), prompts[i], params)
            forks = (Request(RequestId(f"r{i}-1"), list(prompts[i]), params, index=1),) if i == 0 else ()
            engine.add_request(request, forks)
            outputs[f"r{i}"] = []
            for fork in forks:
                outputs[fork.request_id] = []
        for out in engine.step() if engine.has_work() else []:
            outputs[out.request_id] += list(out.token_ids)
        step += 1
        assert step < 2000, "the engine did not finish"
    return {k: tuple(v) for k, v in outputs.items()}


@pytest.mark.parametrize("arm", sorted(ARMS))
def test_compiled_eager_and_host_steps_give_the_same_tokens(loaded, arm, monkeypatch):
    compiler = ConstraintCompiler(loaded.tokenizer, loaded.vocab_size)
    grammar = compiler.compile(DIGITS)
    results, engines = {}, {}
    for mode in ("host", "eager", "compiled"):
        engines[mode] = engine = _engine(loaded, arm, mode, monkeypatch)
        results[mode] = _run(engine, loaded, grammar)
        assert engine.runner.rows == {} and engine.runner.batch.ids == []
    assert results["compiled"] == results["host"]
    assert results["eager"] == results["host"]
    assert all(results["host"].values())
    hit = engines["compiled"].scheduler  # the repeated prompt was served from the prefix cache
    graphs = engines["compiled"].runner.graphs
    assert graphs.steps > 100 and graphs.eager == 0
    assert graphs.traces < graphs.steps / 4  # graphs are replayed, not rebuilt every step
    assert engines["eager"].runner.graphs.eager == engines["eager"].runner.graphs.steps > 100
    assert engines["host"].runner.graphs.steps == 0
    del hit


@pytest.mark.parametrize("arm", ["fp16", "kvarn-k4v2"])
def test_greedy_rows_of_the_decode_batch_sample_from_one_argmax(loaded, arm, monkeypatch):
    """The decode batch's plain greedy rows take their tokens from one argmax over the batch (one
    array read back once), the others through ``sample``; tokens as with every row sampled alone."""
    batched = _run(_engine(loaded, arm, "compiled", monkeypatch), loaded)
    shared = []
    real = model_runner.ModelRunner.dispatch

    def dispatch(self, plan, requests, after=None):  # noqa: ANN001, ANN202
        step = real(self, plan, requests, after)
        tokens = {id(a.token) for a in step.pending.values() if a.index is not None}
        shared.append((len(plan.decodes), len(tokens), sum(a.index is not None for a in step.pending.values())))
        return step

    monkeypatch.setattr(model_runner.ModelRunner, "dispatch", dispatch)
    assert _run(_engine(loaded, arm, "compiled", monkeypatch), loaded) == batched
    assert max(greedy for _, _, greedy in shared) >= 3  # r0, its fork and r2 decode together
    assert all(arrays <= 1 for _, arrays, _ in shared)  # one batch argmax a step at most
    monkeypatch.setattr(model_runner, "plain_greedy", lambda params, state: False)
    assert _run(_engine(loaded, arm, "compiled", monkeypatch), loaded) == batched


def test_a_repeated_prompt_is_a_prefix_hit_on_the_compiled_path(loaded, monkeypatch):
    engine = _engine(loaded, "kvarn-k4v2", "compiled", monkeypatch)
    prompt = list(range(100, 400))
    tokens = []
    for k in range(2):
        request = Request(RequestId(f"p{k}"), prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
        engine.add_request(request)
        while engine.has_work():
            engine.step()
        tokens.append(request.output_ids)
    assert request.num_cached_tokens == len(prompt) - 1
    assert tokens[0] == tokens[1] and engine.runner.graphs.steps >= 38


def _decode_batch(loaded, arm: str, monkeypatch, lengths: list[int]):
    """An engine whose rows of ``lengths`` prompt tokens have all reached decode (one step in)."""
    engine = _engine(loaded, arm, "compiled", monkeypatch, apc=False)
    for i, n in enumerate(lengths):
        engine.add_request(Request(RequestId(f"b{i}"), list(range(20, 20 + n)),
                                   SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)))
    while len(engine.runner.batch.ids) < len(lengths):
        engine.step()
    return engine


@pytest.mark.parametrize("arm", ["fp16", pytest.param("kvarn-k4v2", marks=pytest.mark.reference_blas)])
def test_padding_rows_never_change_a_real_rows_logits(loaded, arm, monkeypatch):
    """Three rows padded to a bucket of four against the same step unpadded, from the same state.
    KVarN under the reference BLAS (tests/openblas_plugin.py): OpenBLAS sums a 4-row product in
    another order than a 3-row one on some processors (2.5e-4 apart in these logits on an AMD
    EPYC, with the same window width), which says nothing about padding."""
    engine = _decode_batch(loaded, arm, monkeypatch, [40, 140, 260])
    runner = engine.runner
    tokens = mx.array([[7], [8], [9]], dtype=mx.int32)
    snapshot = [row.cache for row in runner.rows.values()]
    assert len(snapshot) == 3
    results = []
    for pad in (True, False):
        forks = [runner.store.fork(c) for c in snapshot]  # the same history, fresh rows each time
        rows = {f"f{k}": f for k, f in enumerate(forks)}
        batch = DecodeBatch()
        batch.sync(tuple(rows), rows)
        plan = plan_decode(batch.layers, pad=pad)
        assert plan is not None and plan.rows == 3 and plan.padded == (4 if pad else 3)
        toks = mx.concatenate([tokens, mx.zeros((plan.padded - 3, 1), mx.int32)])
        out = runner.graphs._step(plan.build, plan.static)(toks, plan.inputs, plan.state)
        plan.finish(list(out[1:]))
        results.append(np.array(out[0][:3].astype(mx.float32)))
        for f in forks:
            runner.store.release(f)
    np.testing.assert_allclose(results[0], results[1], rtol=1e-4, atol=1e-4)
    assert (results[0].argmax(-1) == results[1].argmax(-1)).all()


def test_commit_structures_compile_once_they_recur(loaded, monkeypatch):
    """One row crossing tile boundaries, its commits through the pure-MLX quantizer (the verdict
    pinned: on the CPU the C++ quantizer commits otherwise): its commit steps run uncompiled until a
    structure has come back ``commit_after`` times; ordinary steps are compiled from their first use."""
    monkeypatch.setattr(model_runner.KERNELS, "decided_commit_path", lambda: "reference")
    counts = {}
    for after in (0, 1000):
        engine = _engine(loaded, "kvarn-k4v2", "compiled", monkeypatch, apc=False, commit_after=after)
        request = Request(RequestId("c"), list(range(20, 140)), SamplingParams(max_tokens=300, temperature=0.0,
                                                                            ignore_eos=True))
        engine.add_request(request)
        while engine.has_work():
            engine.step()
        graphs = engine.runner.graphs
        counts[after] = (graphs.eager, graphs.steps, tuple(request.output_ids))
    assert counts[0][0] == 0 and counts[1000][0] == 2  # tails filled at 256 and 384 tokens (the first G: the sink)
    assert counts[0][2] == counts[1000][2]


@pytest.mark.parametrize("verdict", ["cuda-fused", "cpu-native"])
def test_commit_structures_compile_at_once_where_a_fused_kernel_commits(loaded, monkeypatch, verdict):
    """Where the commit's verdict is a kernel (a GPU's fused one, the CPU's C++ quantizer: one
    operation a layer, nothing slow to trace), a commit step compiles at its first use whatever
    ``commit_after`` says."""
    monkeypatch.setattr(model_runner.KERNELS, "decided_commit_path", lambda: verdict)
    engine = _engine(loaded, "kvarn-k4v2", "compiled", monkeypatch, apc=False, commit_after=1000)
    request = Request(RequestId("c"), list(range(20, 140)), SamplingParams(max_tokens=300, temperature=0.0,
                                                                        ignore_eos=True))
    engine.add_request(request)
    while engine.has_work():
        engine.step()
    assert engine.runner.graphs.eager == 0 and engine.runner.graphs.steps >= 299


def test_a_step_that_commits_no_tile_leaves_the_records_as_they_were(loaded, monkeypatch):
    """A planned KVarN step hands back only what it wrote: its windows every step, a layer's record
    arrays only in the steps in which a row's tail fills (the records the pool holds are the very
    arrays of the last commit until the next one)."""
    engine = _engine(loaded, "kvarn-k4v2", "compiled", monkeypatch, apc=False)
    request = Request(RequestId("c"), list(range(20, 140)), SamplingParams(max_tokens=160, temperature=0.0,
                                                                        ignore_eos=True))
    engine.add_request(request)
    engine.step()  # the prompt
    pool = engine.runner.store.pool
    changed = []
    while engine.has_work():
        before = [(a.win_k, dict(a.records)) for a in pool.layers]
        engine.step()
        windows = [a.win_k is not k for a, (k, _) in zip(pool.layers, before)]
        records = [any(a.records[name] is not r[name] for name in r) for a, (_, r) in zip(pool.layers, before)]
        assert all(windows) or not engine.has_work()
        assert len(set(records)) == 1  # every layer alike
        changed.append(records[0])
    # 120 prompt tokens, then decode: the tail (tokens 128 ..) fills at 256 tokens, after the 136th decode token
    assert changed.count(True) == 1 and changed.index(True) == 256 - 120 - 1


def test_table_buckets_grow_by_about_a_quarter():
    widths = [table_bucket(n) for n in range(0, 200)]
    assert widths[:7] == [0, 1, 2, 3, 4, 5, 6]
    assert all(w >= n for n, w in enumerate(widths))
    assert all(w <= 1.25 * n + 1 for n, w in enumerate(widths) if n > 6)
    assert len(set(widths)) < 30  # few distinct graphs for a whole context


def test_graphs_are_bounded(loaded, monkeypatch):
    engine = _engine(loaded, "fp16", "compiled", monkeypatch, apc=False)
    graphs = engine.runner.graphs
    graphs.capacity = 2
    for i, n in enumerate([5, 300, 700]):  # three token buckets of the slots
        engine.add_request(Request(RequestId(f"g{i}"), list(range(30, 30 + n)),
                                   SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)))
        while engine.has_work():
            engine.step()
    assert len(graphs) <= 2 and graphs.traces >= 3


class _Layer:
    """A batch cache that only keeps its rows' order (what ``DecodeBatch`` asks of one)."""

    def __init__(self, rows):
        self.rows = list(rows)

    def filter(self, keep):
        self.rows = [self.rows[i] for i in keep]

    def extend(self, rows):
        self.rows += list(rows)


def test_a_row_keeps_its_place_in_the_decode_batch(monkeypatch):
    """A row that leaves leaves a hole: a joining row takes it, else the batch's last row moves
    into it; nobody else moves (their storage stays where the step reads it)."""
    monkeypatch.setattr(rows_module, "make_batch_cache", _Layer)
    rows = {i: [f"{i}/0", f"{i}/1"] for i in "abcdefgh"}
    batch = DecodeBatch()
    batch.sync(tuple("abcd"), rows)
    steps = [("acde", "aecd"),  # b's place goes to e
             ("ecd", "dec"),  # a leaves and nobody joins: the last row, d, takes its place
             ("dcfg", "dfcg"),  # e's place to f, g at the end
             ("dg", "dg"),  # two holes, the last row fills the first
             ("dgh", "dgh"),
             ("", "")]
    for wanted, order in steps:
        batch.sync(tuple(wanted), rows)
        assert batch.ids == list(order)
        for l, layer in enumerate(batch.layers):
            assert layer.rows == [f"{i}/{l}" for i in order]


@pytest.mark.parametrize("arm", ["fp16", "kvarn-k4v2"])
def test_rows_coming_and_going_keep_the_batchs_storage_in_place(loaded, arm, monkeypatch):
    """Rows of a decode batch end at different steps while new ones arrive: the batch's windows
    (KVarN) or slots (fp16) stay at one place, so the step's structure changes only with its
    buckets, and every structure is traced once."""
    engine = _engine(loaded, arm, "compiled", monkeypatch, apc=False)
    starts = []
    real = model_runner.plan_decode

    def plan(caches, **kw):
        p = real(caches, **kw)
        if p is not None:
            starts.append(p.static[6] if p.static[0] == "paged" else p.static[2])
        return p

    monkeypatch.setattr(model_runner, "plan_decode", plan)
    rng = random.Random(5)
    for i in range(16):  # 6 at first, then one more whenever one ends
        engine.add_request(Request(RequestId(f"w{i}"), [rng.randrange(16, 8000) for _ in range(rng.randrange(4, 40))],
                                   SamplingParams(max_tokens=rng.randrange(5, 40), temperature=0.0, ignore_eos=True)))
        while len(engine.runner.rows) + len(engine.scheduler.waiting) >= 6 and engine.has_work():
            engine.step()
    while engine.has_work():
        engine.step()
    graphs = engine.runner.graphs
    assert len(starts) == graphs.steps > 60
    assert len(set(starts)) == 1, sorted(set(starts))
    assert graphs.traces == len(graphs._uses) <= 8  # each structure traced once: row buckets only


@pytest.mark.parametrize("arm", ["fp16", "kvarn-k4v2"])
def test_a_new_wave_of_requests_runs_the_graphs_the_last_one_traced(loaded, arm, monkeypatch):
    """Waves of 6 requests added at once, new prompts of the same lengths each wave, different
    from each other (their chunks are prefilled longest first): each row's storage is taken in
    the order the rows join the decode batch, and the batch's storage always starts at the same
    place, so the second and third waves trace nothing new and no KVarN window is moved when a
    wave starts decoding."""
    import kvarn.decode_graph as decode_graph

    engine = _engine(loaded, arm, "compiled", monkeypatch, apc=False)
    moved: list[int] = []
    place = decode_graph.place_windows

    def spy(rows):
        before = [r.slot for r in rows]
        place(rows)
        moved.append(sum(a != r.slot for a, r in zip(before, rows)))

    monkeypatch.setattr(decode_graph, "place_windows", spy)
    rng = random.Random(9)
    traces = []
    for wave in range(3):
        first = len(moved)
        for i, n in enumerate((9, 57, 4, 33, 21, 46)):
            engine.add_request(Request(RequestId(f"{wave}-{i}"), [rng.randrange(16, 8000) for _ in range(n)],
                                       SamplingParams(max_tokens=20 + 3 * i, temperature=0.0, ignore_eos=True)))
        while engine.has_work():
            engine.step()
        traces.append(engine.runner.graphs.traces)
        if arm == "kvarn-k4v2":
            assert moved[first] == 0  # the wave's first decode step: every row already in place
    assert traces[0] > 0 and traces[2] == traces[1] == traces[0]
