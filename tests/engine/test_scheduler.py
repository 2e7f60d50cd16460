"""Scheduler unit tests: exact queue state, budgets and chunk boundaries (no MLX)."""

import pytest

from engine.pricing import Reservation
from engine.request import FinishReason, Request, RequestId, RequestStatus, SamplingParams
from engine.scheduler import PENDING, Scheduler, SchedulerConfig, StaticBudget
from engine.step_types import PrefillChunk, SampledToken, StepResult


def req(name: str, prompt_len: int, max_tokens: int = 8) -> Request:
    return Request(RequestId(name), list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))


def sample_all(plan) -> StepResult:
    ids = [c.request_id for c in plan.prefills if c.is_last] + list(plan.decodes)
    return StepResult(sampled={i: SampledToken(i, 7) for i in ids})


def test_long_prompt_is_chunked_and_decode_rows_go_first():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100, prefill_chunk_size=64))
    a, b = req("a", 10), req("b", 150)
    s.add(a)
    plan = s.plan()
    assert plan.prefills == (PrefillChunk("a", 0, 10, True),) and plan.decodes == ()
    s.update(plan, sample_all(plan))
    assert a.output_ids == [7] and a.num_computed_tokens == 10
    s.add(b)
    plan = s.plan()
    assert plan.decodes == ("a",)
    assert plan.prefills == (PrefillChunk("b", 0, 64, False),)
    s.update(plan, sample_all(plan))
    assert a.num_computed_tokens == 11 and b.num_computed_tokens == 64 and b.output_ids == []
    plan = s.plan()
    assert plan.decodes == ("a",) and plan.prefills == (PrefillChunk("b", 64, 128, False),)
    s.update(plan, sample_all(plan))
    plan = s.plan()
    assert plan.decodes == ("a",) and plan.prefills == (PrefillChunk("b", 128, 150, True),)
    s.update(plan, sample_all(plan))
    assert b.output_ids == [7]
    assert s.plan().decodes == ("a", "b")


def test_token_budget_limits_prefill_and_admission():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=20, prefill_chunk_size=16))
    reqs = [req(name, 12) for name in "abc"]
    for r in reqs:
        s.add(r)
    plan = s.plan()
    # a's whole prompt (12) fits; b's first chunk (12) does not fit in the 8 left: b waits whole
    assert plan.prefills == (PrefillChunk("a", 0, 12, True),) and plan.num_tokens == 12
    assert [r.request_id for r in s.running] == ["a"] and [r.request_id for r in s.waiting] == ["b", "c"]
    s.update(plan, sample_all(plan))
    plan = s.plan()
    assert plan.decodes == ("a",) and plan.prefills == (PrefillChunk("b", 0, 12, True),)
    assert [r.request_id for r in s.waiting] == ["c"]  # max_num_seqs


def test_chunk_boundaries_are_fixed_whatever_else_runs():
    """Chunk i is always [i*C, (i+1)*C): a chunk that does not fit waits, it is never cut."""
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=20, prefill_chunk_size=16))
    decoders = [req(name, 4) for name in "abc"]
    for r in decoders:
        s.add(r)
    plan = s.plan()
    s.update(plan, sample_all(plan))
    long, short = req("long", 40), req("short", 3)
    s.add(long)
    s.add(short)
    bounds = []
    while not long.is_prefill_done:
        plan = s.plan()
        assert plan.decodes == ("a", "b", "c") and plan.num_tokens <= 20
        bounds += [(c.start_idx, c.end_idx) for c in plan.prefills if c.request_id == "long"]
        # 20 - 3 decodes = 17: one 16-token chunk fits, nothing after it (short waits behind long)
        assert [c.request_id for c in plan.prefills] == ["long"] and list(s.waiting) == [short]
        s.update(plan, sample_all(plan))
    assert bounds == [(0, 16), (16, 32), (32, 40)]
    # the config guarantees that one whole chunk always fits beside every decode row
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=19, prefill_chunk_size=16)


def test_max_num_seqs_keeps_requests_waiting():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=80, prefill_chunk_size=64))
    for name in "abc":
        s.add(req(name, 4))
    plan = s.plan()
    assert [c.request_id for c in plan.prefills] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]
    assert s.waiting[0].status is RequestStatus.WAITING


def test_finish_frees_row_once_and_admits_next():
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=80, prefill_chunk_size=64))
    a, b = req("a", 4), req("b", 4)
    s.add(a)
    s.add(b)
    plan = s.plan()
    s.update(plan, sample_all(plan))
    s.finish(a, FinishReason.STOP)
    assert a.status is RequestStatus.FINISHED and a.finish_reason is FinishReason.STOP
    assert s.running == []
    plan = s.plan()
    assert plan.freed == ("a",)
    assert plan.prefills == (PrefillChunk("b", 0, 4, True),)
    assert s.plan().freed == ()


def test_abort_of_waiting_request_frees_nothing():
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=80, prefill_chunk_size=64))
    a, b = req("a", 4), req("b", 4)
    s.add(a)
    s.add(b)
    s.plan()
    s.finish(b, FinishReason.ABORT)
    assert list(s.waiting) == [] and b.finish_reason is FinishReason.ABORT
    assert s.plan().freed == ()


@pytest.mark.parametrize("kwargs", [dict(max_num_seqs=0), dict(prefill_chunk_size=0),
                                    dict(max_num_seqs=8, max_num_batched_tokens=4)])
def test_invalid_config_is_refused(kwargs):
    with pytest.raises(ValueError):
        SchedulerConfig(**kwargs)


# --- admission by capacity ---

def priced(s_budget: int, per_token: int = 10, transient: int = 5, **config) -> Scheduler:
    """A scheduler whose reservation is ``per_token`` bytes per reserved token (times n) plus a
    fixed prefill transient: simple numbers, exact assertions."""
    def price(request: Request, n: int) -> Reservation:
        return Reservation(kv=n * per_token * (request.num_prompt_tokens + request.params.max_tokens),
                           transient=transient)

    cfg = dict(max_num_seqs=8, max_num_batched_tokens=72, prefill_chunk_size=64, kv_budget_bytes=s_budget)
    cfg.update(config)
    return Scheduler(SchedulerConfig(**cfg), StaticBudget(price, s_budget))


def test_admission_stops_at_the_budget_and_keeps_fifo_order():
    # each request: (4 + 8) tokens * 10 B = 120 B kv + 5 B transient = 125 B; budget fits two
    s = priced(250)
    reqs = [req(name, 4) for name in "abc"]
    for r in reqs:
        s.add(r)
    plan = s.plan()
    assert [c.request_id for c in plan.prefills] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"] and s.reserved_bytes == 250
    s.update(plan, sample_all(plan))
    # prefills are done: the transients (5 B each) are released, still no room for c (125 > 10)
    assert s.reserved_bytes == 240 and s.budget.holds(reqs[0]) == 120
    plan = s.plan()
    assert plan.decodes == ("a", "b") and plan.prefills == () and len(s.waiting) == 1
    s.finish(reqs[0], FinishReason.STOP)
    assert s.reserved_bytes == 120
    plan = s.plan()
    assert plan.freed == ("a",) and plan.prefills == (PrefillChunk("c", 0, 4, True),)
    assert s.reserved_bytes == 245


def test_a_head_that_does_not_fit_blocks_smaller_requests_behind_it():
    s = priced(300)
    big, small = req("big", 25, max_tokens=2), req("small", 2, max_tokens=2)  # 275 B and 45 B
    first = req("first", 4)  # 125 B, then 120 B once its prompt is in
    s.add(first)
    plan = s.plan()
    s.update(plan, sample_all(plan))
    s.add(big)
    s.add(small)
    plan = s.plan()
    assert plan.decodes == ("first",) and plan.prefills == ()
    assert [r.request_id for r in s.waiting] == ["big", "small"] and s.reserved_bytes == 120
    assert s.fits_alone(big) and not s.fits_alone(req("huge", 27, max_tokens=3))  # 305 B


def test_no_budget_means_no_byte_limit():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, prefill_chunk_size=8))
    for name in "ab":
        s.add(req(name, 4, max_tokens=10**6))
    assert len(s.plan().prefills) == 2 and s.reserved_bytes == 0


def test_abort_releases_the_reservation_at_once():
    s = priced(1000)
    a = req("a", 100, max_tokens=1)  # (100 + 1) * 10 + 5 = 1015 B: more than the whole budget
    assert not s.fits_alone(a)
    b = req("b", 40)  # (40 + 8) * 10 + 5 = 485
    s.add(b)
    plan = s.plan()
    assert plan.prefills == (PrefillChunk("b", 0, 40, True),) and s.reserved_bytes == 485
    s.finish(b, FinishReason.ABORT)
    assert s.reserved_bytes == 0 and s.running == []
    assert s.plan().freed == ("b",)


# --- n > 1: forks ---

def fork(name: str, parent: Request, index: int) -> Request:
    r = req(name, parent.num_prompt_tokens, parent.params.max_tokens)
    r.fork_of, r.index = parent.request_id, index
    return r


def test_forks_are_priced_with_their_parent_and_become_rows_at_prompt_end():
    s = priced(10_000, max_num_seqs=4, max_num_batched_tokens=20, prefill_chunk_size=16)
    p = req("p", 30)
    f1, f2 = fork("p-1", p, 1), fork("p-2", p, 2)
    s.add(p)
    s.add(f1)
    s.add(f2)
    assert list(s.waiting) == [p] and s.forks == {"p": [f1, f2]}
    plan = s.plan()
    # three choices reserved together: 3 * (30 + 8) * 10 + 5
    assert plan.prefills == (PrefillChunk("p", 0, 16, False),) and s.reserved_bytes == 1145
    s.update(plan, sample_all(plan))
    plan = s.plan()
    assert plan.prefills == (PrefillChunk("p", 16, 30, True, forks=("p-1", "p-2")),)
    s.update(plan, StepResult(sampled={i: SampledToken(i, 7) for i in ("p", "p-1", "p-2")}))
    assert [r.request_id for r in s.running] == ["p", "p-1", "p-2"]
    assert all(r.num_computed_tokens == 30 and r.output_ids == [7] for r in (p, f1, f2))
    assert [s.budget.holds(r) for r in s.running] == [380] * 3 and s.reserved_bytes == 3 * 380 and s.forks == {}
    assert s.plan().decodes == ("p", "p-1", "p-2")


def test_a_fork_that_leaves_before_prompt_end_shrinks_its_parent():
    s = priced(10_000, max_num_seqs=4, max_num_batched_tokens=20, prefill_chunk_size=16)
    p = req("p", 30)
    f1, f2 = fork("p-1", p, 1), fork("p-2", p, 2)
    for r in (p, f1, f2):
        s.add(r)
    plan = s.plan()
    s.update(plan, sample_all(plan))
    s.finish(f1, FinishReason.ABORT)
    assert s.reserved_bytes == 2 * 380 + 5 and f1.is_finished
    plan = s.plan()
    assert plan.prefills[0].forks == ("p-2",) and plan.freed == ()


def test_parent_aborted_before_prompt_end_takes_its_forks():
    s = priced(10_000)
    p = req("p", 30)
    f1 = fork("p-1", p, 1)
    s.add(p)
    s.add(f1)
    orphans = s.finish(p, FinishReason.ABORT)
    assert orphans == [f1] and f1.finish_reason is FinishReason.ABORT
    assert not s.has_work() and s.forks == {} and s.reserved_bytes == 0


def test_a_fork_needs_its_parent_waiting():
    s = priced(10_000)
    with pytest.raises(ValueError):
        s.add(fork("x-1", req("x", 4), 1))


class Hit:
    def __init__(self, tokens: int) -> None:
        self.tokens = tokens


class Cache:
    """Admission hooks with a log: hits by request id, ``PENDING`` answers, bytes kept."""

    def __init__(self, hits: dict, kept: int = 0) -> None:
        self.hits, self.kept, self.log = hits, kept, []

    def lookup(self, request):
        self.log.append(("lookup", request.request_id))
        answer = self.hits.get(request.request_id)
        return answer.pop(0) if isinstance(answer, list) else answer

    def release(self, hit):
        self.log.append(("release", hit.tokens))

    def admit(self, request, hit):
        self.log.append(("admit", request.request_id, hit.tokens if hit is not None else 0))

    def cached_bytes(self):
        return self.kept

    def evict_to(self, target):
        self.log.append(("evict_to", target))
        self.kept = min(self.kept, target)


def test_a_prefix_hit_rides_on_the_requests_first_chunk_even_after_waiting():
    """A request is looked up whenever it heads the queue and could run; a hit it cannot take now
    (its chunk does not fit the step) is released, and the hit it is admitted with is carried by
    the plan's first chunk of that request (the runner rebuilds the row from it)."""
    hit = Hit(128)
    cache = Cache({"b": hit})
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=260, prefill_chunk_size=256), cache=cache)
    a, b = req("a", 250), req("b", 300)
    s.add(a)
    s.add(b)
    plan = s.plan()  # a's chunk (250) leaves 10 tokens: b's chunk [128, 256) does not fit and waits
    assert plan.prefills == (PrefillChunk("a", 0, 250, True),)
    assert cache.log == [("lookup", "a"), ("admit", "a", 0), ("lookup", "b"), ("release", 128)]
    assert b.num_cached_tokens == 0 and b.status == RequestStatus.WAITING
    s.update(plan, sample_all(plan))
    plan = s.plan()
    assert plan.prefills == (PrefillChunk("b", 128, 256, False, restore=hit),)
    assert cache.log[4:] == [("lookup", "b"), ("admit", "b", 128)] and b.num_cached_tokens == 128
    s.update(plan, sample_all(plan))
    plan = s.plan()
    assert plan.prefills == (PrefillChunk("b", 256, 300, True),)  # later chunks carry nothing


def test_a_head_reading_from_disk_waits_and_running_rows_go_on():
    """``PENDING``: the head's prefix is being read from disk: it and everything behind it wait
    (FIFO), decode rows keep running; once the read is in, the hit is taken."""
    hit = Hit(128)
    cache = Cache({"b": [PENDING, PENDING, hit]})
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=600, prefill_chunk_size=256), cache=cache)
    a, b, c = req("a", 10), req("b", 300), req("c", 10)
    s.add(a)
    plan = s.plan()
    s.update(plan, sample_all(plan))
    s.add(b)
    s.add(c)
    for _ in range(2):
        plan = s.plan()
        assert plan.decodes == ("a",) and plan.prefills == () and [r.request_id for r in s.waiting] == ["b", "c"]
        s.update(plan, sample_all(plan))
    plan = s.plan()
    assert plan.prefills == (PrefillChunk("b", 128, 256, False, restore=hit), PrefillChunk("c", 0, 10, True))
    assert a.num_computed_tokens == 12


def test_admission_evicts_from_the_prefix_cache_to_make_room():
    """The cache keeps what running requests leave of the budget; a request that fits only
    without it gets its room (the cache is told to keep at most what is left), and one that
    would not fit even then leaves the cache alone and waits."""
    cache = Cache({}, kept=200)
    s = priced(300)
    s.cache = cache
    first = req("first", 4)  # 125 B
    s.add(first)
    plan = s.plan()
    assert plan.prefills and cache.log[-1] == ("admit", "first", 0) and cache.kept == 175
    assert ("evict_to", 175) in cache.log and s.headroom() == 0
    s.update(plan, sample_all(plan))
    s.add(req("big", 25, max_tokens=2))  # 275 B: never fits beside first (120 B), cache or not
    kept = cache.kept
    plan = s.plan()
    assert plan.prefills == () and cache.kept == kept and cache.log[-1] == ("lookup", "big")


