"""engine/warm_up.py: the workload runs every kind of step once and leaves the engine as it was."""

from __future__ import annotations

import kvarn.pool as pool_mod
from engine.engine import make_engine
from engine.engine_client import EngineConfig
from engine.kv_config import ApcConfig, KVConfig
from engine.request import Request, RequestId, SamplingParams
from engine.scheduler import SchedulerConfig
from engine.warm_up import warm_up
from server.cli import server_config, build_parser

CONFIG = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, prefill_chunk_size=128)


def greedy(engine, prompt: list[int], n: int = 6) -> list[int]:
    request = Request(RequestId(f"g{len(prompt)}-{id(engine)}"), prompt,
                      SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    engine.add_request(request)
    while engine.has_work():
        engine.step()
    return request.output_ids


def test_warm_up_runs_every_kind_of_step_and_leaves_the_engine_as_it_was(loaded, tmp_path, monkeypatch):
    engine = make_engine(loaded, CONFIG, KVConfig("kvarn", 4, 2), ApcConfig(disk_dir=str(tmp_path)))
    plans, commits = [], []
    run = engine.runner.run
    monkeypatch.setattr(engine.runner, "run", lambda plan, requests: (plans.append(plan), run(plan, requests))[1])
    tails = pool_mod.quantize_window_tails
    monkeypatch.setattr("kvarn.decode_graph.quantize_window_tails",  # the pool's one decode step
                        lambda win_k, win_v, slots, layout: (commits.append(slots.shape[0]),
                                                             tails(win_k, win_v, slots, layout))[1])
    before = engine.prefix_cache_counters()
    report = warm_up(engine, rows=2)
    assert report.ran and report.steps == len(report.step_seconds) > 0 and report.seconds > 0
    # several rows commit a tile in one decode step; a continuation chunk runs beside decoding rows
    assert max(commits) == 2
    assert any(p.decodes and any(c.start_idx > 0 for c in p.prefills) for p in plans)
    # nothing is left: no request, no held block, nothing cached, counted or written to disk
    assert not engine.has_work() and not engine.requests
    pool = engine.runner.store.pool
    assert pool.records.num_held == 0 and pool.sinks.num_held == 0
    assert engine.prefix_cache_counters() == before
    engine.close()
    assert not list(tmp_path.rglob("*.blk"))
    # and the engine serves as one that never warmed up
    fresh = make_engine(loaded, CONFIG, KVConfig("kvarn", 4, 2), ApcConfig(enabled=False))
    prompt = list(range(5, 300))
    monkeypatch.undo()
    assert greedy(engine, prompt) == greedy(fresh, prompt)


def test_warm_up_verifies_every_draft_length_and_leaves_the_speculator_as_it_was(loaded):
    """With speculative decoding on, one row, then 2 and 4, verify drafts of each length the
    speculator may choose (KVarN rows inside the decode batch: each verify shape built before
    serving); afterwards the speculator has its own proposer, rule, evidence and counts back."""
    from engine.speculator import SpecConfig

    engine = make_engine(loaded, CONFIG, KVConfig("kvarn", 4, 2), ApcConfig(enabled=False), SpecConfig())
    spec = engine.speculator
    proposer, config = spec.proposer, spec.config
    shapes = []
    logits = engine.runner.graphs.logits
    engine.runner.graphs.logits = lambda tokens, caches, counts=None: (
        shapes.append((len(counts), max(counts))) if counts else None, logits(tokens, caches, counts))[1]
    report = warm_up(engine, rows=2)
    assert report.ran
    assert {T for _, T in shapes} == {1 + n for n in spec.draft_sizes()}  # every verify length
    assert {B for B, _ in shapes} == {1, 2, 4}
    assert spec.proposer is proposer and spec.config is config
    assert spec.counters.verifies == spec.counters.proposed == 0 and not spec.acceptance.rows
    assert not engine.has_work() and engine.runner.store.pool.records.num_held == 0
    engine.runner.graphs.logits = logits
    fresh = make_engine(loaded, CONFIG, KVConfig("kvarn", 4, 2), ApcConfig(enabled=False), SpecConfig())
    prompt = list(range(5, 300))
    assert greedy(engine, prompt) == greedy(fresh, prompt)


def test_warm_up_is_skipped_where_its_requests_do_not_fit(loaded):
    sizer = make_engine(loaded, CONFIG, KVConfig("fp16"), ApcConfig(enabled=False))
    budget = sizer.cost_alone(40, 2) + 1  # a short request fits; the warm-up's longest (chunk + G + 3) does not
    assert sizer.cost_alone(CONFIG.prefill_chunk_size + 131, 2) > budget
    small = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, prefill_chunk_size=128, kv_budget_bytes=budget)
    engine = make_engine(loaded, small, KVConfig("fp16"), ApcConfig(enabled=False))
    report = warm_up(engine)
    assert not report.ran and "KV budget" in report.reason and report.steps == 0
    assert not engine.has_work() and greedy(engine, list(range(3, 40)), 2)


def test_kvarn_serve_warm_up_flag():
    config = lambda *flags: server_config(build_parser().parse_args(["serve", *flags])).engine  # noqa: E731
    assert config().warm_up is None and EngineConfig().warm_up is None  # auto: on where MLX runs on a GPU
    assert config("--warm-up", "on").warm_up is True and config("--warm-up", "off").warm_up is False
