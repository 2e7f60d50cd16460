"""Grammar constraints: what a request carries to force its output into a grammar (llguidance).

How the server attaches one to a request (the API for ``response_format``, vLLM's ``guided_*``
fields and ``tool_choice`` required / named):

    from engine import ConstraintError, GrammarSpec

    spec = GrammarSpec.json_schema(schema)  # or .json_object(), .lark(text), .grammar(lark or GBNF),
                                            #    .regex(pattern), .choice([...])
    try:
        constraint = await client.compile_constraint(spec)   # EngineClient: on a thread, off the event loop
    except ConstraintError as exc:                            # invalid or unsupported: a 400, before any token
        raise APIError(400, str(exc), param="response_format", code="invalid_grammar")
    params = dataclasses.replace(params, constraint=constraint)   # SamplingParams.constraint
    ... client.generate(prompt_ids, params, ...)                  # as any request

A tool call in the bundled model's Hermes format, forced with a lark grammar whose JSON part is
a JSON schema (llguidance's ``%json`` inline syntax; ``tagged_json_lark`` writes it):

    lark = tagged_json_lark(call_schema, begin="<tool_call>\\n", end="\\n</tool_call>")
    constraint = await client.compile_constraint(GrammarSpec.lark(lark))

where ``call_schema`` is e.g. ``{"type": "object", "properties": {"name": {"const": "get_weather"},
"arguments": <the tool's parameters>}, "required": ["name", "arguments"]}`` (several tools:
``{"anyOf": [...]}``; several calls: ``max_count``).

Contract:
- A ``GrammarSpec`` is plain data (hashable; nothing compiled). ``compile`` turns it into a
  ``Constraint`` against the served model's tokenizer, or raises ``ConstraintError`` with a
  message fit for the client (schema errors, unsatisfiable schemas, unsupported keywords, bad
  lark or regex). Compiling runs the grammar's first mask once, so a grammar that cannot start
  fails here, not mid-stream. Compiled constraints are cached by spec (agents resend the same
  schema every turn).
- A ``Constraint`` is immutable once made: its matcher stays in the initial state; each row
  (each of ``n`` choices) runs its own ``new_matcher()`` copy (``engine/sampler.py: RowGrammars``).
- JSON is generated compactly with ``", "`` and ``": "`` separators and no other whitespace
  (``JSON_OPTIONS``): a small model cannot then loop on whitespace, and the text is what
  ``json.dumps`` writes.
- The EOS tokens of the grammar are the model's (``tokenizer.eos_token_ids``): a constrained
  row may sample EOS exactly when its grammar accepts.
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from llguidance import LLMatcher, LLTokenizer, grammar_from
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

logger = logging.getLogger(__name__)

GrammarKind = Literal["json_schema", "json_object", "lark", "grammar", "regex", "choice"]
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_TOKEN_BYTES = 1024  # llguidance's token trie holds tokens up to 1,024 bytes (PARENT_BITS = 10)
_CACHE_SIZE = 64


class ConstraintError(ValueError):
    """A grammar that cannot be used: invalid, unsatisfiable or unsupported. The message is the
    client's (a 400 in OpenAI's shape)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain a request's output to, before compilation. ``source`` is the grammar's
    text (a schema as JSON, its keys in the client's order: properties are written in schema
    order), so equal specs hash equal and share a compilation."""

    kind: GrammarKind
    source: str

    @staticmethod
    def json_schema(schema: Any) -> GrammarSpec:
        """Output one JSON value valid under ``schema`` (a JSON Schema object: a dict), its
        objects closed as ``closed_schema`` says."""
        if not isinstance(schema, dict):
            raise ConstraintError("The JSON schema must be a JSON object.")
        try:
            return GrammarSpec("json_schema", json.dumps(closed_schema(schema), allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise ConstraintError(f"The JSON schema is not valid JSON: {exc}") from exc
        except RecursionError as exc:
            raise ConstraintError("The JSON schema is nested too deeply.") from exc

    @staticmethod
    def json_object() -> GrammarSpec:
        """Output any JSON object (``response_format: {"type": "json_object"}``)."""
        return GrammarSpec("json_object", '{"type": "object"}')

    @staticmethod
    def lark(text: str) -> GrammarSpec:
        """Output text of llguidance's lark grammar (``%json {...}`` embeds a JSON schema)."""
        return GrammarSpec("lark", text)

    @staticmethod
    def grammar(text: str) -> GrammarSpec:
        """A lark grammar, or a GBNF one (llama.cpp's format, converted by llguidance)."""
        return GrammarSpec("grammar", text)

    @staticmethod
    def regex(pattern: str) -> GrammarSpec:
        """Output text matching the regular expression ``pattern`` as a whole."""
        return GrammarSpec("regex", pattern)

    @staticmethod
    def choice(options: Sequence[str]) -> GrammarSpec:
        """Output exactly one of ``options``."""
        if not options or not all(isinstance(o, str) for o in options):
            raise ConstraintError("choice needs a non-empty list of strings.")
        return GrammarSpec("choice", json.dumps(list(options)))


def tagged_json_lark(schema: dict[str, Any], begin: str, end: str, separator: str = "\n",
                     max_count: int | None = 1) -> str:
    """A lark grammar for 1 to ``max_count`` (None: any number of) JSON values valid under
    ``schema``, each between ``begin`` and ``end``, joined by ``separator`` (e.g. Hermes tool
    calls: ``<tool_call>\\n``, ``\\n</tool_call>``). The JSON is written as
    ``GrammarSpec.json_schema`` writes it (``JSON_OPTIONS``)."""
    if max_count is not None and max_count < 1:
        raise ValueError("max_count must be >= 1 (or None)")
    body = json.dumps({**schema, "x-guidance": JSON_OPTIONS})
    repeat = "*" if max_count is None else f"{{0,{max_count - 1}}}"
    rest = f" ({json.dumps(separator)} item){repeat}" if max_count != 1 else ""
    return f"start: item{rest}\nitem: {json.dumps(begin)} %json {body} {json.dumps(end)}\n"


# keywords that let an object hold keys beyond ``properties`` (an object saying any of them is left as it is)
_OPEN_KEYWORDS = ("additionalProperties", "unevaluatedProperties", "patternProperties")
# keywords applied together with the schema beside them: their keys may belong to it, and its keys to them
_CONJUNCTIVE = ("allOf", "anyOf", "oneOf", "$ref", "if", "then", "else", "dependentSchemas")
_SCHEMA_MAPS = ("properties", "patternProperties", "dependentSchemas")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_VALUES = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
                  "contains", "not", "then", "else")
_DEFS = ("$defs", "definitions")


def closed_schema(schema: Any) -> Any:
    """A copy of ``schema`` whose object schemas are closed: one that lists ``properties`` and
    says nothing of ``additionalProperties``, ``unevaluatedProperties`` or ``patternProperties``
    gets ``additionalProperties: false`` (no key beyond its properties, so no duplicate either:
    llguidance writes a closed object's keys in schema order, each at most once). vLLM's default
    backend reads such schemas the same way; llguidance would otherwise let a model add keys
    until ``max_tokens``. Objects nested anywhere are closed (``properties``, ``items``,
    ``prefixItems``, ``anyOf``/``oneOf`` branches, ``$defs``/``definitions``, schema-valued
    ``additionalProperties``, ``not``, ``then``/``else``, ``dependentSchemas``...), except where
    closing would refuse keys the schema allows: an object beside ``allOf``, ``anyOf``, ``oneOf``,
    ``$ref``, ``if``/``then``/``else`` or ``dependentSchemas`` (those may bring keys of their own),
    the branches of an ``allOf`` with several branches, ``then``/``else`` and ``dependentSchemas``
    (applied together with their parent) and the schemas such a branch names by a local ``$ref``. An ``if``
    is a condition, left as it is; an object without ``properties`` stays free-form. The input is
    never modified."""
    if not isinstance(schema, dict):
        return schema
    open_refs: set[str] = set()
    _collect_conjunctive_refs(schema, open_refs)
    return _close(schema, open_refs, conjunct=False)


def _conjunctive_branches(schema: dict[str, Any]) -> list[Any]:
    """The subschemas applied together with ``schema``'s own keys (each must allow the others' keys)."""
    branches: list[Any] = []
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        branches += schema["allOf"]
    if "properties" in schema:
        branches += [b for key in ("anyOf", "oneOf") if isinstance(schema.get(key), list) for b in schema[key]]
    branches += [schema[key] for key in ("then", "else") if key in schema]
    if isinstance(schema.get("dependentSchemas"), dict):
        branches += list(schema["dependentSchemas"].values())
    return branches


def _subschemas(schema: dict[str, Any]) -> list[Any]:
    """Every schema directly inside ``schema`` that ``_close`` walks (``if`` is not walked)."""
    subs = [schema[key] for key in _SCHEMA_VALUES if isinstance(schema.get(key), dict)]
    subs += [sub for key in (*_SCHEMA_MAPS, *_DEFS) if isinstance(schema.get(key), dict) for sub in schema[key].values()]
    subs += [sub for key in (*_SCHEMA_LISTS, "items") if isinstance(schema.get(key), list) for sub in schema[key]]
    return subs


def _collect_conjunctive_refs(schema: Any, refs: set[str]) -> None:
    """The ``$ref`` targets named by branches applied together with their parent."""
    if not isinstance(schema, dict):
        return
    refs.update(b["$ref"] for b in _conjunctive_branches(schema) if isinstance(b, dict) and isinstance(b.get("$ref"), str))
    for sub in _subschemas(schema):
        _collect_conjunctive_refs(sub, refs)


def _close(schema: Any, open_refs: set[str], *, conjunct: bool, path: str = "#") -> Any:
    """``schema`` (at JSON pointer ``path``) closed; ``conjunct``: applied together with its
    parent, so its own keys stay open."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    together = {id(b) for b in _conjunctive_branches(schema)}

    def sub(value: Any, *keys: str | int) -> Any:
        at = path + "".join("/" + str(k).replace("~", "~0").replace("/", "~1") for k in keys)
        return _close(value, open_refs, conjunct=id(value) in together or at in open_refs, path=at)

    for key in _SCHEMA_VALUES:
        if isinstance(schema.get(key), dict):
            out[key] = sub(schema[key], key)
    for key in (*_SCHEMA_MAPS, *_DEFS):
        if isinstance(schema.get(key), dict):
            out[key] = {name: sub(value, key, name) for name, value in schema[key].items()}
    for key in (*_SCHEMA_LISTS, "items"):  # "items" as a list: draft 4-7 tuples
        if isinstance(schema.get(key), list):
            out[key] = [sub(value, key, i) for i, value in enumerate(schema[key])]
    is_open = any(key in schema for key in (*_OPEN_KEYWORDS, *_CONJUNCTIVE))
    if not conjunct and not is_open and isinstance(schema.get("properties"), dict):
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True, eq=False)
class Constraint:
    """A compiled grammar for the served model. ``matcher`` is the prototype in its initial
    state, never advanced; rows take ``new_matcher()`` copies."""

    spec: GrammarSpec
    matcher: LLMatcher
    compile_s: float  # seconds the compilation took (0.0 when served from the cache)
    mask_vocab: int  # llguidance's vocabulary size: a mask's width in tokens (>= the model's logits)

    def new_matcher(self) -> LLMatcher:
        return self.matcher.deep_copy()


class ConstraintCompiler:
    """Compiles ``GrammarSpec``s against one tokenizer; thread-safe (any thread, not the event
    loop: a complex grammar takes up to a second). The llguidance tokenizer is built on first
    use (tens of ms for the bundled model, about a second for a 150k vocabulary)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        """``tokenizer``: mlx-lm's ``TokenizerWrapper`` (a fast Hugging Face tokenizer inside);
        ``vocab_size``: the model's logits width."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._ll: LLTokenizer | None = None
        self._cache: OrderedDict[GrammarSpec, Constraint] = OrderedDict()

    def lltokenizer(self) -> LLTokenizer:
        with self._lock:
            if self._ll is None:
                self._ll = make_lltokenizer(self._tokenizer, self.vocab_size)
            return self._ll

    def compile(self, spec: GrammarSpec) -> Constraint:
        """The compiled constraint of ``spec`` (cached), or ``ConstraintError``."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return replace(self._cache[spec], compile_s=0.0)
        ll = self.lltokenizer()
        start = time.perf_counter()
        matcher = LLMatcher(ll, _grammar_text(spec), log_level=0)
        error = matcher.get_error() if matcher.is_error() else ""
        if not error:  # the first mask: a grammar that cannot even start fails now, not mid-stream
            mask = allocate_token_bitmask(1, ll.vocab_size)
            fill_next_token_bitmask(matcher, mask, 0)
            if matcher.is_error():
                error = matcher.get_error()
            elif not mask[0, : (self.vocab_size + 31) // 32].any():
                error = "no token of this model can start the output"
        if error:
            raise ConstraintError(f"Invalid {_NAMES[spec.kind]}: {_first_line(error)}")
        constraint = Constraint(spec, matcher, time.perf_counter() - start, ll.vocab_size)
        with self._lock:
            self._cache[spec] = constraint
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return constraint


_NAMES = {"json_schema": "JSON schema", "json_object": "JSON object grammar", "lark": "grammar",
          "grammar": "grammar", "regex": "regular expression", "choice": "choice"}


def _first_line(error: str) -> str:
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return " ".join(lines[:4])[:500] if lines else "the grammar was refused"


def _grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar for a spec (its compiler raises ValueError on malformed input)."""
    try:
        if spec.kind in ("json_schema", "json_object"):
            return LLMatcher.grammar_from_json_schema(spec.source, defaults=JSON_OPTIONS)
        return grammar_from(spec.kind, spec.source)
    except ValueError as exc:
        raise ConstraintError(f"Invalid {_NAMES[spec.kind]}: {_first_line(str(exc))}") from exc


def make_lltokenizer(tokenizer: Any, vocab_size: int) -> LLTokenizer:
    """llguidance's view of the model's tokenizer: every token's bytes and the model's EOS ids.

    Tokens longer than ``MAX_TOKEN_BYTES`` (the bundled model has a few 1-3 KB runs of
    box-drawing characters) exceed llguidance's token trie; in its copy of the tokenizer they
    are dropped from the BPE vocabulary (with the merges that name them), so a constrained row
    never samples them: the same bytes remain reachable through shorter tokens."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ConstraintError("Constrained decoding needs a fast (Rust) Hugging Face tokenizer; this model has none.")
    backend = copy.copy(backend)
    backend.no_padding()
    backend.no_truncation()
    config = json.loads(backend.to_str())
    model = config.get("model", {})
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        long = {text for text in vocab if len(text.encode()) > MAX_TOKEN_BYTES}
        if long:
            for text in long:
                del vocab[text]
            model["merges"] = [m for m in model.get("merges", []) if not _merge_names(m, long)]
            logger.info("constrained decoding: %d tokens over %d bytes are never sampled under a grammar",
                        len(long), MAX_TOKEN_BYTES)
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
    n_vocab = max(vocab_size, len(hf))
    return LLTokenizer(json.dumps(config), n_vocab=n_vocab, eos_token=eos)


def _merge_names(merge: Any, tokens: set[str]) -> bool:
    """Whether a BPE merge (``"a b"`` or ``["a", "b"]``) uses or makes one of ``tokens``."""
    parts = merge.split(" ", 1) if isinstance(merge, str) else list(merge)
    return any(p in tokens for p in parts) or "".join(parts) in tokens
