"""Scheduler unit tests: exact queue state, budgets and chunk boundaries (no MLX)."""

import pytest

from engine.request import FinishReason, Request, RequestId, RequestStatus, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
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
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=20, prefill_chunk_size=64))
    for name in "abc":
        s.add(req(name, 12))
    plan = s.plan()
    assert plan.prefills == (PrefillChunk("a", 0, 12, True), PrefillChunk("b", 0, 8, False))
    assert [r.request_id for r in s.running] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]
    assert plan.num_tokens == 20


def test_max_num_seqs_keeps_requests_waiting():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, prefill_chunk_size=64))
    for name in "abc":
        s.add(req(name, 4))
    plan = s.plan()
    assert [c.request_id for c in plan.prefills] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]
    assert s.waiting[0].status is RequestStatus.WAITING


def test_finish_frees_row_once_and_admits_next():
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, prefill_chunk_size=64))
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
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, prefill_chunk_size=64))
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
