"""The model runner: it owns the rows (per-request KV caches in its ``RowStore``'s storage, and
sampler states), runs the forwards and samples; only the engine thread calls it. The step in
full: ``docs/engine.md``.

- Prompt chunks of similar lengths run in one forward, right-padded (``kvarn.batch.ChunkRows``),
  the LM head only where a token is sampled (``Forward``); a forward over shared storage is
  evaluated before the next is built, so the buffers update in place.
- The decode batch: one batch cache per layer that persists across steps (``DecodeBatch``: a row
  keeps its place while it decodes). Its storage plans the step as arrays
  (``kvarn.rows.plan_decode``, padded to buckets) and ``DecodeGraphs`` runs the model over them as
  one pure function, ``mx.compile``d per plan structure once it recurs, uncompiled beyond the
  largest bucket or with ``--enforce-eager`` (same results); a storage that cannot plan the step
  (layers of their own) steps layer by layer through the batch caches.
- Rows under a grammar get their masks from ``RowGrammars`` (a worker thread, during the forward).
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.loader import LoadedModel, split_head
from engine.request import FinishReason, Request, RequestId, SamplingParams, TokenLogprob
from engine.sampler import (DEAD_END, PromptArrays, RowGrammars, SampleArrays, SamplerState, make_sampler_state,
                            batch_tokens, plain_greedy, sample, sample_greedy_batch, score_prompt)
from engine.step_types import PrefillChunk, SampledToken, StepPlan, StepResult
from engine.verify import Verifying, collect_verify, dispatch_verify, verify_choices
from kvarn.batch import ChunkRows
from kvarn.decode_graph import ROW_BUCKETS, DecodePlan, written
from kvarn.layout import KVLayout
from kvarn.rows import DecodeBatch, RowStore, begin_verify, paged_row, plan_decode, verifies_in_batch
from kvarn.step_context import forward_context
from metal import KERNELS
from metal.selector import KERNEL_COMMITS

logger = logging.getLogger(__name__)

PAD_SLACK = 1.25  # a prompt chunk batch's padded positions over its tokens, at most


@dataclass
class Row:
    """One sequence's device state: its KV cache (one entry per layer) and its sampler."""

    cache: list[Any]
    sampler: SamplerState
    params: SamplingParams


@dataclass
class Dispatched:
    """A step whose graphs are built and whose forward is launched, not yet read back: the
    sampled arrays by row (``pending``), rows a grammar ended, prompt scores, every array the
    collect evaluates; ``failed`` when building it failed (its rows are freed already)."""

    plan: StepPlan
    pending: dict[RequestId, SampleArrays] = field(default_factory=dict)
    ended: dict[RequestId, FinishReason] = field(default_factory=dict)
    scores: dict[RequestId, PromptArrays] = field(default_factory=dict)
    arrays: list[mx.array] = field(default_factory=list)
    failed: dict[RequestId, str] | None = None
    verifying: dict[RequestId, Verifying] = field(default_factory=dict)  # rows verifying drafts (``engine/verify.py``)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, layout: KVLayout, batch_decode: bool = True,
                 capacity: Any = None, restore: Any = None, release: Any = None,
                 batch_prefill: bool = True, store: RowStore | None = None, compile_decode: bool = True) -> None:
        """``store``: where rows live (None: a store of its own for ``layout``; the engine passes
        the one its budget and prefix cache read); ``capacity(request)`` gives a row's reserved
        tokens (its caches allocate them at once); ``restore(hit, fresh)`` fills a fresh row from a prefix-cache hit that a plan's
        chunk carries (``PrefillChunk.restore``) and returns it, ``release(hit)`` lets go of a
        hit no row took (its step failed first); ``batch_decode`` False runs each decoding row
        alone (models whose caches cannot be batched, e.g. recurrent layers); ``batch_prefill``
        False runs each prompt chunk in its own forward; ``compile_decode`` False runs the decode
        forward uncompiled (``DecodeGraphs``)."""
        self.loaded = loaded
        self.batch_prefill = batch_prefill
        self.forward = Forward(loaded.model)
        self.prefill_forwards = 0  # forwards that ran prompt chunks, and the chunks they ran
        self.prefill_chunks = 0
        self.layout = layout
        self.batch_decode = batch_decode
        self.capacity = capacity
        self.restore = restore
        self.release = release
        self.store = store if store is not None else RowStore(loaded.model, layout)
        self.rows: dict[RequestId, Row] = {}
        self.batch = DecodeBatch()
        # the decode forward, compiled by bucket; on the CPU a structure at its third use (a trace costs 10-20 steps)
        self.graphs = DecodeGraphs(loaded.model, compile=compile_decode,
                                   compile_after=2 if mx.default_device() == mx.cpu else 0)
        self.grammars = RowGrammars(loaded.vocab_size)  # matchers of constrained rows

    def kv_nbytes(self) -> int:
        """Bytes the rows hold (blocks shared by several rows counted once)."""
        if self.store.pool is not None:
            return self.store.pool.held_bytes() + sum(self.store.own_nbytes(row.cache) for row in self.rows.values())
        return sum(c.nbytes for row in self.rows.values() for c in row.cache)

    def kv_allocated_bytes(self) -> int:
        """Bytes of the KV storage allocated: the block pool's arrays (free ids included) or the
        slot buffers, plus the caches of rows kept by layer (>= ``kv_nbytes``)."""
        store = self.store
        shared = store.pool.nbytes() if store.pool is not None else 0
        shared += sum(s.nbytes for s in store.slots or () if s is not None)
        return shared + sum(store.own_nbytes(row.cache) for row in self.rows.values())

    def row_records(self, request_id: RequestId) -> int | None:
        """Record blocks a KVarN row in the pool holds (None: no such row yet)."""
        row = self.rows.get(request_id)
        paged = paged_row(row.cache) if row is not None else None
        return len(paged.table) if paged is not None else None

    def free(self, request_ids: tuple[RequestId, ...]) -> None:
        """Release rows now (their bytes go with them): the engine frees a row as soon as its
        request ends, so what rows hold never exceeds what admission has reserved."""
        for request_id in request_ids:
            row = self.rows.pop(request_id, None)
            if row is not None:
                self.store.release(row.cache)
        self.grammars.free(request_ids)
        self.batch.drop(request_ids)

    def run(self, plan: StepPlan, requests: Mapping[RequestId, Request]) -> StepResult:
        """Prefill the plan's chunks, decode its rows, sample every row that ends the step with
        logits (``dispatch`` then ``collect``). Constrained rows' masks are computed on the mask
        worker meanwhile (``engine/sampler.py: RowGrammars``): the step's forward is dispatched before the
        engine thread waits for them, and unconstrained rows sample exactly as they would without
        them. The decode forward is dispatched (``async_eval``) before the sampling graphs are
        built whether or not a row is constrained, so both kinds of step run the same way."""
        return self.collect(self.dispatch(plan, requests))

    def dispatch(self, plan: StepPlan, requests: Mapping[RequestId, Request],
                 after: Dispatched | None = None) -> Dispatched:
        """Build the step's graphs (forward and sampling) and launch the forward; nothing is read
        back. ``after``: a step dispatched but not collected yet, whose sampled tokens are this
        step's decode inputs (``plan`` then decodes exactly rows that sampled in ``after``: the
        engine's ``async_scheduling``); its tokens are never read on the host here."""
        self.free(plan.freed)
        job = None
        try:
            job = self.grammars.start(_sampling_rows(plan, requests), requests)
            logits: dict[RequestId, mx.array] = {}  # one row of logits per row that samples (decode rows: [B, V], b)
            scores: dict[RequestId, PromptArrays] = {}  # prompt tokens scored (prompt_logprobs)
            for chunk in plan.prefills:  # new rows in the plan's order, the order they join the decode
                if chunk.request_id not in self.rows:  # batch: windows, handed out lowest first, then sit in it
                    self._new_row(requests[chunk.request_id], chunk.restore)
            for chunks in self._prefill_groups(plan.prefills, requests):
                self._prefill(chunks, requests, logits, scores)
            # rows with drafts verify them inside the decode batch where their storage plans it (KVarN
            # rows: ``verifies_in_batch``), else in a chunk forward of their own; the others decode
            inline = {i: d for i, d in (plan.drafts or {}).items() if verifies_in_batch(self.rows[i].cache)}
            separate = {i: d for i, d in (plan.drafts or {}).items() if i not in inline}
            verifying = dispatch_verify(self, separate, requests, plan.draft_probs) if separate else {}
            decodes = tuple(i for i in plan.decodes if i not in verifying)
            if decodes:
                verifying.update(self._decode(decodes, requests, logits, after, inline, plan.draft_probs))
            masks = job.result() if job is not None else {}
            pending: dict[RequestId, SampleArrays] = {}
            ended = {}
            greedy: dict[int, tuple[mx.array, list[tuple[RequestId, int]]]] = {}  # decode rows: one argmax a batch
            for request_id, row_logits in logits.items():
                row, allowed = self.rows[request_id], masks.get(request_id)
                if request_id in masks and allowed is DEAD_END:
                    ended[request_id] = FinishReason.GRAMMAR_DEAD_END
                    continue
                if isinstance(row_logits, tuple):  # (the decode batch's logits, the row's place in it)
                    batch_logits, b = row_logits
                    if allowed is None and plain_greedy(row.params, row.sampler):
                        greedy.setdefault(id(batch_logits), (batch_logits, []))[1].append((request_id, b))
                        continue
                    row_logits = batch_logits[b]
                pending[request_id] = sample(row_logits, row.params, row.sampler,
                                             None if allowed is None else mx.array(allowed))
            for batch_logits, members in greedy.values():
                tokens = sample_greedy_batch(batch_logits, [b for _, b in members])
                pending.update({request_id: tokens[b] for request_id, b in members})
            states = [self.rows[i].sampler for i in pending]
            arrays = ([a for arrays in (*pending.values(), *scores.values()) for a in arrays.arrays()]
                      + [s.key for s in states] + [s.counts for s in states if s.counts is not None])
            arrays += [a for v in verifying.values() for a in v.arrays()]
            return Dispatched(plan, pending, ended, scores, arrays, verifying=verifying)
        except Exception as exc:  # a failed step fails its rows, never the engine
            return Dispatched(plan, failed=self._fail(plan, exc, job))

    def collect(self, step: Dispatched) -> StepResult:
        """Evaluate a dispatched step and read its tokens back (each constrained row's matcher
        consumes its token here)."""
        if step.failed is not None:
            return StepResult(failed=step.failed)
        try:
            mx.eval(step.arrays)
            sampled, verified = self._collect(step.pending), collect_verify(self, step.verifying)
            sampled.update({i: tokens[-1] for i, tokens in verified.items()})  # each verify's last token
            return StepResult(sampled=sampled, ended=step.ended,
                              accepted={i: tuple(tokens[:-1]) for i, tokens in verified.items() if len(tokens) > 1},
                              prompt_scores={i: arrays.read() for i, arrays in step.scores.items()})
        except Exception as exc:
            return StepResult(failed=self._fail(step.plan, exc, None))

    def _fail(self, plan: StepPlan, exc: Exception, job: Any) -> dict[RequestId, str]:
        logger.error("step failed", exc_info=exc)
        if job is not None:  # the worker lets go of the matchers before their rows are freed
            job.wait()
        involved = [c.request_id for c in plan.prefills] + [f for c in plan.prefills for f in c.forks]
        involved += list(plan.decodes)
        for chunk in plan.prefills:  # a hit its row never took (a no-op for one it took)
            if chunk.restore is not None and self.release is not None:
                self.release(chunk.restore)
        self.batch.clear()
        self.free(tuple(involved))
        return {request_id: f"generation failed: {exc}" for request_id in involved}

    def _prefill_groups(self, chunks: tuple[PrefillChunk, ...],
                        requests: Mapping[RequestId, Request]) -> list[list[PrefillChunk]]:
        """The step's prompt chunks in forwards: chunks of similar lengths run together (longest
        first, a group taking the next chunk while its padding stays within ``PAD_SLACK`` of its
        tokens); a chunk whose prompt tokens are scored (``prompt_logprobs``) runs alone, and so
        does every chunk of a model whose rows cannot batch (``batch_decode`` False: recurrent
        state would take the padding in)."""
        if not self.batch_prefill or not self.batch_decode:
            return [[chunk] for chunk in chunks]
        scored = [chunk for chunk in chunks if requests[chunk.request_id].params.prompt_logprobs is not None]
        groups: list[list[PrefillChunk]] = [[chunk] for chunk in scored]
        start = len(groups)
        for chunk in sorted((c for c in chunks if c not in scored), key=lambda c: -c.num_tokens):
            group = groups[-1] if len(groups) > start else None
            if group is not None and (len(group) + 1) * group[0].num_tokens <= \
                    PAD_SLACK * (sum(c.num_tokens for c in group) + chunk.num_tokens):
                group.append(chunk)
            else:
                groups.append([chunk])
        return groups

    def _prefill(self, chunks: list[PrefillChunk], requests: Mapping[RequestId, Request],
                 out: dict[RequestId, mx.array], scores: dict[RequestId, PromptArrays]) -> None:
        """Prompt chunks of one or more rows in one forward (right-padded to the longest, each row
        writing and attending only its own tokens: ``kvarn.batch.ChunkRows``); the LM head runs
        at each row's last token only, and only when a chunk is its prompt's last. A last chunk
        hands its logits to every choice that samples (not to a ``max_tokens`` 0 request); a
        request with ``prompt_logprobs`` (always alone) has the chunk's prompt tokens scored from
        every position's logits."""
        rows = [self.rows[c.request_id] for c in chunks]  # new ones made by ``dispatch``, in the plan's order
        lengths = [chunk.num_tokens for chunk in chunks]
        T = max(lengths)
        tokens = mx.array([list(requests[c.request_id].prompt_ids[c.start_idx: c.end_idx]) + [0] * (T - n)
                           for c, n in zip(chunks, lengths)], dtype=mx.int32)
        if len(chunks) == 1:
            cache = rows[0].cache
        else:
            cache = [ChunkRows([row.cache[l] for row in rows], lengths) for l in range(len(rows[0].cache))]
        with forward_context(cache):
            hidden = self.forward.hidden(tokens, cache)
        self.prefill_forwards += 1
        self.prefill_chunks += len(chunks)
        logits = self.forward.logits_at(hidden, [n - 1 for n in lengths]) \
            if any(c.is_last for c in chunks) else None
        scored = []
        request = requests[chunks[0].request_id]
        if request.params.prompt_logprobs is not None:  # a chunk alone (``_prefill_groups``)
            arrays = score_prompt(self.forward.all_logits(hidden)[0], request.prompt_ids, chunks[0].start_idx,
                                  chunks[0].end_idx, request.params.prompt_logprobs)
            if arrays is not None:
                scores[chunks[0].request_id] = arrays
                scored = arrays.arrays()
        states = [c.state for row in rows for c in row.cache]
        if self.store.in_place:  # settled now, so the next write to the shared buffers is in place
            mx.eval([] if logits is None else logits, scored, states)
            for row in rows:
                self.store.settle(row.cache)  # a windowed row lets go of what its next token will not attend
        elif not all(c.is_last for c in chunks):
            mx.async_eval(scored, [c.state for row, ch in zip(rows, chunks) if not ch.is_last for c in row.cache])
        for k, (chunk, row) in enumerate(zip(chunks, rows)):
            if not chunk.is_last:
                continue
            for fork_id in chunk.forks:  # n > 1: the other choices share this prompt's history
                fork = requests[fork_id]
                self.rows[fork_id] = Row(self.store.fork(row.cache),
                                         make_sampler_state(fork.params, self.loaded.vocab_size), fork.params)
            for request_id in (chunk.request_id, *chunk.forks):
                if requests[request_id].params.max_tokens > 0:
                    out[request_id] = logits[k]

    def _decode(self, ids: tuple[RequestId, ...], requests: Mapping[RequestId, Request],
                out: dict[RequestId, mx.array], after: Dispatched | None = None,
                drafts: Mapping[RequestId, tuple[int, ...]] | None = None,
                draft_probs: Mapping[RequestId, mx.array] | None = None) -> dict[RequestId, Verifying]:
        """The rows' next logits, already being computed when this returns (masks are awaited next).
        ``after``: the inputs are that step's sampled tokens (lazy), not the requests' last ones.
        ``drafts``: rows of the batch that verify drafts in it (their last token and drafts as
        several tokens of the planned step, ``kvarn.rows.verifies_in_batch``); returns their
        verifies."""
        if drafts:
            return self._decode_verifying(ids, requests, out, drafts, draft_probs)
        if not self.batch_decode:
            for request_id in ids:
                row = self.rows[request_id]
                tokens = after.pending[request_id].row_token().reshape(1, 1).astype(mx.int32) if after is not None \
                    else mx.array(requests[request_id].output_ids[-1:], dtype=mx.int32)[None]
                with forward_context(row.cache):
                    out[request_id] = self.loaded.model(tokens, cache=row.cache)[0, -1]
            mx.async_eval([out[i] for i in ids])
            return {}
        self.batch.sync(ids, {i: self.rows[i].cache for i in ids})
        if after is not None:
            tokens = batch_tokens([after.pending[i] for i in self.batch.ids]).astype(mx.int32)[:, None]
        else:
            tokens = mx.array([requests[i].output_ids[-1] for i in self.batch.ids], dtype=mx.int32)[:, None]
        logits = self.graphs.logits(tokens, self.batch.layers)  # planned as arrays, compiled by bucket
        if logits is None:  # no one graph (layers of their own): the storage steps layer by layer
            with forward_context(self.batch.layers):
                logits = self.loaded.model(tokens, cache=self.batch.layers)[:, -1]
        mx.async_eval(logits)
        for b, request_id in enumerate(self.batch.ids):
            out[request_id] = (logits, b)  # sampled from the batch (``dispatch``)
        return {}

    def _decode_verifying(self, ids: tuple[RequestId, ...], requests: Mapping[RequestId, Request],
                          out: dict[RequestId, mx.array], drafts: Mapping[RequestId, tuple[int, ...]],
                          draft_probs: Mapping[RequestId, mx.array] | None) -> dict[RequestId, Verifying]:
        """A decode batch in which some rows verify drafts: one planned forward of [B, T] tokens,
        each row writing its own count (1, or its last token and its drafts); ordinary rows get
        their next logits, verifying rows their choices at every position (``engine/verify.py``)."""
        self.batch.sync(ids, {i: self.rows[i].cache for i in ids})
        rows = [[requests[i].output_ids[-1], *drafts.get(i, ())] for i in self.batch.ids]
        counts = [len(r) for r in rows]
        T = max(counts)
        tokens = mx.array([r + [0] * (T - len(r)) for r in rows], dtype=mx.int32)
        for i in drafts:
            begin_verify(self.rows[i].cache)
        logits = self.graphs.logits(tokens, self.batch.layers, counts)
        if logits is None:
            raise RuntimeError("a verify in the decode batch that its storage cannot plan")
        verifying = {}
        for b, request_id in enumerate(self.batch.ids):
            if request_id in drafts:
                verifying[request_id] = verify_choices(logits[b, : counts[b]], drafts[request_id], self.rows[request_id],
                                                       draft_probs.get(request_id) if draft_probs else None)
            else:
                out[request_id] = logits[b, 0]
        mx.async_eval([logits])
        return verifying

    def _new_row(self, request: Request, hit: Any = None) -> Row:
        capacity = self.capacity(request) if self.capacity is not None else None
        cache = self.store.new_row(capacity)
        if hit is not None:
            try:
                cache = self.restore(hit, cache)
            except Exception:
                self.store.release(cache)
                raise
        row = Row(
            cache=cache,
            sampler=make_sampler_state(request.params, self.loaded.vocab_size),
            params=request.params,
        )
        self.rows[request.request_id] = row
        return row

    def _collect(self, pending: dict[RequestId, SampleArrays]) -> dict[RequestId, SampledToken]:
        """Tokens to Python; each constrained row's matcher consumes its token here."""
        sampled = {}
        read: dict[int, list[int]] = {}  # a batch's tokens, read back once
        for request_id, arrays in pending.items():
            if arrays.index is None:
                token_id = arrays.token.item()
            else:
                if id(arrays.token) not in read:
                    read[id(arrays.token)] = arrays.token.tolist()
                token_id = read[id(arrays.token)][arrays.index]
            logprob = None
            if arrays.logprob is not None:
                top: tuple[tuple[int, float], ...] = ()
                if arrays.top_ids is not None:
                    pairs = zip(arrays.top_ids.tolist(), arrays.top_logprobs.tolist())
                    top = tuple(sorted(pairs, key=lambda p: -p[1]))
                logprob = TokenLogprob(token_id, arrays.logprob.item(), top)
            sampled[request_id] = SampledToken(request_id, token_id, logprob,
                                               finish=self.grammars.consume(request_id, token_id))
        return sampled


def _sampling_rows(plan: StepPlan, requests: Mapping[RequestId, Request]) -> list[RequestId]:
    """Rows that sample a token in this step: each last prompt chunk's (and its forks'), unless
    its request generates nothing (``max_tokens`` 0), and every decoding row."""
    rows = [i for c in plan.prefills if c.is_last for i in (c.request_id, *c.forks)
            if requests[i].params.max_tokens > 0]
    return rows + list(plan.decodes)


# --- the model's forwards: prompt chunks ---

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


# --- the model's forwards: the decode batch ---

class DecodeGraphs:
    """Compiled decode forwards of one model, by plan structure. ``traces`` counts forwards built
    in Python (a graph traced: a new structure or a new input shape; or a step run uncompiled),
    ``steps`` every step run here, ``eager`` those run uncompiled."""

    def __init__(self, model: Any, compile: bool = True, capacity: int = 32, commit_after: int = 64,
                 compile_after: int = 0) -> None:
        self.model = model
        self.compile = compile
        self.capacity = capacity
        self.commit_after = commit_after
        self.compile_after = compile_after
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
        after = self.commit_after if plan.commits and KERNELS.decided_commit_path() not in KERNEL_COMMITS \
            else self.compile_after
        compiled = self.compile and plan.padded <= ROW_BUCKETS[-1] and (key in self._graphs or self._uses[key] > after)
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
