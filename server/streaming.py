"""A job and everything that answers it: ``Job`` (one accepted request as the server sees it),
the response bodies and stream chunks in OpenAI's shapes for chat and legacy completions,
admission, and the run against the engine: streamed over SSE, or collected with a disconnect
watch. Either way, a client that goes away cancels the consumer, whose ``finally`` aborts the
request inside the engine at its next step.

A chat choice's text in OpenAI's shapes (``ChoiceFormat``, ``ChoiceText``): ``content``,
``reasoning_content`` and ``tool_calls``, whole (``message``) or streamed (``delta``). The split
itself is the engine's ``OutputParser`` (mlx-lm's markers and tool parsers). A call is streamed
as OpenAI does, so the SDK's stream helpers assemble it: first its index, id, type and name
(arguments ""), then its arguments; the parser reads a call whole, so both arrive once the
call's end marker has been generated.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import string
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from sse_starlette import EventSourceResponse

from engine import EngineClient, FinishReason, OutputParser, ParsedCall, ParsedDelta, RequestOutput, RequestRejected, \
    SamplingParams, TokenLogprob
from server.errors import APIError, ClientDisconnected, error_body
from server.metrics import Metrics

logger = logging.getLogger(__name__)

T = TypeVar("T")
_DISCONNECT_POLL_S = 0.1

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort",
           FinishReason.ERROR: "error", FinishReason.GRAMMAR_DEAD_END: "grammar_dead_end"}


# --- a chat choice's text ---

_ID_ALPHABET = string.ascii_letters + string.digits
_ID_CHARS = 24


def new_call_id() -> str:
    """An id like OpenAI's (``call_`` and 24 letters or digits)."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(_ID_CHARS))


@dataclass(frozen=True)
class ChoiceFormat:
    """How a request's chat choices are split: ``make_parser`` gives each choice its own parser
    (None: the whole text is content, as before tools); ``max_calls`` caps the calls reported
    (``parallel_tool_calls: false``: the first)."""

    make_parser: Callable[[], OutputParser] | None = None
    max_calls: int | None = None
    reads_calls: bool = False

    def start(self) -> ChoiceText:
        return ChoiceText(self.make_parser() if self.make_parser is not None else None, self.max_calls)

    def role_delta(self) -> dict[str, Any]:
        """A stream's first delta: content "" (as vLLM), or null where the answer may be calls
        alone (as OpenAI starts its tool-call streams), so the SDK assembles what the
        non-streamed message says."""
        return {"role": "assistant", "content": None if self.reads_calls else ""}


@dataclass
class ChoiceText:
    """The running split of one choice. ``calls`` are the tool calls reported so far, with ids."""

    parser: OutputParser | None
    max_calls: int | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)

    def feed(self, text: str, finished: bool, truncated: bool = False) -> ParsedDelta:
        """What ``text`` adds (and, at the end, what the parser still held), calls past
        ``max_calls`` left out; ``truncated``: the choice ended at ``max_tokens``, so a call it
        was still writing is dropped, never shown as content."""
        if self.parser is None:
            return ParsedDelta(content=text)
        parsed = self.parser.feed(text)
        if finished:
            parsed.extend(self.parser.finish(truncated))
        room = None if self.max_calls is None else max(self.max_calls - len(self.calls), 0)
        parsed.calls = parsed.calls[:room]
        self.calls.extend(_entry(call) for call in parsed.calls)
        return parsed

    def finish_name(self, reason: FinishReason | None, name: str | None) -> str | None:
        """OpenAI's ``finish_reason``: "tool_calls" when the choice stopped after making calls."""
        return "tool_calls" if reason is FinishReason.STOP and self.calls else name

    def message(self, parsed: ParsedDelta) -> dict[str, Any]:
        """The non-streamed ``message`` of a choice whose whole text gave ``parsed``."""
        message: dict[str, Any] = {"role": "assistant",
                                   "content": parsed.content if parsed.content or not self.calls else None,
                                   "refusal": None}
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        if self.calls:
            message["tool_calls"] = self.calls
        return message

    def deltas(self, parsed: ParsedDelta) -> list[dict[str, Any]]:
        """The stream deltas of ``parsed`` (one of ``feed``'s results): text first, then two
        per call (header, arguments), indexed across the whole choice."""
        out: list[dict[str, Any]] = []
        text = {key: value for key, value in (("reasoning_content", parsed.reasoning),
                                              ("content", parsed.content)) if value}
        if text:
            out.append(text)
        first = len(self.calls) - len(parsed.calls)
        for index, entry in enumerate(self.calls[first:], start=first):
            header = {"index": index, "id": entry["id"], "type": "function",
                      "function": {"name": entry["function"]["name"], "arguments": ""}}
            out.append({"tool_calls": [header]})
            out.append({"tool_calls": [{"index": index, "function": {"arguments": entry["function"]["arguments"]}}]})
        return out


def _entry(call: ParsedCall) -> dict[str, Any]:
    return {"id": new_call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


# --- the job ---

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


# ---- running jobs against the engine ----
def observe(job: Job, metrics: Metrics, finish: FinishReason | None, num_tokens: int, cached_tokens: int) -> None:
    metrics.requests.labels(job.kind, finish_name(finish) or "disconnect").inc()
    metrics.generation_tokens.inc(num_tokens)
    metrics.cached_prompt_tokens.inc(cached_tokens)
    metrics.latency.observe(time.monotonic() - job.arrival)


def _generate(job: Job, client: EngineClient) -> AsyncIterator[RequestOutput]:
    return client.generate(job.prompt_ids, job.params, job.engine_id, n=job.n, admission=job.admission,
                           cache_salt=job.cache_salt, snapshot_at=job.snapshot_at)


async def outputs(jobs: Sequence[Job], client: EngineClient) -> AsyncIterator[tuple[Job, RequestOutput]]:
    """Every job's outputs as they come (a list of prompts runs as one engine request each, side
    by side). Leaving early cancels them all, which aborts them inside the engine."""
    if len(jobs) == 1:
        async for output in _generate(jobs[0], client):
            yield jobs[0], output
        return
    queue: asyncio.Queue[tuple[Job, RequestOutput | Exception | None]] = asyncio.Queue()

    async def pump(job: Job) -> None:
        try:
            async for output in _generate(job, client):
                queue.put_nowait((job, output))
        except Exception as exc:  # handed to the consumer (a refusal, an engine that went away)
            queue.put_nowait((job, exc))
            return
        queue.put_nowait((job, None))

    tasks = [asyncio.ensure_future(pump(job)) for job in jobs]
    try:
        running = len(jobs)
        while running:
            job, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield job, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def admit(jobs: Sequence[Job], request: Request) -> None:
    """Admit every job at the front door, before any byte of a response goes out (so a refusal
    gets its own status); a refusal lets go of the jobs admitted before it and raises an
    ``APIError`` (429 or 503 with ``Retry-After``)."""
    client, state = request.app.state.client, request.app.state
    try:
        for job in jobs:
            job.admission = client.check_admission(len(job.prompt_ids), job.params.max_tokens, job.n)
    except RequestRejected as exc:
        for job in jobs:
            if job.admission is not None:
                job.admission.release()
        state.metrics.rejected.labels(str(exc.status)).inc()
        raise APIError(exc.status, exc.message, code=exc.code,
                       headers={"Retry-After": str(exc.retry_after)} if exc.retry_after else None) from exc


async def respond(jobs: list[Job], stream: bool, request: Request) -> Any:
    """Admit every job (``admit``), then stream or collect."""
    await admit(jobs, request)
    client, state = request.app.state.client, request.app.state
    if stream:
        return EventSourceResponse(stream_events(jobs, client, state.metrics), ping=15)
    return await collect(jobs, client, state.metrics, request)


async def stream_events(jobs: Sequence[Job], client: EngineClient, metrics: Metrics) -> AsyncIterator[dict[str, str]]:
    """SSE events: chunks (each of one choice, told apart by ``index``), an optional usage chunk
    once every choice has finished, then ``[DONE]``. An echoed prompt comes first, or, with its
    log-probabilities, with its choice's first output (the engine scores the prompt first)."""
    job0, n = jobs[0], jobs[0].n
    metrics.prompt_tokens.inc(sum(len(job.prompt_ids) for job in jobs))
    offsets = [len(job.echo_text) for job in jobs for _ in range(n)]
    tokens = [0] * len(offsets)
    cached = [0] * len(jobs)  # each prompt's tokens served from the prefix cache (the same on every output)
    finishes: list[FinishReason | None] = [None] * len(offsets)
    splits = [job0.choice_format.start() for _ in offsets] if job0.kind == "chat" else []
    try:
        for job in jobs:
            for index in range(n):
                if job.kind == "chat":
                    yield _event(chat_chunk(job, job.choice_format.role_delta(), None, None, index=index))
                elif job.echo_text and job.params.prompt_logprobs is None:
                    yield _event(chunk(job, job.echo_text, None, None, index=job.choice_index(index)))
        async for job, output in outputs(jobs, client):
            i = job.choice_index(output.index)
            if sum(tokens) == 0 and output.token_ids:
                metrics.ttft.observe(time.monotonic() - job.arrival)
            tokens[i], finishes[i] = output.num_output_tokens, output.finish_reason
            cached[job.prompt_index] = max(cached[job.prompt_index], output.num_cached_tokens)
            if output.error is not None:
                yield _event(error_body(500, output.error, code="generation_failed"))
                break
            if output.prompt_logprobs is not None and job.kind == "completion":
                echo, head = job.echoed(output.prompt_logprobs)
                offsets[i] = len(echo)
                yield _event(chunk(job, echo, None, completion_logprobs(head, 0) if job.params.logprobs else None,
                                   index=i))
            entries = shown_logprobs(job.kind, output.logprobs) if job.params.logprobs else []
            logprobs = None
            if entries:
                logprobs = chat_logprobs(entries) if job.kind == "chat" else completion_logprobs(entries, offsets[i])
            offsets[i] += len(output.text)
            finish = finish_name(output.finish_reason)
            if splits:
                split = splits[i]
                deltas = split.deltas(split.feed(output.text, output.finished,
                                                    output.finish_reason is FinishReason.LENGTH)) or \
                    ([{}] if logprobs or output.finished else [])
                finish = split.finish_name(output.finish_reason, finish)
                for k, delta in enumerate(deltas):  # logprobs with the first, the finish with the last
                    yield _event(chat_chunk(job, delta, finish if k == len(deltas) - 1 else None,
                                            logprobs if k == 0 else None, index=i))
            elif output.text or logprobs or output.finished:
                yield _event(chunk(job, output.text, finish, logprobs, index=i))
        else:
            if job0.include_usage:
                yield _event(usage_chunk(job0, sum(len(job.prompt_ids) for job in jobs), sum(tokens), sum(cached)))
        yield {"data": "[DONE]"}
    except RequestRejected as exc:  # only without a front-door admission (the routes always take one)
        metrics.rejected.labels(str(exc.status)).inc()
        yield _event(error_body(exc.status, exc.message, code=exc.code))
    finally:
        observe(job0, metrics, _overall(finishes), sum(tokens), sum(cached))


def _overall(finishes: list[FinishReason | None]) -> FinishReason | None:
    """A request's finish for the metrics: choice 0's once every choice has finished, else None
    (the client left first)."""
    return finishes[0] if all(f is not None for f in finishes) else None


def _event(payload: dict[str, Any]) -> dict[str, str]:
    return {"data": json.dumps(payload, ensure_ascii=False)}


async def collect(jobs: Sequence[Job], client: EngineClient, metrics: Metrics, request: Request) -> dict[str, Any]:
    """The whole response, or nothing if the client left first (the request is then aborted)."""
    job0 = jobs[0]
    metrics.prompt_tokens.inc(sum(len(job.prompt_ids) for job in jobs))
    choices = [Collected() for _ in range(len(jobs) * job0.n)]

    async def run() -> None:
        first = True
        async for job, output in outputs(jobs, client):
            if first and output.token_ids:
                metrics.ttft.observe(time.monotonic() - job.arrival)
                first = False
            choices[job.choice_index(output.index)].add(output)

    try:
        await until_disconnect(request, run())
    except RequestRejected as exc:
        metrics.rejected.labels(str(exc.status)).inc()
        raise APIError(exc.status, exc.message, code=exc.code,
                       headers={"Retry-After": str(exc.retry_after)} if exc.retry_after else None) from exc
    finally:
        lasts = [c.last for c in choices if c.last is not None]
        cached = [max((c.last.num_cached_tokens for c in choices[k * job0.n:(k + 1) * job0.n] if c.last), default=0)
                  for k in range(len(jobs))]
        observe(job0, metrics, _overall([c.last.finish_reason if c.last else None for c in choices]),
                 sum(last.num_output_tokens for last in lasts), sum(cached))
    errors = [c.last.error for c in choices if c.last is not None and c.last.error is not None]
    if errors:
        raise APIError(500, errors[0], code="generation_failed")
    return full_response(jobs, choices)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ``ClientDisconnected``
    (never the child task's ``CancelledError``, which would reach uvicorn as a crash)."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if not done and await request.is_disconnected():
                task.cancel()
                await asyncio.wait({task})  # let its cleanup (the engine abort) run
                raise ClientDisconnected()
        return await task
    finally:
        if not task.done():
            task.cancel()
