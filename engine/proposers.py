"""Proposers: where drafted tokens come from, behind one small interface.

A proposer is asked, once a step, for drafts of up to ``k`` tokens for each of some decoding rows
(``Ask``: the row's request and its ``k``), and answers with what it has (``Draft``: fewer tokens,
or none, where it has no guess). After the verify, ``feedback`` says how many of a row's drafts
the target kept (a proposer with state per row drops the rest); ``forget`` lets go of a row that
ended. Proposers:

- ``NgramProposer`` (prompt lookup, ``--speculative ngram``): the longest suffix of the row's
  tokens (prompt and output) of ``ngram_max`` down to ``ngram_min`` tokens that occurred
  earlier, and the tokens that followed its latest earlier occurrence. Pure Python/NumPy.
- ``DraftProposer`` (``--speculative draft``, ``engine/draft_model.py``): a smaller model with the
  target's tokenizer, its own cache per row; it samples a sampled row's drafts and hands their
  distributions (``Draft.probs``) to the verify's rejection sampling (``engine/acceptance.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from engine.request import Request, RequestId


@dataclass(frozen=True)
class Ask:
    """A row that may verify up to ``k`` drafted tokens this step."""

    request: Request
    k: int


@dataclass(frozen=True)
class Draft:
    """Drafted tokens and, for a proposer that samples them, its distributions [len, vocab]
    (``probs``; None: deterministic drafts, one-hot for rejection sampling)."""

    tokens: tuple[int, ...]
    probs: Any = None


class Proposer(Protocol):
    """What the speculator asks of a proposer (``engine/speculator.py``)."""

    name: str

    def propose(self, asks: Sequence[Ask]) -> dict[RequestId, Draft]:
        """Drafts for some of ``asks`` (at most each ask's ``k`` tokens; rows without a guess are
        left out)."""

    def feedback(self, request_id: RequestId, num_accepted: int) -> None:
        """The target kept the first ``num_accepted`` of the row's last drafts."""

    def forget(self, request_id: RequestId) -> None:
        """The row ended: drop what is kept for it."""


class NgramProposer:
    """Prompt lookup over the row's prompt and output (as vLLM's ``ngram`` method): n from
    ``ngram_max`` down to ``ngram_min``, the first n whose suffix occurred before wins."""

    name = "ngram"

    def __init__(self, ngram_min: int = 2, ngram_max: int = 4) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError("the n-gram sizes need 1 <= ngram_min <= ngram_max")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, asks: Sequence[Ask]) -> dict[RequestId, Draft]:
        out = {}
        for ask in asks:
            tokens = lookup(ask.request.prompt_ids + ask.request.output_ids, ask.k, self.ngram_min, self.ngram_max)
            if tokens:
                out[ask.request.request_id] = Draft(tokens)
        return out

    def feedback(self, request_id: RequestId, num_accepted: int) -> None:
        """Nothing is kept per row."""

    def forget(self, request_id: RequestId) -> None:
        """Nothing is kept per row."""


def lookup(tokens: Sequence[int], k: int, ngram_min: int, ngram_max: int) -> tuple[int, ...]:
    """Up to ``k`` tokens following the latest earlier occurrence of the longest suffix of
    ``tokens`` of ``ngram_max`` .. ``ngram_min`` tokens (empty: no suffix occurred before).

        tokens  ... a b c X Y Z ... a b c |        suffix "a b c" (n = 3) seen before at i
                        i     i+n                  draft = tokens[i+n : i+n+k] = X Y Z
    """
    seq = np.asarray(tokens, dtype=np.int64)
    L = len(seq)
    for n in range(min(ngram_max, L - 1), ngram_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[: L - 1], n)  # starts 0 .. L - 1 - n
        hits = np.flatnonzero((windows == seq[L - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tuple(int(t) for t in seq[start: start + k])
    return ()
