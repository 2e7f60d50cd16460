"""Proposers: where drafted tokens come from, behind one small interface.

A proposer is asked, once a step, for drafts of up to ``k`` tokens for each of some decoding rows
(``Ask``: the row's request and its ``k``), and answers with what it has (``Draft``: fewer tokens,
or none, where it has no guess). After the verify, ``feedback`` says how many of a row's drafts
the target kept (a proposer with state per row drops the rest); ``forget`` lets go of a row that
ended. Proposers:

- ``NgramProposer`` (prompt lookup, ``--speculative ngram``): the longest suffix of the row's
  tokens (prompt and output), of ``ngram_min`` up to ``ngram_max`` tokens, that occurred
  earlier, and the tokens that followed its latest earlier occurrence, cut where an older
  occurrence of the same suffix continued otherwise. ``Draft.match`` carries the suffix's
  length: the speculator's evidence of how far such drafts hold (``engine/speculator.py``).
  NumPy over the row's tokens, a few tens of microseconds a row.
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
    (``probs``; None: deterministic drafts, one-hot for rejection sampling); ``match``: the
    length of the context that backs the guess (prompt lookup's matched suffix; 0: a proposer
    without one, e.g. a draft model)."""

    tokens: tuple[int, ...]
    probs: Any = None
    match: int = 0


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
    """Prompt lookup over the row's prompt and output (as vLLM's ``ngram`` method, with the
    longest match winning): the suffix of the row's tokens matched up to ``ngram_max`` tokens,
    at least ``ngram_min``."""

    name = "ngram"

    def __init__(self, ngram_min: int = 2, ngram_max: int = 4) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError("the n-gram sizes need 1 <= ngram_min <= ngram_max")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, asks: Sequence[Ask]) -> dict[RequestId, Draft]:
        out = {}
        for ask in asks:
            tokens, n = lookup(ask.request.prompt_ids + ask.request.output_ids, ask.k, self.ngram_min, self.ngram_max)
            if tokens:
                out[ask.request.request_id] = Draft(tokens, match=n)
        return out

    def feedback(self, request_id: RequestId, num_accepted: int) -> None:
        """Nothing is kept per row."""

    def forget(self, request_id: RequestId) -> None:
        """Nothing is kept per row."""


def lookup(tokens: Sequence[int], k: int, ngram_min: int, ngram_max: int) -> tuple[tuple[int, ...], int]:
    """(draft, n): up to ``k`` tokens following the latest earlier occurrence of the longest
    suffix of ``tokens`` of ``ngram_min`` .. ``ngram_max`` tokens, and that suffix's length n
    (((), 0): none occurred before). Where the next older occurrence of the same n tokens went on
    differently, the draft stops at the first token they disagree on (the history contradicts
    itself there), keeping at least one. A continuation that reaches the end of ``tokens`` goes on
    as the repeat it is (period ``L - start``).

        tokens  ... a b c X Y W ... a b c X Y Z ... a b c |   suffix "a b c" (n = 3)
                      older: X Y W     latest: X Y Z        draft = X Y (Z contradicted by W)
    """
    seq = np.asarray(tokens, dtype=np.int64)
    L = len(seq)
    if L < 2 or k < 1:
        return (), 0
    starts = np.flatnonzero(seq[: L - 1] == seq[L - 1]) + 1  # continuations of a 1-token match
    n = 1
    while n < ngram_max and len(starts):
        before = starts - 1 - n  # the token n before each continuation; the suffix's is seq[L - 1 - n]
        longer = starts[(before >= 0) & (seq[np.maximum(before, 0)] == seq[L - 1 - n])]
        if not len(longer):
            break
        starts, n = longer, n + 1
    if n < ngram_min or not len(starts):
        return (), 0
    start = int(starts[-1])
    draft = seq[start: start + k]
    if len(draft) < k:  # the continuation runs into the suffix itself: a repeat, period L - start
        draft = np.resize(draft, k)
    if len(starts) > 1:  # an older occurrence of the same suffix: keep the part both agree on
        older = seq[int(starts[-2]): int(starts[-2]) + len(draft)]
        differ = np.flatnonzero(older != draft[: len(older)])
        draft = draft[: max(int(differ[0]) if len(differ) else len(draft), 1)]
    return tuple(int(t) for t in draft), n
