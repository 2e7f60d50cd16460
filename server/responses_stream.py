"""One response built from the chat path's steps: as the stream's semantic events and as the
final ``response`` object (a non-streamed response is the same run with its events unsent).

The events, each with ``type`` and a ``sequence_number`` counting from 0, in the order the
SDK's ``responses.stream()`` assembles them:

    response.created, response.in_progress
    per output item:  response.output_item.added
      reasoning:      content_part.added, reasoning_text.delta..., reasoning_text.done, content_part.done
      message:        content_part.added, output_text.delta..., output_text.done, content_part.done
      function_call:  function_call_arguments.delta, function_call_arguments.done
                      response.output_item.done
    response.completed | response.incomplete | (error, response.failed)

Items follow the model's output: reasoning, then the message, then its calls; a new kind of text
closes the item before it. A call arrives whole (the parser reads it whole), so its arguments
are one delta.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

from engine import FinishReason, TokenLogprob
from server.chat import ChatStep
from server.responses_input import new_id

Event = dict[str, Any]


def output_logprobs(entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """Engine logprob entries as ``output_text.logprobs`` (the EOS that ended the text left out)."""
    def item(text: str, raw: bytes, logprob: float | None) -> dict[str, Any]:
        return {"token": text, "bytes": list(raw), "logprob": logprob}

    return [{**item(e.text, e.raw, e.logprob),
             "top_logprobs": [item(text, raw, lp) for (_, lp), (text, raw) in zip(e.top, e.top_text)]}
            for e in entries if not e.eos and e.logprob is not None]


class ResponseRun:
    """The running response: ``response`` is the object (status ``in_progress`` until ``finish``
    or ``fail``), each method returns the events it adds. ``logprobs``: output text carries
    log-probabilities (``include`` / ``top_logprobs``)."""

    def __init__(self, response: dict[str, Any], logprobs: bool = False,
                 namespaces: dict[str, str] | None = None) -> None:
        self.response = response
        self.logprobs = logprobs
        self.namespaces = namespaces or {}  # function name -> its namespace tool's name
        self.reasoning_text = ""
        self._sequence = 0
        self._open: dict[str, Any] | None = None  # the item whose text is still arriving

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._sequence, **copy.deepcopy(fields)}
        self._sequence += 1
        return event

    def _at(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.response["output"].index(item)}

    def start(self) -> list[Event]:
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    def feed(self, step: ChatStep) -> list[Event]:
        """The events of one chat step: its reasoning, its content, then its whole calls."""
        events: list[Event] = []
        if step.parsed.reasoning:
            self.reasoning_text += step.parsed.reasoning
            events += self._text("reasoning", step.parsed.reasoning, [])
        content_logprobs = output_logprobs(step.output.logprobs) if self.logprobs else []
        if step.parsed.content:
            events += self._text("message", step.parsed.content, content_logprobs)
        for call in step.calls:
            events += self._close("completed")
            events += self._call(call)
        return events

    def _text(self, kind: str, delta: str, logprobs: list[dict[str, Any]]) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            events += self._open_item(kind)
        item = self._open
        assert item is not None
        part = item["content"][0]
        part["text"] += delta
        if kind == "message":
            if self.logprobs:
                part["logprobs"] += logprobs
            events.append(self._event("response.output_text.delta", **self._at(item), content_index=0, delta=delta,
                                      logprobs=logprobs))
        else:
            events.append(self._event("response.reasoning_text.delta", **self._at(item), content_index=0,
                                      delta=delta))
        return events

    def _open_item(self, kind: str) -> list[Event]:
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
            if self.logprobs:
                part["logprobs"] = []
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.response["output"].append(item)
        self._open = item
        events = [self._event("response.output_item.added", output_index=len(self.response["output"]) - 1,
                              item=item)]
        item["content"].append(part)
        events.append(self._event("response.content_part.added", **self._at(item), content_index=0, part=part))
        return events

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item["status"] = status
        part, at = item["content"][0], self._at(item)
        if item["type"] == "message":
            done = self._event("response.output_text.done", **at, content_index=0, text=part["text"],
                               logprobs=part.get("logprobs", []))
        else:
            done = self._event("response.reasoning_text.done", **at, content_index=0, text=part["text"])
        return [done, self._event("response.content_part.done", **at, content_index=0, part=part),
                self._event("response.output_item.done", output_index=at["output_index"], item=item)]

    def _call(self, call: dict[str, Any]) -> list[Event]:
        function = call["function"]
        item = {"id": new_id("fc"), "type": "function_call", "call_id": call["id"], "name": function["name"],
                "arguments": "", "status": "in_progress"}
        if function["name"] in self.namespaces:
            item["namespace"] = self.namespaces[function["name"]]
        self.response["output"].append(item)
        events = [self._event("response.output_item.added", output_index=len(self.response["output"]) - 1,
                              item=item)]
        item["arguments"] = function["arguments"]
        events.append(self._event("response.function_call_arguments.delta", **self._at(item),
                                  delta=function["arguments"]))
        events.append(self._event("response.function_call_arguments.done", **self._at(item),
                                  arguments=function["arguments"], name=function["name"]))
        item["status"] = "completed"
        events.append(self._event("response.output_item.done", output_index=self._at(item)["output_index"],
                                  item=item))
        return events

    def finish(self, step: ChatStep, reasoning_tokens: int) -> list[Event]:
        """The last events: the open item closed, then ``response.completed`` (or
        ``response.incomplete`` when ``max_output_tokens`` cut the output short)."""
        if step.reason not in (FinishReason.STOP, FinishReason.LENGTH):  # aborted, or a grammar's dead end
            return self.fail("generation_failed", f"The generation ended without an answer ({step.finish}).")
        cut = step.reason is FinishReason.LENGTH
        events = self._close("incomplete" if cut else "completed")
        if not self.response["output"]:  # nothing at all (or only a call cut short): an empty message
            events += self._open_item("message") + self._close("incomplete" if cut else "completed")
        self.response.update(
            status="incomplete" if cut else "completed", completed_at=None if cut else int(time.time()),
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            usage={"input_tokens": step.prompt_tokens,
                   "input_tokens_details": {"cached_tokens": step.cached_tokens, "cache_write_tokens": 0},
                   "output_tokens": step.output_tokens,
                   "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                   "total_tokens": step.prompt_tokens + step.output_tokens})
        return events + [self._event("response.incomplete" if cut else "response.completed", response=self.response)]

    def fail(self, code: str | None, message: str) -> list[Event]:
        """A failure after the stream started: ``error``, then ``response.failed`` with what was made."""
        events = self._close("incomplete")
        self.response.update(status="failed", error={"code": "server_error", "message": message})
        return events + [self._event("error", code=code, message=message, param=None),
                         self._event("response.failed", response=self.response)]


def response_skeleton(body: Any, response_id: str, model: str) -> dict[str, Any]:
    """The ``response`` object before any output: its identity and the request's settings echoed
    (``body`` is a ``ResponsesRequest``)."""
    text = body.text.model_dump(by_alias=True, exclude_none=True) if body.text is not None else {}
    return {
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "completed_at": None, "error": None, "incomplete_details": None, "instructions": body.instructions,
        "model": model, "output": [], "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p, "top_logprobs": body.top_logprobs or 0,
        "tool_choice": _dump(body.tool_choice) if body.tool_choice is not None else "auto",
        "tools": [_tool(t) for t in body.tools or ()],
        "max_output_tokens": body.max_output_tokens, "max_tool_calls": body.max_tool_calls,
        "previous_response_id": body.previous_response_id, "metadata": dict(body.metadata or {}),
        "store": body.store, "background": False, "text": {"format": {"type": "text"}, **text},
        "reasoning": body.reasoning.model_dump(exclude_none=True) if body.reasoning is not None else
        {"effort": None, "summary": None},
        "truncation": body.truncation or "disabled", "user": body.user,
        "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key,
        "prompt_cache_retention": body.prompt_cache_retention,
        "service_tier": "default" if body.service_tier in (None, "auto") else body.service_tier, "usage": None,
    }


def _tool(tool: Any) -> dict[str, Any]:
    if tool.type == "namespace":
        return {**_dump(tool), "tools": [_tool(t) for t in tool.tools]}
    if tool.type != "function":  # a declared web search, echoed as sent
        return _dump(tool)
    return {**_dump(tool), "parameters": tool.parameters, "strict": tool.strict}


def _dump(value: Any) -> Any:
    return value if isinstance(value, str) else value.model_dump(by_alias=True, exclude_none=True)
