"""The model runner: owns the per-row KV caches and sampler states, runs forwards and samples.

Only the engine thread calls it. All rows of a step are built as lazy MLX graphs first and
evaluated together, so one step costs one synchronisation whatever the number of rows.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.loader import LoadedModel
from engine.request import Request, RequestId, SamplingParams, TokenLogprob
from engine.sampler import SampleArrays, SamplerState, make_sampler_state, sample
from engine.step_types import SampledToken, StepPlan, StepResult
from kvarn.baselines import cache_nbytes, make_cache
from kvarn.layout import KVLayout

logger = logging.getLogger(__name__)


@dataclass
class Row:
    """One sequence's device state: its KV cache (one entry per layer) and its sampler."""

    cache: list[Any]
    sampler: SamplerState
    params: SamplingParams


class ModelRunner:
    def __init__(self, loaded: LoadedModel, layout: KVLayout) -> None:
        self.loaded = loaded
        self.layout = layout
        self.rows: dict[RequestId, Row] = {}

    def kv_nbytes(self) -> int:
        return sum(cache_nbytes(row.cache) for row in self.rows.values())

    def run(self, plan: StepPlan, requests: Mapping[RequestId, Request]) -> StepResult:
        for request_id in plan.freed:
            self.rows.pop(request_id, None)
        pending: dict[RequestId, SampleArrays] = {}
        for chunk in plan.prefills:
            request = requests[chunk.request_id]
            row = self.rows.get(chunk.request_id) or self._new_row(request)
            tokens = request.prompt_ids[chunk.start_idx : chunk.end_idx]
            logits = self._forward(row, tokens)
            if chunk.is_last:
                pending[chunk.request_id] = sample(logits, row.params, row.sampler)
            else:
                mx.async_eval([c.state for c in row.cache])
        for request_id in plan.decodes:
            row = self.rows[request_id]
            logits = self._forward(row, requests[request_id].output_ids[-1:])
            pending[request_id] = sample(logits, row.params, row.sampler)
        try:
            states = [self.rows[i].sampler for i in pending]
            mx.eval([a for arrays in pending.values() for a in vars(arrays).values() if a is not None]
                    + [s.key for s in states] + [s.counts for s in states if s.counts is not None])
            return StepResult(sampled=self._collect(pending))
        except Exception as exc:  # a failed step fails its rows, never the engine
            logger.exception("step failed")
            involved = [c.request_id for c in plan.prefills] + list(plan.decodes)
            for request_id in involved:
                self.rows.pop(request_id, None)
            return StepResult(failed={request_id: f"generation failed: {exc}" for request_id in involved})

    def _new_row(self, request: Request) -> Row:
        row = Row(
            cache=make_cache(self.loaded.model, self.layout),
            sampler=make_sampler_state(request.params, self.loaded.vocab_size),
            params=request.params,
        )
        self.rows[request.request_id] = row
        return row

    def _forward(self, row: Row, tokens: list[int]) -> mx.array:
        logits = self.loaded.model(mx.array(tokens, dtype=mx.int32)[None], cache=row.cache)
        return logits[0, -1]

    @staticmethod
    def _collect(pending: dict[RequestId, SampleArrays]) -> dict[RequestId, SampledToken]:
        sampled = {}
        for request_id, arrays in pending.items():
            token_id = arrays.token.item()
            logprob = None
            if arrays.logprob is not None:
                top: tuple[tuple[int, float], ...] = ()
                if arrays.top_ids is not None:
                    pairs = zip(arrays.top_ids.tolist(), arrays.top_logprobs.tolist())
                    top = tuple(sorted(pairs, key=lambda p: -p[1]))
                logprob = TokenLogprob(token_id, arrays.logprob.item(), top)
            sampled[request_id] = SampledToken(request_id, token_id, logprob)
        return sampled
