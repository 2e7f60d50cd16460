"""One chat request underneath every chat-shaped API: Chat Completions, Anthropic's Messages and
OpenAI's Responses each translate their body into a ``ChatCompletionRequest`` and go through here.

    body (any API) --translate--> ChatCompletionRequest --prepare_chat--> Job --admit--> engine
                                                                          |
    each API's own shapes  <--ChatStep (content, reasoning, whole calls)--+-- chat_steps

``prepare_chat`` does everything chat completions does before a request is queued (the model
check, tools and their grammar, the chat template, sampling, structured outputs, the reasoning
split, the system prompt's snapshot point); ``chat_steps`` runs one admitted job and yields what
each engine output adds to its single choice, already split by the engine's ``OutputParser``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from engine import EngineClient, FinishReason, ModelInfo, ParsedDelta, RequestOutput
from server.chat_choices import choice_format
from server.errors import APIError
from server.prepare import chat_prompt_ids, check_model, check_unsupported, sampling_params, system_prompt_end
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.streaming import Job, finish_name, observe, outputs
from server.tools import force_calls, plan_tools, structured_params

T = TypeVar("T")


async def off_loop(request: Request, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the app's prompt-building threads: a chat template or a tokenizer run on a
    long text never holds up the event loop (the tokenizer releases the GIL)."""
    return await asyncio.get_running_loop().run_in_executor(request.app.state.prepare, functools.partial(fn, *args))


def ready(request: Request) -> tuple[EngineClient, ModelInfo]:
    """The engine client and the served model, or a 503 while it loads (or failed to)."""
    client: EngineClient = request.app.state.client
    if client.load_error is not None:
        raise APIError(503, f"The model failed to load: {client.load_error}", code="model_load_failed")
    if not client.ready.is_set() or client.info is None:
        raise loading()
    return client, client.info


def loading() -> APIError:
    return APIError(503, "The model is still loading; retry shortly.", code="model_loading",
                    headers={"Retry-After": "1"})


def check_bound(body: ChatCompletionRequest | CompletionRequest, info: ModelInfo) -> None:
    """The cheap length bound, before a prompt is rendered or tokenized (tokenizing runs off the
    event loop, but still costs a core): no token of the vocabulary covers more than
    ``info.max_token_chars`` characters, so a text of more than ``context_length`` times that many
    has more than ``context_length`` tokens. A bound, not an estimate: it never refuses a prompt
    that would fit (tokenizers whose normalizer deletes characters aside); the exact check after
    tokenizing still runs."""
    num_chars, context_length, max_token_chars = prompt_text_chars(body), info.context_length, info.max_token_chars
    if max_token_chars > 0 and num_chars > context_length * max_token_chars:
        raise APIError(400, f"This model's maximum context length is {context_length} tokens, and the prompt's "
                            f"{num_chars:,} characters are more than that many tokens of this vocabulary can hold "
                            f"(at most {max_token_chars} characters a token). Please reduce the length of the prompt.",
                       param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                       code="context_length_exceeded")


def prompt_text_chars(body: ChatCompletionRequest | CompletionRequest) -> int:
    """Characters of a request's text that every chat template renders (system, developer, user
    and tool turns: a template may drop or shorten an assistant's earlier reasoning); for a list
    of prompts, the longest. Under-counting only weakens the bound, never makes it wrong."""
    if isinstance(body, ChatCompletionRequest):
        return sum(len(m.text()) for m in body.messages if m.role != "assistant")
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    return max((len(p) for p in prompts if isinstance(p, str)), default=0)


def fingerprint(info: ModelInfo) -> str:
    return "kvarn-" + str(info.kv_cache["stamp"])


async def prepare_chat(body: ChatCompletionRequest, request: Request) -> Job:
    """The engine job of a chat request (not yet admitted): every check that can refuse it runs
    here, before any token (400s in OpenAI's shape; other APIs map them to their own)."""
    client, info = ready(request)
    check_model(body, info)
    check_unsupported(body)
    tools = plan_tools(body, info)
    check_bound(body, info)
    prompt_ids = await off_loop(request, chat_prompt_ids, body, client, tools.tools)
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = sampling_params(body, len(prompt_ids), info, default_max_tokens=None, logprobs=body.logprobs,
                             top_logprobs=body.top_logprobs or 0, max_tokens=max_tokens,
                             server_cap=request.app.state.config.default_max_tokens)
    params = await structured_params(body, client, params)
    if tools.forced:  # required / named: the grammar makes the calls
        params = await force_calls(client, info, tools, params)
    split = choice_format(client, prompt_ids, tools, request.app.state.config.reasoning_content)
    return Job("chat", info.model_id, prompt_ids, params, fingerprint(info),
               include_usage=bool(body.stream_options and body.stream_options.include_usage), n=body.n,
               cache_salt=body.salt(),
               snapshot_at=await off_loop(request, system_prompt_end, body, prompt_ids, client, tools.tools),
               choice_format=split)


@dataclass
class ChatStep:
    """What one engine output adds to a job's single choice: ``parsed`` text (content and
    reasoning) and the whole ``calls`` it completed, each as OpenAI's entry ``{"id", "type",
    "function": {"name", "arguments"}}`` with a fresh id. On the last step ``finished`` is set
    with the engine's ``reason`` and OpenAI's ``finish`` name (``tool_calls`` when the choice
    stopped after calls); ``prompt_tokens``, ``output_tokens`` and ``cached_tokens`` are the
    running usage."""

    parsed: ParsedDelta
    calls: list[dict[str, Any]]
    output: RequestOutput
    finished: bool = False
    reason: FinishReason | None = None
    finish: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    all_calls: list[dict[str, Any]] = field(default_factory=list)  # every call of the choice so far


class GenerationFailed(APIError):
    """The engine failed the request after it started (an internal error, reported as a 500)."""

    def __init__(self, message: str) -> None:
        super().__init__(500, message, code="generation_failed")


async def chat_steps(job: Job, request: Request) -> AsyncIterator[ChatStep]:
    """Run an admitted chat ``job`` of one choice and yield what each engine output adds. The
    request's metrics (prompt and generated tokens, TTFT, latency, finish) are counted as for
    chat completions; leaving early aborts the request inside the engine. An engine failure
    raises ``GenerationFailed``; ``engine.RequestRejected`` passes through."""
    if job.n != 1:
        raise ValueError("chat_steps runs one choice")
    client, metrics = request.app.state.client, request.app.state.metrics
    metrics.prompt_tokens.inc(len(job.prompt_ids))
    split = job.choice_format.start()
    tokens = cached = 0
    reason: FinishReason | None = None
    try:
        async for _, output in outputs([job], client):
            if tokens == 0 and output.token_ids:
                metrics.ttft.observe(time.monotonic() - job.arrival)
            tokens, reason = output.num_output_tokens, output.finish_reason
            cached = max(cached, output.num_cached_tokens)
            if output.error is not None:
                raise GenerationFailed(output.error)
            before = len(split.calls)
            parsed = split.feed(output.text, output.finished, truncated=output.finish_reason is FinishReason.LENGTH)
            finish = split.finish_name(output.finish_reason, finish_name(output.finish_reason)) \
                if output.finished else None
            yield ChatStep(parsed, split.calls[before:], output, output.finished, output.finish_reason, finish,
                           output.num_prompt_tokens or len(job.prompt_ids), tokens, cached, list(split.calls))
    finally:
        observe(job, metrics, reason, tokens, cached)
