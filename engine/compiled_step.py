"""The decode forward under ``mx.compile``: traced once per shape bucket, then replayed with no
Python graph building.

A decode step is planned by its storage as arrays (``kvarn.rows.plan_decode``: rows padded to a
bucket, block tables to a width bucket, commits to a count bucket; ``kvarn/decode_graph.py``)
and run as one pure function: the model's forward over per-layer caches made of the plan's and
the storage's arrays, returning the logits and the storage's new arrays. ``DecodeGraphs`` keeps
one compiled function per plan structure (``DecodePlan.static``), least recently used dropped
past ``capacity``; MLX traces each again only when an input's shape changes (the pool grows).
A step whose rows exceed the largest bucket runs the same function uncompiled (same results), as
does every step with ``compile=False`` (``--enforce-eager``).

A structure is compiled once it recurs: an ordinary step at its first use (tracing one costs
0.04-0.3 s on a CPU, and it is replayed at every step of its bucket), a step that commits KVarN
tiles only after ``commit_after`` uses. A commit graph holds the quantizer (~200 operations a
layer): tracing and compiling one took 1.7-3.5 s here, and at one user's pace a given commit
structure (rows, table width, tiles) comes back a few times per context, so it runs uncompiled;
on a busy server every step commits someone's tile and the same structures recur constantly. Where
the fused commit kernel quantizes (CUDA, Metal: one launch a layer, nothing to fuse), a commit
structure compiles at its first use like any other. Steps the storage cannot plan as
arrays (a fused kernel plans its launch on the host, models with layers of their own) return
None: the runner runs the forward through the batch caches.

vLLM captures CUDA graphs per batch-size bucket for the same reason: on a GPU a decode step
built in Python costs ~10 us of host time per graph node, ~2,000 nodes a step at the 8B shape.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from kvarn.decode_graph import ROW_BUCKETS, DecodePlan, written
from kvarn.rows import plan_decode
from metal import KERNELS
from metal.selector import FUSED


class DecodeGraphs:
    """Compiled decode forwards of one model, by plan structure. ``traces`` counts forwards built
    in Python (a graph traced: a new structure or a new input shape; or a step run uncompiled),
    ``steps`` every step run here, ``eager`` those run uncompiled."""

    def __init__(self, model: Any, compile: bool = True, capacity: int = 32, commit_after: int = 64) -> None:
        self.model = model
        self.compile = compile
        self.capacity = capacity
        self.commit_after = commit_after
        self._graphs: OrderedDict[tuple, Callable[..., Any]] = OrderedDict()
        self._uses: Counter[tuple] = Counter()  # steps run per structure (commit structures: before compiling)
        self.traces = 0
        self.steps = 0
        self.eager = 0
        self.verifies = 0  # steps in which rows wrote several tokens (verifying drafts)

    def __len__(self) -> int:
        return len(self._graphs)

    def logits(self, tokens: mx.array, caches: Sequence[Any], counts: Sequence[int] | None = None) -> mx.array | None:
        """The next-token logits [B, V] of a decode batch (``tokens`` [B, 1], one batch cache per
        layer), its storage written and its rows advanced; None where the storage cannot plan the
        step as arrays (nothing was done: run the forward through ``caches``). ``counts``: with
        ``tokens`` [B, T], the tokens each row writes (rows verifying drafts: ``engine/verify.py``);
        the logits are then [B, T, V], a row's positions past its count padding."""
        plan = plan_decode(caches, counts=counts)
        if plan is None:
            return None
        if plan.padded > plan.rows:
            tokens = mx.concatenate([tokens, mx.zeros((plan.padded - plan.rows, tokens.shape[1]), tokens.dtype)])
        key = (plan.build, plan.static)
        if key not in self._uses and len(self._uses) > 8 * self.capacity:  # forget structures long unused
            self._uses = Counter({k: n for k, n in self._uses.items() if k in self._graphs})
        self._uses[key] += 1
        compiled = self.compile and plan.padded <= ROW_BUCKETS[-1] and \
            (key in self._graphs or not plan.commits or self._uses[key] > self.commit_after
             or KERNELS.decided_commit_path() in FUSED)
        fn = self._graph(key, plan) if compiled else self._step(plan.build, plan.static)
        self.steps += 1
        self.eager += not compiled
        self.verifies += tokens.shape[1] > 1
        out = fn(tokens, plan.inputs, plan.state)
        plan.finish(list(out[1:]))
        return out[0][: plan.rows]

    def _graph(self, key: tuple, plan: DecodePlan) -> Callable[..., Any]:
        fn = self._graphs.get(key)
        if fn is None:
            fn = self._graphs[key] = mx.compile(self._step(plan.build, plan.static))
            while len(self._graphs) > self.capacity:
                gone, _ = self._graphs.popitem(last=False)
                self._uses.pop(gone, None)
        else:
            self._graphs.move_to_end(key)
        return fn

    def _step(self, build: Callable[..., list[Any]], static: tuple) -> Callable[..., tuple[mx.array, ...]]:
        def step(tokens: mx.array, inputs: dict[str, mx.array], state: list[mx.array]) -> tuple[mx.array, ...]:
            self.traces += 1  # Python runs this body only when MLX traces it (or when run uncompiled)
            caches = build(static, inputs, state)
            logits = self.model(tokens, cache=caches)
            logits = logits[:, -1] if tokens.shape[1] == 1 else logits
            return (logits, *written(caches))

        return step
