"""Response bodies and stream chunks in OpenAI's shapes, for chat and legacy completions."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
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
    prompt_index: int = 0  # completions with a list of prompts: this prompt's place (its choices follow)
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)  # shared by the prompts of a request
    created: int = field(default_factory=lambda: int(time.time()))
    arrival: float = field(default_factory=time.monotonic)

    @property
    def response_id(self) -> str:
        return ("chatcmpl-" if self.kind == "chat" else "cmpl-") + self.request_id

    @property
    def engine_id(self) -> str:
        """This prompt's request id inside the engine (unique among the prompts of a request)."""
        return self.request_id if self.prompt_index == 0 else f"{self.request_id}.p{self.prompt_index}"

    def choice_index(self, index: int) -> int:
        """The response index of this prompt's choice ``index``: prompt k's n choices are k*n .. k*n + n - 1
        (OpenAI's order)."""
        return self.prompt_index * self.n + index

    def echoed(self, prompt_logprobs: Sequence[TokenLogprob] | None) -> tuple[str, list[TokenLogprob]]:
        """The echoed prompt and the logprob entries it comes with: with prompt logprobs, the text
        their pieces add up to (the prompt itself for a lossless tokenizer, as the bundled model's),
        so tokens and ``text_offset`` agree with the text; else ``echo_text`` and no entries."""
        if self.params.prompt_logprobs is not None and prompt_logprobs is not None:
            return "".join(e.text for e in prompt_logprobs), list(prompt_logprobs)
        return self.echo_text, []

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


def shown_logprobs(kind: str, entries: Sequence[TokenLogprob]) -> list[TokenLogprob]:
    """The entries a response shows: chat leaves out the EOS that ended a choice (OpenAI shows no
    stop token); legacy completions keep it, with no text (as vLLM), so each generated token has
    its entry (lm-eval reads the prompt's log-probabilities up to the last entry)."""
    return [e for e in entries if not e.eos] if kind == "chat" else list(entries)


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """``token`` is the token's piece of the text (``engine/output.py``: "" inside a multi-byte
    character, whose token that completes it carries it whole), ``bytes`` the token's own raw bytes."""
    def item(text: str, raw: bytes, logprob: float | None) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    return {"content": [{**item(e.text, e.raw, e.logprob),
                         "top_logprobs": [item(text, raw, lp) for (_, lp), (text, raw) in zip(e.top, e.top_text)]}
                        for e in entries], "refusal": None}


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """OpenAI's legacy shape; ``text_offset`` counts characters of the choice's text from
    ``offset``, so ``text[offset:offset + len(token)] == token`` for every entry."""
    tokens, offsets = [], []
    for entry in entries:
        tokens.append(entry.text)
        offsets.append(offset)
        offset += len(entry.text)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{text: lp for (_, lp), (text, _raw) in zip(e.top, e.top_text)} if e.logprob is not None
                             else None for e in entries], "text_offset": offsets}


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
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    last: RequestOutput | None = None

    def add(self, output: RequestOutput) -> None:
        self.text += output.text
        self.logprobs.extend(output.logprobs)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.last = output


def full_response(jobs: Sequence[Job], choices: Sequence[Collected]) -> dict[str, Any]:
    """The body of a non-streamed response: one choice per ``Collected`` (``jobs[k]``'s choices
    at ``Job.choice_index``), usage over all of them (each prompt and its cached tokens counted
    once, as OpenAI does for ``n > 1``; summed over the prompts of a list)."""
    bodies = []
    for index, collected in enumerate(choices):
        job, last = jobs[index // jobs[0].n], collected.last
        assert last is not None and last.finished
        finish = finish_name(last.finish_reason)
        entries = shown_logprobs(job.kind, collected.logprobs)
        if job.kind == "chat":
            lp = chat_logprobs(entries) if job.params.logprobs else None
            split = job.choice_format.start()
            message = split.message(split.feed(collected.text, finished=True,
                                                        truncated=last.finish_reason is FinishReason.LENGTH))
            bodies.append({"index": index, "message": message, "logprobs": lp,
                           "finish_reason": split.finish_name(last.finish_reason, finish)})
        else:
            echo, head = job.echoed(collected.prompt_logprobs)
            lp = completion_logprobs(head + entries, 0 if head else len(echo)) if job.params.logprobs else None
            bodies.append({"index": index, "text": echo + collected.text, "logprobs": lp, "finish_reason": finish})
    lasts = [[c.last for c in choices[k * job.n:(k + 1) * job.n] if c.last is not None] for k, job in enumerate(jobs)]
    prompt_tokens = sum(l[0].num_prompt_tokens if l else len(job.prompt_ids) for l, job in zip(lasts, jobs))
    cached_tokens = sum(max((c.num_cached_tokens for c in l), default=0) for l in lasts)
    completion_tokens = sum(c.num_output_tokens for l in lasts for c in l)
    return {**_header(jobs[0], jobs[0].object_name), "choices": bodies,
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
