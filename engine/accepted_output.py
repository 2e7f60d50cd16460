"""A step's tokens of one row to one output delta: several when the row verified drafts.

``engine/output.py: advance`` accounts for one token at a time and decides whether it ends the
request (EOS, a stop string, ``max_tokens``, the context). A verifying row gains its accepted
drafts and one more token in one step; each goes through ``advance`` in order, as if it had come
from its own step, and the first that ends the request drops the ones after it.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.output import Delta, OutputState, advance
from engine.request import Request
from engine.step_types import SampledToken


def advance_tokens(state: OutputState, request: Request, tokens: Sequence[SampledToken],
                   eos_token_ids: frozenset[int], context_length: int) -> Delta:
    """One delta for ``tokens``, the newest ``len(tokens)`` of ``request.output_ids`` (the
    scheduler appended them); ``output_ids`` keeps those up to the one that ended the request."""
    if len(tokens) == 1:
        t = tokens[0]
        return advance(state, request, t.token_id, t.logprob, eos_token_ids, context_length, t.finish)
    del request.output_ids[len(request.output_ids) - len(tokens):]
    text, ids, logprobs = "", (), ()
    for t in tokens:
        request.output_ids.append(t.token_id)  # ``advance`` reads the output's length so far
        delta = advance(state, request, t.token_id, t.logprob, eos_token_ids, context_length, t.finish)
        text, ids, logprobs = text + delta.text, ids + delta.token_ids, logprobs + delta.logprobs
        if delta.finish_reason is not None:
            return Delta(text, ids, logprobs, delta.finish_reason)
    return Delta(text, ids, logprobs, None)
