"""The model's forwards: a step's prompt chunks, with the LM head only where a token is sampled
(``Forward``), and its decode batch under ``mx.compile``, traced once per shape bucket and then
replayed with no Python graph building (``DecodeGraphs``).

Prompt chunks. A prompt chunk needs logits at one position per row (its last token, and only in
a prompt's last chunk); the model's ``__call__`` projects every position onto the vocabulary. ``Forward`` runs
the model's body (``model.model``) and applies its head (``lm_head``, or the tied embedding's
``as_linear``) to the positions asked for, as mlx-lm's own prompt processing avoids the head by
never evaluating it. Whether a model splits so is checked once, at construction, on a fresh cache:
the split must give the model's own logits (a model that post-processes them, e.g. with a
soft cap, fails the check and runs whole).

The decode batch. A decode step is planned by its storage as arrays (``kvarn.rows.plan_decode``:
rows padded to a bucket, block tables to a width bucket, commits to a count bucket;
``kvarn/decode_graph.py``, ``kvarn/slot_step.py``) and run as one pure function: the model's forward over per-layer caches made of the plan's and
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
arrays for one graph (models with layers of their own; slot rows attending one by one on a GPU)
return None: the runner runs the forward through the batch caches, whose storage takes the same
step layer by layer.

vLLM captures CUDA graphs per batch-size bucket for the same reason: on a GPU a decode step
built in Python costs ~10 us of host time per graph node, ~2,000 nodes a step at the 8B shape.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kvarn.decode_graph import ROW_BUCKETS, DecodePlan, written
from kvarn.rows import plan_decode
from metal import KERNELS
from metal.selector import FUSED

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


# --- the decode batch ---

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
