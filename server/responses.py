"""Response bodies and stream chunks in OpenAI's shapes, for chat and legacy completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine import FinishReason, RequestOutput, SamplingParams, TokenLogprob
from server.chat_choices import ChoiceFormat

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort",
           FinishReason.ERROR: "error", FinishReason.GRAMMAR_DEAD_END: "grammar_dead_end"}


@dataclass
class Job:
    """One accepted request as the server sees it: identity, engine input and response options."""

    kind: str  # "chat" or "completion"
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    system_fingerprint: str
    include_usage: bool = False
    echo_text: str = ""
    n: int = 1
    admission: Any = None  # the front door's engine.Admission, handed to EngineClient.generate
    cache_salt: str | None = None  # the prefix cache serves only blocks cached under this salt
    snapshot_at: tuple[int, ...] = ()  # prompt lengths worth a whole-row snapshot (end of the system prompt)
    choice_format: ChoiceFormat = field(default_factory=ChoiceFormat)  # chat: content, reasoning, tool calls
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.monotonic)

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"


def finish_name(reason: FinishReason | None) -> str | None:
    return _FINISH[reason] if reason is not None else None


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens`` counts the prompt tokens
    served from the prefix cache (always present, 0 when none were)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_logprobs(entries: Sequence[TokenLogprob], decode: Callable[[int], str]) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = decode(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], decode: Callable[[int], str], offset: int) -> dict[str, Any]:
    tokens, offsets = [], []
    for entry in entries:
        tokens.append(decode(entry.token_id))
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{decode(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}


def _header(job: Job, object_name: str) -> dict[str, Any]:
    return {"id": job.response_id, "object": object_name, "created": job.created, "model": job.model,
            "system_fingerprint": job.system_fingerprint}


def chunk(job: Job, text: str | None, finish: str | None, logprobs: dict[str, Any] | None,
          index: int = 0) -> dict[str, Any]:
    """One streamed legacy-completions chunk with one choice (chat: ``chat_chunk``)."""
    choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    return {**_header(job, "text_completion"), "choices": [choice]}


def chat_chunk(job: Job, delta: dict[str, Any], finish: str | None, logprobs: dict[str, Any] | None,
               index: int = 0) -> dict[str, Any]:
    """One streamed chat chunk with one choice and its ``delta`` (content, reasoning_content,
    tool_calls)."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return {**_header(job, "chat.completion.chunk"), "choices": [choice]}


def usage_chunk(job: Job, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    name = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    return {**_header(job, name), "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


@dataclass
class Collected:
    """A whole non-streamed generation of one choice."""

    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    last: RequestOutput | None = None

    def add(self, output: RequestOutput) -> None:
        self.text += output.text
        self.logprobs.extend(output.logprobs)
        self.last = output


def full_response(job: Job, choices: Sequence[Collected], decode: Callable[[int], str]) -> dict[str, Any]:
    """The body of a non-streamed response: one choice per ``Collected``, usage over all of them
    (the prompt and its cached tokens counted once, as OpenAI does for ``n > 1``)."""
    bodies = []
    for index, collected in enumerate(choices):
        last = collected.last
        assert last is not None and last.finished
        finish = finish_name(last.finish_reason)
        if job.kind == "chat":
            lp = chat_logprobs(collected.logprobs, decode) if job.params.logprobs else None
            split = job.choice_format.start()
            message = split.message(split.feed(collected.text, finished=True))
            bodies.append({"index": index, "message": message, "logprobs": lp,
                           "finish_reason": split.finish_name(last.finish_reason, finish)})
        else:
            lp = (completion_logprobs(collected.logprobs, decode, len(job.echo_text))
                  if job.params.logprobs else None)
            bodies.append({"index": index, "text": job.echo_text + collected.text, "logprobs": lp,
                           "finish_reason": finish})
    prompt_tokens = choices[0].last.num_prompt_tokens if choices[0].last else len(job.prompt_ids)
    cached_tokens = max((c.last.num_cached_tokens for c in choices if c.last is not None), default=0)
    completion_tokens = sum(c.last.num_output_tokens for c in choices if c.last is not None)
    return {**_header(job, job.object_name), "choices": bodies,
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
