"""Agent frameworks' own clients against ``kvarn serve`` on the bundled model: LangChain's
``ChatOpenAI`` (``bind_tools`` forced by name and with ``tool_choice="any"``, streamed and not;
``with_structured_output(method="json_schema")``), instructor (``Mode.TOOLS``,
``Mode.JSON_SCHEMA``), litellm (``completion`` with tools, streamed and not) and the ``openai`` SDK
with the fields clients add (``store``, ``metadata``, ``service_tier``, ``reasoning_effort``,
``chat_template_kwargs``). Every schema is a default Pydantic one (no ``additionalProperties``).

A case passes when the call succeeds and, for a forced or constrained one, its JSON validates
against the schema and ``finish_reason`` is ``tool_calls`` / ``stop``. Needs the ``clients`` extra
(``pip install -e ".[clients]"``); nothing leaves the machine (litellm reads its bundled price list).

    python3 bench/clients.py [--json results.json] [--markdown results.md]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches a price list at import otherwise

import jsonschema  # noqa: E402
from pydantic import BaseModel, Field  # noqa: E402

from kvarn_server import served  # noqa: E402

MODEL = "fixture-chat-29m-q8"
ASK = "Use the tool to check the weather in Berlin."
TRIP_ASK = "Plan a trip to Rome, as JSON."
FORCED_TOKENS = 200
ANY_TOKENS = 16 * 60  # tool_choice "any" may make up to 16 parallel calls (engine.MAX_FORCED_CALLS)


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: str = Field(description="The city, e.g. Paris")
    unit: Literal["celsius", "fahrenheit"] = "celsius"


class Place(BaseModel):
    city: str
    country: str


class Trip(BaseModel):
    """A trip: where to and for how long."""

    destination: Place
    nights: int = Field(ge=1, le=30)


@dataclass
class Result:
    client: str
    case: str
    ok: bool
    finish_reason: str | None
    completion_tokens: int | None
    seconds: float
    detail: str


@dataclass
class Outcome:
    finish_reason: str | None
    completion_tokens: int | None
    detail: str
    expect: str | None = None  # the finish_reason a forced or constrained call must end with


def valid(value: Any, model: type[BaseModel]) -> str:
    """``value`` (a dict or JSON text) checked against ``model``'s default schema; its JSON text."""
    data = json.loads(value) if isinstance(value, str) else value
    jsonschema.validate(data, model.model_json_schema())
    return json.dumps(data)


# --- LangChain ---
def langchain_case(base: str, choice: str, stream: bool) -> Outcome:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=base + "/v1", api_key="x", temperature=0, stream_usage=True,
                     max_tokens=FORCED_TOKENS if choice != "any" else ANY_TOKENS, max_retries=0)
    bound = llm.bind_tools([GetWeather], tool_choice=choice)
    if stream:
        message = None
        for chunk in bound.stream(ASK):
            message = chunk if message is None else message + chunk
    else:
        message = bound.invoke(ASK)
    assert message is not None and not message.invalid_tool_calls, message
    assert message.tool_calls and all(c["name"] == "GetWeather" for c in message.tool_calls), message
    args = [valid(c["args"], GetWeather) for c in message.tool_calls]
    usage = message.usage_metadata or {}
    return Outcome(message.response_metadata.get("finish_reason"), usage.get("output_tokens"),
                   f"{len(args)} call(s): {args[0]}", "tool_calls")


def langchain_structured(base: str) -> Outcome:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=base + "/v1", api_key="x", temperature=0, max_tokens=FORCED_TOKENS,
                     max_retries=0)
    out = llm.with_structured_output(Trip, method="json_schema", include_raw=True).invoke(TRIP_ASK)
    raw, parsed = out["raw"], out["parsed"]
    assert out["parsing_error"] is None and isinstance(parsed, Trip), out
    return Outcome(raw.response_metadata.get("finish_reason"), (raw.usage_metadata or {}).get("output_tokens"),
                   valid(raw.content, Trip), "stop")


# --- instructor ---
def instructor_case(base: str, mode_name: str) -> Outcome:
    import instructor
    from openai import OpenAI

    client = instructor.from_openai(OpenAI(base_url=base + "/v1", api_key="x", max_retries=0),
                                    mode=getattr(instructor.Mode, mode_name))
    model, completion = client.chat.completions.create_with_completion(
        model=MODEL, response_model=Trip, messages=[{"role": "user", "content": TRIP_ASK}], temperature=0,
        max_tokens=FORCED_TOKENS, max_retries=0)
    choice = completion.choices[0]
    text = choice.message.tool_calls[0].function.arguments if mode_name == "TOOLS" else choice.message.content
    assert isinstance(model, Trip)
    return Outcome(choice.finish_reason, completion.usage.completion_tokens, valid(text, Trip),
                   "tool_calls" if mode_name == "TOOLS" else "stop")


# --- litellm ---
def litellm_case(base: str, stream: bool) -> Outcome:
    import litellm

    tool = {"type": "function", "function": {"name": "GetWeather", "description": GetWeather.__doc__,
                                             "parameters": GetWeather.model_json_schema()}}
    kwargs = dict(model="openai/" + MODEL, api_base=base + "/v1", api_key="x", temperature=0,
                  messages=[{"role": "user", "content": ASK}], tools=[tool], max_tokens=FORCED_TOKENS,
                  tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    if not stream:
        response = litellm.completion(**kwargs)
        choice = response.choices[0]
        args = valid(choice.message.tool_calls[0].function.arguments, GetWeather)
        return Outcome(choice.finish_reason, response.usage.completion_tokens, args, "tool_calls")
    arguments, finish, tokens = "", None, None
    for chunk in litellm.completion(**kwargs, stream=True, stream_options={"include_usage": True}):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            arguments += delta.function.arguments or ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
        usage = getattr(chunk, "usage", None)
        tokens = usage.completion_tokens if usage else tokens
    return Outcome(finish, tokens, valid(arguments, GetWeather), "tool_calls")


# --- the openai SDK with the fields clients add ---
FIELDS: dict[str, dict[str, Any]] = {
    "store+metadata": {"store": True, "metadata": {"run": "clients"}},
    "service_tier": {"service_tier": "auto"},
    "reasoning_effort": {"reasoning_effort": "low"},
    "chat_template_kwargs": {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
    "all of them": {"store": True, "metadata": {"run": "clients"}, "service_tier": "auto", "reasoning_effort": "low",
                    "user": "u", "safety_identifier": "s", "prompt_cache_key": "k", "verbosity": "low",
                    "modalities": ["text"], "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
}


def fields_case(base: str, fields: dict[str, Any]) -> Outcome:
    from openai import OpenAI

    client = OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0,
                                           max_tokens=8, **fields)
    return Outcome(reply.choices[0].finish_reason, reply.usage.completion_tokens,
                   repr(reply.choices[0].message.content)[:60])


def cases(base: str) -> list[tuple[str, str, Callable[[], Outcome]]]:
    out: list[tuple[str, str, Callable[[], Outcome]]] = []
    for choice, label in (("GetWeather", "bind_tools tool_choice=<name>"), ("any", 'bind_tools tool_choice="any"')):
        for stream in (False, True):
            out.append(("langchain-openai", label + (" stream" if stream else ""),
                        lambda c=choice, s=stream: langchain_case(base, c, s)))
    out.append(("langchain-openai", 'with_structured_output(method="json_schema")', lambda: langchain_structured(base)))
    for mode in ("TOOLS", "JSON_SCHEMA"):
        out.append(("instructor", f"Mode.{mode}", lambda m=mode: instructor_case(base, m)))
    for stream in (False, True):
        out.append(("litellm", "completion tools" + (" stream" if stream else ""),
                    lambda s=stream: litellm_case(base, s)))
    for name, fields in FIELDS.items():
        out.append(("openai", f"fields: {name}", lambda f=fields: fields_case(base, f)))
    return out


def run_case(client: str, case: str, fn: Callable[[], Outcome]) -> Result:
    start = time.perf_counter()
    try:
        outcome = fn()
    except Exception as exc:  # noqa: BLE001 - a failing client is a row of the table, not the end of the run
        return Result(client, case, False, None, None, time.perf_counter() - start,
                      f"{type(exc).__name__}: {str(exc)[:200]}")
    ok = outcome.expect is None or outcome.finish_reason == outcome.expect
    detail = outcome.detail if ok else f"finish_reason {outcome.finish_reason}, expected {outcome.expect}"
    return Result(client, case, ok, outcome.finish_reason, outcome.completion_tokens, time.perf_counter() - start,
                  detail)


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("langchain-openai", "langchain-core", "instructor", "litellm", "openai"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "not installed"
    return found


def markdown(results: list[Result], packages: dict[str, str]) -> str:
    lines = ["| client | case | result | finish_reason | tokens | s | detail |", "|---|---|---|---|---|---|---|"]
    for r in results:
        detail = r.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r.client} | {r.case} | {'pass' if r.ok else 'FAIL'} | {r.finish_reason or '-'} | "
                     f"{r.completion_tokens if r.completion_tokens is not None else '-'} | {r.seconds:.1f} | "
                     f"{detail} |")
    passed = sum(r.ok for r in results)
    lines += ["", f"{passed}/{len(results)} passed; " + ", ".join(f"{k} {v}" for k, v in packages.items())]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    parser.add_argument("--markdown", type=Path, help="write the markdown table here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, served([], Path(tmp) / "server.log") as server:
        results = [run_case(client, case, fn) for client, case, fn in cases(server.base)]
    packages = versions()
    table = markdown(results, packages)
    sys.stdout.write(table)
    if args.markdown:
        args.markdown.write_text(table)
    if args.json:
        args.json.write_text(json.dumps({"model": MODEL, "packages": packages,
                                         "results": [asdict(r) for r in results]}, indent=2) + "\n")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
