"""engine/scheduler.py: the one admission price, exact numbers (no MLX). KVarN rows in the block pool
count a shared block once: a prefix hit's blocks and ``n > 1`` choices' shared prompt are not
priced again, and what running rows hold is counted from the pool."""

from engine.pricing import LayerSpec, Pricing, Reservation
from engine.scheduler import PoolBudget, StaticBudget
from engine.request import Request, RequestId, RequestStatus, SamplingParams
from kvarn.layout import KVLayout

G = 128
LAYOUT = KVLayout.kvarn("k4v2", tile_size=G)
PRICING = Pricing(LAYOUT, (LayerSpec("layout", 2, 128),) * 4, 8, 4096, 512)
B, W = PRICING.block_bytes(), PRICING.window_bytes()


def req(name: str, prompt: int, max_tokens: int, cached: int = 0) -> Request:
    r = Request(RequestId(name), list(range(prompt)), SamplingParams(max_tokens=max_tokens))
    r.num_cached_tokens = r.num_computed_tokens = cached
    return r


def pool_budget(held: int = 0, rows: dict | None = None) -> PoolBudget:
    rows = rows or {}
    return PoolBudget(PRICING, 10**9, lambda: held * B, rows.get)


def test_pricing_splits_a_sequence_into_its_window_and_record_blocks():
    assert B == 4 * 128 * 216 and W == PRICING.sequence_bytes(1)
    for tokens in (1, 127, 128, 129, 255, 256, 1000, 4096):
        assert PRICING.sequence_bytes(tokens) == W + PRICING.records(tokens) * B
    assert [PRICING.records(t) for t in (0, 128, 255, 256, 384)] == [0, 0, 0, 1, 2]


def test_a_miss_costs_its_whole_reservation():
    budget = pool_budget()
    r = req("a", 1000, 200)  # T = 1200: 8 records
    want = PRICING.reservation(1000, 200)
    assert budget.cost(r) == want.total == W + 8 * B + want.transient


def test_a_hit_is_not_priced_again_and_choices_share_their_prompt():
    budget = pool_budget()
    r = req("a", 1000, 200)
    transient = PRICING.transient_bytes(1200)
    # a hit of 5 blocks (the sink and 4 records): the 4 records are pinned, held, counted there
    assert budget.cost(r, 1, hit_tokens=5 * G) == W + (8 - 4) * B + transient
    # n = 3: three windows; the prompt's 6 records once; each choice's 2 later records
    assert budget.cost(r, 3) == 3 * W + (8 + 2 * 2) * B + transient
    assert budget.cost(r, 3) < 3 * PRICING.sequence_bytes(1200) + transient  # the static price


def test_running_rows_hold_their_window_and_the_records_they_may_still_commit():
    rows = {"a": 3, "b": 8}
    budget = pool_budget(held=9, rows=rows)  # 9 blocks held, some shared
    a, b = req("a", 1000, 200), req("b", 1000, 200)
    a.status = b.status = RequestStatus.RUNNING
    a.num_computed_tokens = 600  # still prefilling: its transient too
    b.num_computed_tokens = 1000
    assert budget.holds(a) == W + (8 - 3) * B + PRICING.transient_bytes(1200)
    assert budget.holds(b) == W + 0 * B
    fresh = req("c", 1000, 200, cached=5 * G)  # admitted this step, its row not made yet: its hit
    assert budget.holds(fresh) == W + (8 - 4) * B + PRICING.transient_bytes(1200)
    fork = req("a-1", 1000, 200)  # a choice waiting for its parent's prompt: its own later records
    assert budget.pending(fork) == W + 2 * B
    assert budget.committed([a, b], [fork]) == 9 * B + budget.holds(a) + budget.holds(b) + W + 2 * B


def test_static_budget_prices_each_row_alone():
    budget = StaticBudget(lambda r, n: Reservation(n * 100, 7), 1000)
    r = req("a", 10, 5)
    assert budget.cost(r, 3) == 307 and budget.holds(r) == 107 and budget.pending(r) == 100
    r.num_computed_tokens = 10
    assert budget.holds(r) == 100 and budget.shared() == 0
