"""The decode forward under ``mx.compile``: traced once per shape bucket, then replayed with no
Python graph building.

A decode step is planned by its storage as arrays (``kvarn.rows.plan_decode``: rows padded to a
bucket, block tables to a width bucket, commits to a count bucket; ``kvarn/decode_graph.py``)
and run as one pure function: the model's forward over per-layer caches made of the plan's and
the storage's arrays, returning the logits and the storage's new arrays. ``DecodeGraphs`` keeps
one compiled function per plan structure (``DecodePlan.static``), least recently used dropped
past ``capacity``; MLX traces each again only when an input's shape changes (the pool grows).
A step whose rows exceed the largest bucket runs the same function uncompiled (same results), as
does every step with ``compile=False`` (``--enforce-eager``). Steps the storage cannot plan as
arrays (a fused kernel plans its launch on the host, models with layers of their own) return
None: the runner runs the forward through the batch caches.

vLLM captures CUDA graphs per batch-size bucket for the same reason: on a GPU a decode step
built in Python costs ~10 us of host time per graph node, ~2,000 nodes a step at the 8B shape.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from kvarn.decode_graph import ROW_BUCKETS, DecodePlan, written
from kvarn.rows import plan_decode


class DecodeGraphs:
    """Compiled decode forwards of one model, by plan structure. ``traces`` counts forwards
    traced (the model's Python ran: a new structure or a new input shape), ``steps`` every step
    run here, ``eager`` those run uncompiled."""

    def __init__(self, model: Any, compile: bool = True, capacity: int = 32) -> None:
        self.model = model
        self.compile = compile
        self.capacity = capacity
        self._graphs: OrderedDict[tuple, Callable[..., Any]] = OrderedDict()
        self.traces = 0
        self.steps = 0
        self.eager = 0

    def __len__(self) -> int:
        return len(self._graphs)

    def logits(self, tokens: mx.array, caches: Sequence[Any]) -> mx.array | None:
        """The next-token logits [B, V] of a decode batch (``tokens`` [B, 1], one batch cache per
        layer), its storage written and its rows advanced; None where the storage cannot plan the
        step as arrays (nothing was done: run the forward through ``caches``)."""
        plan = plan_decode(caches)
        if plan is None:
            return None
        if plan.padded > plan.rows:
            tokens = mx.concatenate([tokens, mx.zeros((plan.padded - plan.rows, 1), tokens.dtype)])
        compiled = self.compile and plan.padded <= ROW_BUCKETS[-1]
        fn = self._graph(plan) if compiled else self._step(plan.build, plan.static)
        self.steps += 1
        self.eager += not compiled
        out = fn(tokens, plan.inputs, plan.state)
        plan.finish(list(out[1:]))
        return out[0][: plan.rows]

    def _graph(self, plan: DecodePlan) -> Callable[..., Any]:
        key = (plan.build, plan.static)
        fn = self._graphs.get(key)
        if fn is None:
            fn = self._graphs[key] = mx.compile(self._step(plan.build, plan.static))
            while len(self._graphs) > self.capacity:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        return fn

    def _step(self, build: Callable[..., list[Any]], static: tuple) -> Callable[..., tuple[mx.array, ...]]:
        def step(tokens: mx.array, inputs: dict[str, mx.array], state: list[mx.array]) -> tuple[mx.array, ...]:
            self.traces += 1  # Python runs this body only when MLX traces it (or when run uncompiled)
            caches = build(static, inputs, state)
            logits = self.model(tokens, cache=caches)[:, -1]
            return (logits, *written(caches))

        return step
