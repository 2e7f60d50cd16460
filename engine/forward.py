"""Prompt forwards that compute the LM head only where a token is sampled.

A prompt chunk needs logits at one position per row (its last token, and only in a prompt's last
chunk); the model's ``__call__`` projects every position onto the vocabulary. ``Forward`` runs
the model's body (``model.model``) and applies its head (``lm_head``, or the tied embedding's
``as_linear``) to the positions asked for, as mlx-lm's own prompt processing avoids the head by
never evaluating it. Whether a model splits so is checked once, at construction, on a fresh cache:
the split must give the model's own logits (a model that post-processes them, e.g. with a
soft cap, fails the check and runs whole).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

logger = logging.getLogger(__name__)


def _candidate(model: Any) -> tuple[Callable, Callable] | None:
    body = getattr(model, "model", None)
    if not callable(body):
        return None
    head = getattr(model, "lm_head", None)
    if head is None:
        embed = getattr(body, "embed_tokens", None)
        head = getattr(embed, "as_linear", None)
    return (body, head) if callable(head) else None


def split_head(model: Any) -> tuple[Callable, Callable] | None:
    """(body, head) such that ``head(body(x, cache=c))`` is ``model(x, cache=c)``, checked on a
    three-token probe over a fresh mlx-lm cache; None where the model does not split so."""
    split = _candidate(model)
    if split is None:
        return None
    body, head = split
    probe = mx.array([[1, 2, 3]], dtype=mx.int32)
    try:
        whole = model(probe, cache=make_prompt_cache(model))
        parts = head(body(probe, cache=make_prompt_cache(model)))
        mx.eval(whole, parts)
    except Exception:  # a model whose body wants other arguments: it runs whole
        logger.debug("the model's head does not split off", exc_info=True)
        return None
    if whole.shape != parts.shape or not mx.allclose(whole, parts, rtol=1e-5, atol=1e-5).item():
        return None
    return split


class Forward:
    """The model's prompt forward with logits at chosen positions only."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.split = split_head(model)

    def hidden(self, tokens: mx.array, cache: Sequence[Any]) -> mx.array:
        """The body's output [B, L, hidden] (the head not applied); ``logits_at`` projects it."""
        if self.split is None:
            return self.model(tokens, cache=cache)
        return self.split[0](tokens, cache=cache)

    def logits_at(self, hidden: mx.array, positions: Sequence[int]) -> mx.array:
        """Logits [B, vocab] of row b at position ``positions[b]`` of ``hidden`` (from ``hidden``)."""
        B, L = hidden.shape[:2]
        if all(p == L - 1 for p in positions):
            picked = hidden[:, L - 1:]
        else:
            picked = hidden[mx.arange(B), mx.array(list(positions), dtype=mx.int32)][:, None]
        return (picked if self.split is None else self.split[1](picked))[:, 0]

    def all_logits(self, hidden: mx.array) -> mx.array:
        """Every position's logits [B, L, vocab] from ``hidden``."""
        return hidden if self.split is None else self.split[1](hidden)
