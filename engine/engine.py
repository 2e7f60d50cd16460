"""The engine: ``step()`` = plan, run, update. Single-threaded; ``EngineClient`` owns the thread."""

from __future__ import annotations

import logging


from engine.loader import LoadedModel
from engine.model_runner import ModelRunner
from engine.output import OutputState, advance, new_detokenizer
from engine.request import FinishReason, Request, RequestId, RequestOutput
from engine.scheduler import Scheduler, SchedulerConfig
from engine.step_types import StepPlan, StepResult
from kvarn.layout import KVLayout

logger = logging.getLogger(__name__)


def make_engine(loaded: LoadedModel, config: SchedulerConfig | None = None) -> Engine:
    """An engine with the KV layout in force for ``loaded``: for now the unquantized baseline,
    stored in the model's compute dtype."""
    return Engine(loaded, KVLayout(scheme="fp16", storage_dtype=loaded.compute_dtype), config)


class Engine:
    """Requests in, ``RequestOutput`` deltas out. Invariant: every added request gets exactly one
    output with ``finish_reason`` set, after which the engine holds nothing of it."""

    def __init__(self, loaded: LoadedModel, layout: KVLayout, config: SchedulerConfig | None = None) -> None:
        self.loaded = loaded
        self.layout = layout
        self.scheduler = Scheduler(config or SchedulerConfig())
        self.runner = ModelRunner(loaded, layout)
        self.requests: dict[RequestId, Request] = {}
        self._outputs: dict[RequestId, OutputState] = {}
        self._eos_token_ids = frozenset(loaded.tokenizer.eos_token_ids)

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id}")
        self.requests[request.request_id] = request
        self._outputs[request.request_id] = OutputState(new_detokenizer(self.loaded.tokenizer), request.params.stop)
        self.scheduler.add(request)

    def abort_request(self, request_id: RequestId) -> RequestOutput | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.scheduler.finish(request, FinishReason.ABORT)
        return self._final(request, FinishReason.ABORT)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.plan()
        result = self.runner.run(plan, self.requests)
        return self.update(plan, result)

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        outputs = []
        for request_id, reason in result.failed.items():
            request = self.requests[request_id]
            self.scheduler.finish(request, FinishReason.ERROR)
            outputs.append(self._final(request, FinishReason.ERROR, error=reason))
        for request in self.scheduler.update(plan, result):
            sampled = result.sampled[request.request_id]
            delta = advance(self._outputs[request.request_id], request, sampled.token_id, sampled.logprob,
                            self._eos_token_ids, self.loaded.context_length)
            if delta.finish_reason is not None:
                self.scheduler.finish(request, delta.finish_reason)
                self._forget(request)
            if delta.text or delta.token_ids or delta.finish_reason is not None:
                outputs.append(RequestOutput(
                    request.request_id, delta.text, delta.token_ids, delta.logprobs,
                    request.num_prompt_tokens, len(request.output_ids), delta.finish_reason))
        return outputs

    def _final(self, request: Request, reason: FinishReason, error: str | None = None) -> RequestOutput:
        self._forget(request)
        return RequestOutput(request.request_id, "", (), (), request.num_prompt_tokens,
                             len(request.output_ids), reason, error)

    def _forget(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
        self._outputs.pop(request.request_id, None)
