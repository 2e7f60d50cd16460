"""The scheduler: pure Python, never touches tensors.

Each step it plans decode-first: every running row whose prompt is done decodes one token;
the rest of the token budget goes to prompt chunks, first of rows already admitted, then of
newly admitted waiting requests (FIFO). A long prompt therefore never stalls running streams
for more than one chunk.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from engine.request import FinishReason, Request, RequestId, RequestStatus
from engine.step_types import PrefillChunk, StepPlan, StepResult


@dataclass(frozen=True)
class SchedulerConfig:
    """``max_num_seqs`` rows at once; ``max_num_batched_tokens`` tokens per step (decode rows
    count one each); prompt chunks of at most ``prefill_chunk_size`` tokens."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    prefill_chunk_size: int = 512

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.prefill_chunk_size < 1:
            raise ValueError("max_num_seqs and prefill_chunk_size must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs (one token per decode row)")


class Scheduler:
    """Waiting and running queues; ``plan()`` makes a ``StepPlan``, ``update()`` consumes its result.

    Invariants: a request is in at most one queue; ``running`` keeps admission order; a row
    that finished or was aborted is reported in the next plan's ``freed`` exactly once.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._freed: list[RequestId] = []

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._freed)

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Remove a request from whichever queue holds it; its row is freed at the next step."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
            self._freed.append(request.request_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason

    def plan(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        decodes = tuple(r.request_id for r in self.running if r.is_prefill_done)
        budget -= len(decodes)
        prefills: list[PrefillChunk] = []
        for request in self.running:
            if budget <= 0:
                break
            if not request.is_prefill_done:
                chunk = self._chunk(request, budget)
                prefills.append(chunk)
                budget -= chunk.num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunk = self._chunk(request, budget)
            prefills.append(chunk)
            budget -= chunk.num_tokens
        freed, self._freed = tuple(self._freed), []
        return StepPlan(prefills=tuple(prefills), decodes=decodes, freed=freed)

    def _chunk(self, request: Request, budget: int) -> PrefillChunk:
        start = request.num_computed_tokens
        size = min(request.num_prompt_tokens - start, budget, self.config.prefill_chunk_size)
        end = start + size
        return PrefillChunk(request.request_id, start, end, is_last=end == request.num_prompt_tokens)

    def update(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Advance computed counts and append sampled tokens; return requests that got a token."""
        by_id = {r.request_id: r for r in self.running}
        for chunk in plan.prefills:
            request = by_id.get(chunk.request_id)
            if request is not None:
                request.num_computed_tokens = chunk.end_idx
        for request_id in plan.decodes:
            request = by_id.get(request_id)
            if request is not None:
                request.num_computed_tokens += 1
        advanced = []
        for request_id, sampled in result.sampled.items():
            request = by_id.get(request_id)
            if request is not None:
                request.output_ids.append(sampled.token_id)
                advanced.append(request)
        return advanced
