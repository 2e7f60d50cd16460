"""The engine: ``step()`` = plan, run, update. Single-threaded; ``EngineClient`` owns the thread."""

from __future__ import annotations

import logging

import mlx.core as mx

from engine.kv_config import KVConfig
from engine.loader import LoadedModel
from engine.model_runner import ModelRunner
from engine.output import OutputState, advance, new_detokenizer
from engine.request import FinishReason, Request, RequestId, RequestOutput
from engine.scheduler import Scheduler, SchedulerConfig
from engine.step_types import StepPlan, StepResult
from kvarn.attention import install_attention_seam
from kvarn.baselines import count_quantized_layers, make_cache
from kvarn.layout import KVLayout

logger = logging.getLogger(__name__)


def make_layout(kv: KVConfig, loaded: LoadedModel) -> KVLayout:
    key_bits = kv.key_bits or 4
    # affine has one width for both legs; KVarN's value leg defaults to 2 bits (k4v2)
    value_bits = kv.value_bits or (key_bits if kv.scheme == "affine" else 2)
    return KVLayout(scheme=kv.scheme, key_bits=key_bits, value_bits=value_bits, tile_size=kv.tile,
                    group_size=kv.group_size, storage_dtype=loaded.compute_dtype)


def make_engine(loaded: LoadedModel, config: SchedulerConfig | None = None, kv: KVConfig | None = None) -> Engine:
    """An engine running ``loaded`` with the KV layout ``kv`` (KVarN k4v2 by default).

    Fails at once, not at the first request, if the layout cannot run on this model: the
    attention seam is installed (quantized layouts route through it: KVarN always, affine where
    MLX lacks its kernels) and one token is run through a fresh cache."""
    layout = make_layout(kv or KVConfig(), loaded)
    if layout.scheme != "fp16":
        install_attention_seam(loaded.model)
    probe = make_cache(loaded.model, layout)
    mx.eval(loaded.model(mx.array([[0]], dtype=mx.int32), cache=probe))
    return Engine(loaded, layout, config)


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

    def describe_kv(self) -> dict[str, object]:
        """The layout in force, with how many layers use it (others keep their own cache)."""
        used, total = count_quantized_layers(self.loaded.model, self.layout)
        return {**self.layout.describe(self.loaded.fingerprint), "layers": total, "layers_with_layout": used}

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
