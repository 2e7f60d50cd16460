"""An engine's parts share one row store, one budget and one prefix cache, each handed to the
parts that need it when they are made; the budget prices what the pool says rows hold."""

from __future__ import annotations

import mlx.core as mx

from apc.prefix_cache import PENDING
from engine.engine import make_engine
from engine.kv_config import ApcConfig, KVConfig
from engine.pricing import Reservation
from engine.request import FinishReason, Request, RequestId, SamplingParams
from engine.scheduler import PENDING as SCHEDULER_PENDING, PoolBudget, Scheduler, SchedulerConfig, StaticBudget

CONFIG = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, prefill_chunk_size=128,
                         kv_budget_bytes=64 * 2**20)


def request(name: str, prompt: list[int], max_tokens: int = 4) -> Request:
    return Request(RequestId(name), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def test_the_scheduler_and_the_runner_are_made_with_the_prefix_cache(loaded):
    engine = make_engine(loaded, CONFIG, KVConfig("kvarn", 4, 2), ApcConfig())
    prefix, store = engine.prefix, engine.runner.store
    assert engine.scheduler.cache is prefix
    assert engine.runner.restore == prefix.make_row and engine.runner.release == prefix.release
    assert prefix.pool_tier is not None and prefix.pool_tier.pool is store.pool  # one pool: rows and cache
    budget = engine.scheduler.budget
    assert isinstance(budget, PoolBudget) and budget.held_bytes == store.pool.shared_bytes


def test_without_the_cache_nothing_is_handed_over(loaded):
    engine = make_engine(loaded, CONFIG, KVConfig("fp16"), ApcConfig(enabled=False))
    assert engine.prefix is None and engine.scheduler.cache is None
    assert engine.runner.restore is None and engine.runner.release is None
    assert type(engine.scheduler.budget) is StaticBudget


def test_the_budget_prices_what_the_pool_says_rows_hold(loaded):
    """Mid-run, with a prefix shared by two rows: the pool's shared bytes are the records held
    (each once) and the pinned sinks at the pricing's block and sink sizes; the cache's room is
    the budget's free bytes less what it keeps."""
    engine = make_engine(loaded, CONFIG, KVConfig("kvarn", 4, 2), ApcConfig())
    pool, pricing, budget = engine.runner.store.pool, engine.pricing, engine.scheduler.budget
    sink = pricing.window_bytes() // getattr(mx, engine.layout.window_dtype).size
    shared = [7 + i % 50 for i in range(600)]
    first = request("first", shared)
    engine.add_request(first)
    while engine.has_work():
        engine.step()
    engine.add_request(request("a", shared + [1, 2, 3], max_tokens=8))
    engine.add_request(request("b", shared + [4, 5], max_tokens=8))
    seen = 0
    while engine.has_work():
        engine.step()
        if pool.records.num_held:
            seen += 1
            assert pool.shared_bytes() == pool.records.num_held * pricing.block_bytes() + pool.sinks.num_held * sink
            assert budget.shared() == pool.shared_bytes() > 0
            assert engine.scheduler.reserved_bytes <= CONFIG.kv_budget_bytes
            assert engine.scheduler.headroom() == budget.free_bytes() - engine.prefix.cached_bytes()
    assert seen > 0
    assert engine.prefix_cache_stats()["hit_tokens"] > 0  # the two rows shared the first's blocks


def test_the_scheduler_tells_when_rows_wait_to_be_freed():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, prefill_chunk_size=32))
    r = request("r", list(range(10)))
    s.add(r)
    s.plan()
    assert s.running == [r] and not s.has_freed_rows
    s.finish(r, FinishReason.ABORT)
    assert s.has_freed_rows
    assert s.plan().freed == ("r",) and not s.has_freed_rows


def test_the_budget_is_the_ledger_of_running_requests():
    budget = StaticBudget(lambda r, n: Reservation(n * 100, 7), 1000)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, prefill_chunk_size=32,
                                  kv_budget_bytes=1000), budget)
    s.add(request("x", list(range(10))))
    s.plan()
    assert s.running is budget.running and len(budget.running) == 1
    assert budget.reserved() == s.reserved_bytes == 107 and budget.free_bytes() == 893 == s.headroom()
    assert SCHEDULER_PENDING is PENDING  # the disk tier's "still reading" is the cache's own
