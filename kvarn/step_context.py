"""The per-forward context: what every layer of one forward shares, made once per forward.

A forward runs the same rows through every layer, and each layer's cache would otherwise build
the same small arrays again: the rows' RoPE offsets, the fp16 slots' write indices, the fused
kernels' launch plans, a prompt chunk's attention mask, the paged pool's step index (window
rows, commit plan, block tables, validity mask). The runner makes one ``StepContext`` per
forward and hands it to every layer's cache for the length of that forward:

    with forward_context(caches):          # engine/model_runner.py: each prompt or decode forward
        logits = model(tokens, cache=caches)   # layer 0 makes what the step needs, layers 1.. read it

Inside, a cache asks ``step_of(self).get(what, make)``: ``make()`` runs for the first layer that
asks and the others get its result. The context is detached when the forward has been built, so
nothing of one step is read by the next (a cache used outside a runner's forward, as in tests,
gets a fresh context on every ask: the same results, made again).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")


class StepContext:
    """What one forward's layers share (module docstring). ``what`` names a thing and, where
    layers could differ (heads, buffer shapes), what it depends on, e.g. ``("flat_rows", H, T)``."""

    __slots__ = ("_made",)

    def __init__(self) -> None:
        self._made: dict[Hashable, Any] = {}

    def get(self, what: Hashable, make: Callable[[], T]) -> T:
        if what not in self._made:
            self._made[what] = make()
        return self._made[what]


def step_of(cache: Any) -> StepContext:
    """The context ``cache`` runs in: its forward's, or a fresh one outside a runner's forward."""
    step = getattr(cache, "step", None)
    return step if step is not None else StepContext()


def _members(caches: Iterable[Any]) -> Iterator[Any]:
    """Every cache of a forward: each layer's cache and, for batches, the rows inside it."""
    for cache in caches:
        yield cache
        yield from getattr(cache, "rows", ())


@contextmanager
def forward_context(caches: Iterable[Any]) -> Iterator[StepContext]:
    """One forward's context attached to ``caches`` (per-layer caches, batches with their rows)
    while the forward is built, detached afterwards."""
    members = list(_members(caches))
    step = StepContext()
    for cache in members:
        cache.step = step
    try:
        yield step
    finally:
        for cache in members:
            cache.step = None
