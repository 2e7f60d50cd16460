"""vLLM's tokenizer routes: ``/tokenize``, ``/detokenize`` and the render routes that routers call.

A prefix-aware router must see a request as the replica will run it, as token ids: vllm-router's
``kv_aware`` policy posts each chat request to ``/v1/chat/completions/render`` (each completions
request to ``/v1/completions/render``), hashes the ids in blocks and matches them against the
replicas' KV events. Every id here comes from the chat and completions routes' own functions
(``server/chat.py``), so what a route runs and what it reports here are the same ids:

    /tokenize (chat form)          -> chat_prompt_ids, as chat completions renders its prompt
    /tokenize (prompt form)        -> the tokenizer (add_special_tokens: vLLM's default True)
    /v1/chat/completions/render    -> prepare_chat: every check, the prompt, the sampling parameters
    /v1/completions/render         -> completion_prompts + completion_jobs, one entry per prompt

Shapes are vLLM's: ``{"count", "max_model_len", "tokens", "token_strs"}``, ``{"prompt"}``, and
the render routes' ``GenerateRequest`` (``token_ids``, ``sampling_params``, ``request_id``...).
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Body, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine import EngineClient, ModelInfo, SamplingParams
from server.chat import chat_prompt_ids, check_bound, check_model, check_unsupported, completion_prompts, \
    off_loop, prepare_chat, ready, template_kwargs
from server.completions import completion_jobs
from server.errors import APIError
from server.protocol import ChatCompletionRequest, CompletionRequest, invalid_text_path
from server.streaming import Job
from server.tools import plan_tools, template_messages

router = APIRouter()

# Output switches of vLLM's and SGLang's requests that vllm-router sends with every render call:
# they shape the answer, never the prompt, so rendering reads past them.
_OUTPUT_SWITCHES = ("skip_special_tokens", "spaces_between_special_tokens", "return_hidden_states")
_CHAT_OUTPUT_SWITCHES = (*_OUTPUT_SWITCHES, "separate_reasoning", "stream_reasoning", "include_reasoning")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TokenizePrompt(_Body):
    """vLLM's ``TokenizeCompletionRequest``."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class Detokenize(_Body):
    """vLLM's ``DetokenizeRequest``."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


class _ChatFlags(_Body):
    """The chat form's own switches (vLLM's ``TokenizeChatRequest``)."""

    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool | None = False


def _validated(model: type[BaseModel], data: dict[str, Any]) -> Any:
    """``data`` as ``model``; a bad field is a 400 in OpenAI's shape, as on the other routes."""
    path = invalid_text_path(data)
    if path is not None:
        raise APIError(400, f"Invalid value for '{path}': a string holds a lone UTF-16 surrogate, which is not "
                            f"text.", param=path, code="invalid_value")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from exc


def _check_model_name(model: str | None, info: ModelInfo) -> None:
    """``model`` is optional on these routes (as in vLLM); when given it must be the served one."""
    if model is not None and model != info.model_id:
        raise APIError(404, f"The model '{model}' does not exist. This server serves '{info.model_id}'.",
                       param="model", code="model_not_found")


def _chat_request(data: dict[str, Any], info: ModelInfo) -> ChatCompletionRequest:
    """A chat body as the chat route reads it (``model`` defaults to the served one)."""
    if data.get("continue_final_message"):
        raise APIError(400, "continue_final_message is not supported: the final message is rendered as a whole "
                            "turn.", param="continue_final_message", code="unsupported_value")
    rest = {k: v for k, v in data.items() if k not in _CHAT_OUTPUT_SWITCHES and k != "continue_final_message"}
    rest.setdefault("model", info.model_id)
    return _validated(ChatCompletionRequest, rest)


def _chat_ids(body: ChatCompletionRequest, client: EngineClient, tools: list[dict[str, Any]] | None,
              add_generation_prompt: bool) -> list[int]:
    """The chat route's prompt ids (``chat_prompt_ids``), or the same rendering without the
    assistant's opening when ``add_generation_prompt`` is false."""
    if add_generation_prompt:
        return chat_prompt_ids(body, client, tools)
    try:
        return client.apply_chat_template(template_messages(body), add_generation_prompt=False, tools=tools,
                                          template_kwargs=template_kwargs(body))
    except APIError:
        raise
    except Exception as exc:  # the model's own template refused the conversation
        raise APIError(400, f"The chat template could not render these messages: {exc}", param="messages",
                       code="invalid_messages") from exc


def _special_prefix(client: EngineClient) -> list[int]:
    """The ids the tokenizer puts before a text of its own (a BOS, for models that have one)."""
    return list(client._require_tokenizer().encode("", add_special_tokens=True))  # noqa: SLF001


def _encode(client: EngineClient, text: str, add_special_tokens: bool) -> list[int]:
    return list(client._require_tokenizer().encode(text, add_special_tokens=add_special_tokens))  # noqa: SLF001


def _token_strs(client: EngineClient, ids: list[int]) -> list[str]:
    return list(client._require_tokenizer().convert_ids_to_tokens(ids))  # noqa: SLF001


@router.post("/tokenize")
async def tokenize(request: Request, data: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    """vLLM's ``/tokenize``: ``{"prompt", "add_special_tokens"}`` or the chat form
    ``{"messages", "add_generation_prompt", "tools", "chat_template_kwargs", ...}``, rendered as
    chat completions renders it (the chat form adds no special tokens unless asked, as vLLM)."""
    client, info = ready(request)
    if "messages" in data:
        chat = {k: v for k, v in data.items()
                if k not in ("add_generation_prompt", "add_special_tokens", "return_token_strs")}
        flags = _validated(_ChatFlags, {k: v for k, v in data.items() if k in _ChatFlags.model_fields})
        body = _chat_request(chat, info)
        check_model(body, info)
        check_unsupported(body)
        tools = plan_tools(body, info).tools
        ids = await off_loop(request, _chat_ids, body, client, tools, flags.add_generation_prompt)
        if flags.add_special_tokens:
            ids = _special_prefix(client) + ids
        strs = flags.return_token_strs
    else:
        form = _validated(TokenizePrompt, data)
        _check_model_name(form.model, info)
        ids = await off_loop(request, _encode, client, form.prompt, form.add_special_tokens)
        strs = form.return_token_strs
    return {"count": len(ids), "max_model_len": info.context_length, "tokens": ids,
            "token_strs": _token_strs(client, ids) if strs else None}


@router.post("/detokenize")
async def detokenize(request: Request, data: Annotated[dict[str, Any], Body()]) -> dict[str, str]:
    """vLLM's ``/detokenize``: the text of ``tokens``, exactly as the engine pieces output text
    together (special tokens are their own text)."""
    client, info = ready(request)
    form = _validated(Detokenize, data)
    _check_model_name(form.model, info)
    bad = [t for t in form.tokens if t >= info.vocab_size]
    if bad:
        raise APIError(400, f"Token id {bad[0]} is outside the vocabulary [0, {info.vocab_size}).", param="tokens",
                       code="invalid_value")
    return {"prompt": await off_loop(request, client.text_of, form.tokens)}


def _sampling(params: SamplingParams, n: int) -> dict[str, Any]:
    """vLLM's ``SamplingParams`` fields for what the engine will run."""
    return {"n": n, "max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k, "min_p": params.min_p, "seed": params.seed, "stop": list(params.stop),
            "presence_penalty": params.presence_penalty, "frequency_penalty": params.frequency_penalty,
            "logit_bias": {str(t): b for t, b in params.logit_bias} or None,
            "logprobs": params.top_logprobs if params.logprobs else None, "prompt_logprobs": params.prompt_logprobs,
            "ignore_eos": params.ignore_eos, "include_stop_str_in_output": params.include_stop_str_in_output}


def _generate_request(job: Job, prefix: str, stream: bool, stream_options: Any) -> dict[str, Any]:
    """vLLM's ``GenerateRequest``: the ids and sampling parameters a route would run."""
    return {"request_id": f"{prefix}-{uuid.uuid4().hex}", "token_ids": job.prompt_ids, "features": None,
            "sampling_params": _sampling(job.params, job.n), "model": job.model, "stream": stream,
            "stream_options": stream_options.model_dump() if stream and stream_options else None,
            "cache_salt": job.cache_salt, "priority": 0, "kv_transfer_params": None}


@router.post("/v1/chat/completions/render")
async def render_chat(request: Request, data: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
    """vLLM's chat render: the request checked and rendered exactly as ``/v1/chat/completions``
    would run it (``prepare_chat``), nothing generated."""
    _, info = ready(request)
    body = _chat_request(data, info)
    job = await prepare_chat(body, request)
    return _generate_request(job, "chatcmpl", body.stream, body.stream_options)


@router.post("/v1/completions/render")
async def render_completions(request: Request, data: Annotated[dict[str, Any], Body()]) -> list[dict[str, Any]]:
    """vLLM's completions render: one entry per prompt, as ``/v1/completions`` would run them."""
    client, info = ready(request)
    body = _validated(CompletionRequest, {k: v for k, v in data.items() if k not in _OUTPUT_SWITCHES})
    check_model(body, info)
    check_unsupported(body)
    check_bound(body, info)
    prompts = await off_loop(request, completion_prompts, body, info, client)
    jobs = await completion_jobs(body, client, info, prompts, "")
    return [_generate_request(job, "cmpl", body.stream, body.stream_options) for job in jobs]
