"""One chat request underneath every chat-shaped API, and the ``/v1/chat/completions`` route:
Chat Completions, Anthropic's Messages and OpenAI's Responses each translate their body into a
``ChatCompletionRequest`` and go through here. It also owns the way from a validated body to
engine input for every route (the model check, the refusals of what the server cannot do, the
prompt's token ids, ``SamplingParams``): everything that depends on the loaded model (its name,
context length, vocabulary) is checked here, so a request that reaches the engine can always run.

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
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import APIRouter, Request

from engine import EngineClient, FinishReason, ModelInfo, OutputParser, ParsedDelta, RequestOutput, SamplingParams
from server.errors import APIError
from server.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from server.protocol_messages import AudioPart, ChatMessage, FilePart, ImagePart, RefusalPart
from server.streaming import ChoiceFormat, Job, finish_name, observe, outputs, respond
from server.tools import ToolPlan, force_calls, plan_tools, structured_params, template_messages

logger = logging.getLogger(__name__)

router = APIRouter()
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


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    return await respond([await prepare_chat(body, request)], body.stream, request)


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

# ---- from a validated body to engine input, for every route ----

def check_model(body: _Sampling, info: ModelInfo) -> None:
    if body.model != info.model_id:
        raise APIError(404, f"The model '{body.model}' does not exist. This server serves '{info.model_id}'.",
                       param="model", code="model_not_found")


MAX_CHOICES = 16
MAX_PROMPTS = 256  # prompts of one /v1/completions request (each is its own engine request)


def check_unsupported(body: _Sampling) -> None:
    """Refuse what this server cannot do (400s naming the field), and write the request's debug
    log line: who asked (``user``, ``safety_identifier``, ``metadata``: kept for the log only)."""
    logger.debug("request model=%s user=%s safety_identifier=%s metadata=%s", body.model, body.user,
                 getattr(body, "safety_identifier", None), getattr(body, "metadata", None))
    if isinstance(body, ChatCompletionRequest):
        _check_chat_capabilities(body)
    for name, what in _FIXED_SWITCHES:
        if getattr(body, name) != body.model_fields[name].default:
            raise APIError(400, f"'{name}: {str(getattr(body, name)).lower()}' is not supported: {what}",
                           param=name, code="unsupported_value")
    if body.n > MAX_CHOICES:
        raise APIError(400, f"n must be at most {MAX_CHOICES}.", param="n", code="invalid_value")
    if isinstance(body, CompletionRequest):
        if body.best_of not in (None, 1):
            raise APIError(400, "best_of > 1 is not supported.", param="best_of", code="unsupported_value")
        if body.suffix:
            raise APIError(400, "suffix is not supported by this model.", param="suffix", code="unsupported_value")
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens must be greater than or equal to 1 (0 only with echo: the prompt, and "
                                "with logprobs its log-probabilities, without a completion).", param="max_tokens",
                           code="invalid_value")


# vLLM's and SGLang's output switches (vllm-router forwards them) at this server's fixed behaviour
_FIXED_SWITCHES = (
    ("skip_special_tokens", "special tokens never reach the output text here."),
    ("continue_final_message", "a chat always ends with the assistant's turn opened by the template."),
    ("separate_reasoning", "a thinking model's reasoning is always split out (kvarn serve --no-reasoning-content "
                           "turns that off for the whole server)."),
    ("stream_reasoning", "a stream always carries the reasoning as it comes."),
    ("include_reasoning", "a thinking model's reasoning is always returned (in reasoning_content)."),
    ("return_hidden_states", "hidden states are not returned by this server."),
)

_LEGACY_FUNCTIONS = ("The deprecated 'functions' and 'function_call' are not supported; send the functions as "
                     "'tools' ([{\"type\": \"function\", \"function\": {...}}]) and choose with 'tool_choice'.")
_TEXT_ONLY = "this server's models read and write text only"


def _check_chat_capabilities(body: ChatCompletionRequest) -> None:
    """Output other than text, web search, moderation and the deprecated function fields: 400s."""
    if body.modalities is not None and any(m != "text" for m in body.modalities):
        raise _unsupported("modalities", f"Audio output is not supported: {_TEXT_ONLY}; send modalities: [\"text\"].")
    for name, what in (("audio", "Audio output"), ("web_search_options", "Web search (this server searches "
                        "nothing)"), ("moderation", "Moderation (this server runs no moderation model)")):
        if getattr(body, name) is not None:
            raise _unsupported(name, f"{what} is not supported; leave out '{name}'.")
    for name in ("functions", "function_call"):
        if getattr(body, name) is not None:
            raise _unsupported(name, _LEGACY_FUNCTIONS)
    for i, message in enumerate(body.messages):
        _check_message(i, message)


_PART_NAMES = {ImagePart: "Image", AudioPart: "Audio", FilePart: "File"}


def _check_message(index: int, message: ChatMessage) -> None:
    at = f"messages[{index}]"
    if message.role == "function":
        raise _unsupported(f"{at}.role", "The deprecated 'function' role is not supported; send a function's result "
                                         "as a 'tool' message with the 'tool_call_id' of its call.")
    if message.function_call is not None:
        raise _unsupported(f"{at}.function_call", "The deprecated 'function_call' of an assistant message is not "
                                                  "supported; send the call in 'tool_calls'.")
    if message.audio is not None:
        raise _unsupported(f"{at}.audio", f"Audio answers are not supported: {_TEXT_ONLY}.")
    for j, call in enumerate(message.tool_calls or ()):
        if call.type == "custom":
            raise _unsupported(f"{at}.tool_calls[{j}]", "Custom tool calls are not supported: this server serves "
                                                        "function tools only.")
    for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
        if type(part) in _PART_NAMES:  # the parameter named as a validation error names the content
            raise APIError(400, f"{_PART_NAMES[type(part)]} input is not supported: {_TEXT_ONLY}; send text parts "
                                f"(messages[{index}].content[{j}] is of type '{part.type}').",
                           param=f"messages.{index}.content", code="invalid_value")
        if isinstance(part, RefusalPart) and message.role != "assistant":
            raise APIError(400, f"Invalid value for '{at}.content[{j}]': refusal parts are only allowed in assistant "
                                f"messages.", param=f"{at}.content[{j}]", code="invalid_value")


def _unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_value")


# the chat template's own arguments, which chat_template_kwargs must not override
_TEMPLATE_ARGUMENTS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                                 "tokenize", "return_dict", "return_tensors", "chat_template", "padding",
                                 "truncation", "max_length", "tokenizer_kwargs"})


def template_kwargs(body: ChatCompletionRequest) -> dict[str, Any]:
    """The chat template's extra variables: ``chat_template_kwargs`` as sent (vLLM's field), with
    ``enable_thinking`` from ``reasoning_effort`` when they do not set it themselves ("none":
    off, any other effort: on). A key that would override the template's own arguments is a 400."""
    kwargs = dict(body.chat_template_kwargs or {})
    reserved = sorted(_TEMPLATE_ARGUMENTS.intersection(kwargs))
    if reserved:
        raise APIError(400, f"Invalid value for 'chat_template_kwargs': '{reserved[0]}' is an argument of the chat "
                            f"template itself and cannot be set here.", param="chat_template_kwargs",
                       code="invalid_value")
    if body.reasoning_effort is not None:
        kwargs.setdefault("enable_thinking", body.reasoning_effort != "none")
    return kwargs


def chat_prompt_ids(body: ChatCompletionRequest, client: EngineClient,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
    messages, kwargs = template_messages(body), template_kwargs(body)
    try:
        return client.apply_chat_template(messages, tools=tools, template_kwargs=kwargs)
    except Exception as exc:  # the model's own template refused the conversation
        raise APIError(400, f"The chat template could not render these messages: {exc}", param="messages",
                       code="invalid_messages") from exc


def system_prompt_end(body: ChatCompletionRequest, prompt_ids: list[int], client: EngineClient,
                      tools: list[dict[str, Any]] | None = None) -> tuple[int, ...]:
    """Where the system prompt ends in ``prompt_ids``, as ``EngineClient.generate``'s
    ``snapshot_at``: ``(n,)`` when the conversation opens with a system message whose rendering
    alone is a strict prefix of the whole prompt (n tokens), else ``()``. Conversations that share
    the system prompt (and the same ``tools``) can then resume from a snapshot of it. Never fails
    the request: a template that renders the system turn differently alone, or refuses it, just
    gives no snapshot."""
    messages = template_messages(body)
    if messages[0]["role"] != "system":
        return ()
    try:
        system_ids = client.apply_chat_template(messages[:1], add_generation_prompt=False, tools=tools,
                                                template_kwargs=template_kwargs(body))
    except Exception:  # noqa: BLE001 - a hint only: the request goes on without it
        logger.debug("the system prompt could not be rendered alone; no snapshot", exc_info=True)
        return ()
    n = len(system_ids)
    if 0 < n < len(prompt_ids) and prompt_ids[:n] == list(system_ids):
        return (n,)
    return ()


def completion_prompts(body: CompletionRequest, info: ModelInfo, client: EngineClient) -> list[list[int]]:
    """The token ids of each prompt: ``prompt`` is one prompt (a string or a list of token ids)
    or a list of them (strings or lists of ids), each of which gets its own choices."""
    prompt = body.prompt
    prompts: list[str | list[int]] = [prompt]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompts = list(prompt)
        if len(prompts) > MAX_PROMPTS:
            raise APIError(400, f"At most {MAX_PROMPTS} prompts are allowed in one request; got {len(prompts)}.",
                           param="prompt", code="invalid_value")
    return [_prompt_ids(p, info, client) for p in prompts]


def _prompt_ids(prompt: str | list[int], info: ModelInfo, client: EngineClient) -> list[int]:
    if isinstance(prompt, str):
        ids = client.encode(prompt)
    else:
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < info.vocab_size]
        if bad:
            raise APIError(400, f"Token id {bad[0]} is outside the vocabulary [0, {info.vocab_size}).",
                           param="prompt", code="invalid_value")
    if not ids:
        raise APIError(400, "The prompt is empty.", param="prompt", code="invalid_value")
    return ids


def sampling_params(body: _Sampling, prompt_len: int, info: ModelInfo, *, default_max_tokens: int | None,
                    logprobs: bool, top_logprobs: int, max_tokens: int | None,
                    prompt_logprobs: int | None = None, server_cap: int | None = None) -> SamplingParams:
    """``max_tokens`` None means "up to the context": OpenAI's chat default, or at most
    ``server_cap`` tokens (``kvarn serve --default-max-tokens``, as mlx_lm.server's
    ``--max-tokens`` and llama.cpp's ``--n-predict``: for clients that send no cap). Requests
    whose prompt plus ``max_tokens`` exceed the context are refused, as OpenAI and vLLM do.
    ``prompt_logprobs`` (completions with echo and logprobs): score the prompt's tokens too, with
    that many alternatives."""
    room = info.context_length - prompt_len
    if room <= 0 or (max_tokens is not None and max_tokens > room):
        asked = f"{prompt_len} in the prompt" + (f", {max_tokens} in the completion" if max_tokens else "")
        raise APIError(400, f"This model's maximum context length is {info.context_length} tokens. However, you "
                            f"requested {prompt_len + (max_tokens or 0)} tokens ({asked}). Please reduce the "
                            f"length of the prompt or the completion.", param="messages"
                       if default_max_tokens is None else "prompt", code="context_length_exceeded")
    bias = []
    for key, value in (body.logit_bias or {}).items():
        token_id = int(key)
        if not 0 <= token_id < info.vocab_size:
            raise APIError(400, f"logit_bias token id {token_id} is outside the vocabulary [0, {info.vocab_size}).",
                           param="logit_bias", code="invalid_value")
        bias.append((token_id, float(value)))
    limit = max_tokens if max_tokens is not None else min(default_max_tokens or room, server_cap or room, room)
    return SamplingParams(
        max_tokens=limit,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),
        min_p=body.min_p or 0.0,
        seed=body.seed,
        stop=body.stop_strings(),
        include_stop_str_in_output=body.no_stop_trim,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=tuple(bias),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        ignore_eos=body.ignore_eos,
        prompt_logprobs=prompt_logprobs,
        speculative=body.speculative,
    )


def choice_format(client: EngineClient, prompt_ids: list[int], plan: ToolPlan, reasoning: bool) -> ChoiceFormat:
    """How to split a chat request's choices: tool calls when ``plan`` reads them, reasoning when
    ``reasoning`` is on and the model has think markers; else no split at all."""
    chat_format = client.info.chat_format if client.info is not None else None
    if chat_format is None or not (plan.parse or (reasoning and chat_format.has_thinking)):
        return ChoiceFormat()

    def make_parser() -> OutputParser:
        return client.output_parser(prompt_ids, tools=plan.tools, parse_tools=plan.parse, reasoning=reasoning)

    return ChoiceFormat(make_parser, plan.max_calls, plan.parse)
