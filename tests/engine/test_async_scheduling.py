"""Async scheduling (``SchedulerConfig.async_scheduling``): the engine launches decode step N+1
from step N's tokens before it reads them back. Every request must end exactly as it does with
the ordinary step (same tokens, same finish reasons, the same seeded samples), through arrivals,
prompts interleaved with decode, stops on EOS and stop strings, aborts while a step is in
flight, and the run-ahead must actually happen (counted)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.engine import make_engine
from engine.kv_config import ApcConfig, KVConfig
from engine.model_runner import ModelRunner
from engine.request import FinishReason, Request, RequestId, SamplingParams
from engine.scheduler import SchedulerConfig

ARMS = {"fp16": KVConfig("fp16"), "kvarn-k4v2": KVConfig("kvarn", 4, 2)}
# (prompt length, max_tokens, arrival step, sampling): greedy and seeded rows, ragged prompts, arrivals
# while others decode (each arrival ends the run-ahead for a step)
WORKLOAD = [(12, 40, 0, "greedy"), (300, 30, 0, "seeded"), (129, 48, 2, "greedy"), (5, 60, 9, "seeded"),
            (200, 20, 25, "greedy"), (64, 36, 40, "seeded")]


def _params(kind: str, max_tokens: int, seed: int, **extra) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(max_tokens=max_tokens, temperature=0.0, **extra)
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, top_p=0.95, seed=seed, **extra)


def _engine(loaded, arm: str, async_scheduling: bool, apc: bool = False):
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8 + 256, prefill_chunk_size=256,
                          async_scheduling=async_scheduling)
    return make_engine(loaded, cfg, ARMS[arm], ApcConfig(enabled=apc))


class AheadCounter:
    """Counts the runner's dispatches that took another step's tokens as inputs."""

    def __init__(self, monkeypatch) -> None:
        self.ahead = 0
        original = ModelRunner.dispatch

        def dispatch(runner, plan, requests, after=None):
            self.ahead += after is not None
            return original(runner, plan, requests, after)

        monkeypatch.setattr(ModelRunner, "dispatch", dispatch)


def _drive(engine, workload, prompts, abort_at: dict[int, str] | None = None, extra=None):
    """Run ``workload`` to the end; returns {rid: (tokens, finish, text)} and every output."""
    results: dict[str, list] = {}
    outputs = []
    step = 0
    pending = sorted(enumerate(workload), key=lambda x: x[1][2])
    while pending or engine.has_work():
        while pending and pending[0][1][2] <= step:
            i, (n, max_tokens, _, kind) = pending.pop(0)
            rid = f"r{i}"
            engine.add_request(Request(RequestId(rid), prompts[i], _params(kind, max_tokens, 100 + i, **(extra or {}))))
            results[rid] = [[], None, ""]
        if abort_at and step in abort_at:
            _drive.in_flight_at_abort = engine._ahead is not None
        step_outputs = engine.abort_request(RequestId(abort_at[step])) if abort_at and step in abort_at else []
        step_outputs += engine.step() if engine.has_work() else []
        for out in step_outputs:
            outputs.append(out)
            entry = results[out.request_id]
            entry[0] += list(out.token_ids)
            entry[2] += out.text
            if out.finish_reason is not None:
                assert entry[1] is None, f"{out.request_id} finished twice"
                entry[1] = out.finish_reason
        step += 1
        assert step < 2000, "the engine did not finish"
    return {rid: (tuple(t), f, s) for rid, (t, f, s) in results.items()}, outputs


def _prompts(loaded, workload, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(16, loaded.vocab_size, n).tolist() for n, *_ in workload]


@pytest.mark.parametrize("arm", list(ARMS))
def test_async_scheduling_ends_every_request_as_the_ordinary_step(loaded, arm, monkeypatch):
    prompts = _prompts(loaded, WORKLOAD)
    plain, _ = _drive(_engine(loaded, arm, False), WORKLOAD, prompts)
    counter = AheadCounter(monkeypatch)
    engine = _engine(loaded, arm, True)
    ahead, _ = _drive(engine, WORKLOAD, prompts)
    assert ahead == plain
    assert all(f is not None for _, f, _ in ahead.values())
    assert counter.ahead >= 40, f"only {counter.ahead} steps ran ahead"
    assert engine.runner.kv_nbytes() == 0 and not engine.runner.rows


def test_a_prompts_first_token_is_read_before_the_next_step_is_launched(loaded):
    """The step that runs a prompt's last chunk returns its first token without launching the
    next step first (which would hold the token back); the decode steps after it run ahead."""
    engine = _engine(loaded, "kvarn-k4v2", True)
    engine.add_request(Request(RequestId("r"), _prompts(loaded, [(200, 8, 0, "greedy")])[0], _params("greedy", 8, 0)))
    first = []
    while not first:
        first = [o for o in engine.step() if o.token_ids]
        assert engine._ahead is None, "a step was launched ahead of a prompt chunk's step"
    engine.step()
    assert engine._ahead is not None, "decode steps no longer run ahead"


def test_rows_stopping_on_eos_and_stop_strings_while_a_step_is_in_flight(loaded, monkeypatch):
    """Sampled rows (EOS not ignored) end on EOS or a stop string the step before the engine knew:
    the token the step in flight ran for them is dropped, the others go on unchanged."""
    workload = [(8, 120, 0, "seeded"), (20, 120, 0, "seeded"), (33, 120, 0, "seeded"), (50, 120, 1, "seeded")]
    prompts = _prompts(loaded, workload, seed=3)
    plain, _ = _drive(_engine(loaded, "fp16", False), workload, prompts, extra={"stop": (" the", ".")})
    counter = AheadCounter(monkeypatch)
    ahead, _ = _drive(_engine(loaded, "fp16", True), workload, prompts, extra={"stop": (" the", ".")})
    assert ahead == plain
    reasons = {f for _, f, _ in plain.values()}
    assert FinishReason.STOP in reasons, f"no row stopped early: {plain}"
    assert counter.ahead > 0


@pytest.mark.parametrize("arm", list(ARMS))
def test_abort_while_a_step_is_in_flight(loaded, arm, monkeypatch):
    workload = [(40, 60, 0, "greedy"), (70, 60, 0, "greedy"), (100, 60, 0, "greedy")]
    prompts = _prompts(loaded, workload, seed=5)
    plain, _ = _drive(_engine(loaded, arm, False), workload, prompts, abort_at={20: "r1"})
    counter = AheadCounter(monkeypatch)
    engine = _engine(loaded, arm, True)
    ahead, outputs = _drive(engine, workload, prompts, abort_at={20: "r1"})
    assert ahead["r1"][1] == FinishReason.ABORT
    assert _drive.in_flight_at_abort, "the abort did not meet a step in flight"
    assert sum(o.request_id == "r1" and o.finish_reason is not None for o in outputs) == 1
    for rid in ("r0", "r2"):
        assert ahead[rid] == plain[rid]
    # the aborted row got fewer tokens than it asked for, and no token after its abort
    assert len(ahead["r1"][0]) < 60
    assert counter.ahead > 0
    assert engine.runner.kv_nbytes() == 0


def test_async_scheduling_with_the_prefix_cache(loaded, monkeypatch):
    """A repeated prompt is a prefix hit in both modes and generates the same tokens."""
    workload = [(600, 30, 0, "greedy"), (600, 30, 45, "greedy")]
    prompts = _prompts(loaded, workload[:1], seed=9) * 2
    plain_engine = _engine(loaded, "kvarn-k4v2", False, apc=True)
    plain, _ = _drive(plain_engine, workload, prompts)
    counter = AheadCounter(monkeypatch)
    engine = _engine(loaded, "kvarn-k4v2", True, apc=True)
    ahead, outputs = _drive(engine, workload, prompts)
    assert ahead == plain
    assert ahead["r0"][0] == ahead["r1"][0]
    hit = [o.num_cached_tokens for o in outputs if o.request_id == "r1" and o.finish_reason is not None]
    assert hit and hit[0] > 0
    assert counter.ahead > 0
