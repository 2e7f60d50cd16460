"""The engine: ``step()`` = plan, run, update. Single-threaded; ``EngineClient`` owns the thread."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from apc.reuse import PrefixReuse, exact_tier_possible, make_prefix_reuse
from engine.kv_config import ApcConfig, KVConfig
from engine.loader import LoadedModel, use_cpu_rope, use_cpu_rows_matmul, use_cpu_swiglu
from engine.memory import keep_cpu_buffers, release_memory
from engine.model_runner import Dispatched, ModelRunner
from engine.accepted_output import advance_tokens
from engine.speculator import SpecConfig, Speculator, make_proposer
from engine.output import OutputState, add_prompt_scores, new_text_stream
from engine.request import FinishReason, Request, RequestId, RequestOutput, SamplingParams
from engine.pricing import LayerSpec, Pricing, Reservation, default_budget_bytes, machine_memory_bytes
from engine.scheduler import PoolBudget, Scheduler, SchedulerConfig, StaticBudget
from engine.step_types import StepPlan, StepResult
from kvarn.layout import KVLayout
from kvarn.pool import warm_quantizer
from kvarn.rows import (RowStore, batchable, count_quantized_layers, install_attention_seam, make_batch_cache,
                        make_cache, paged_row, verify_room)
from metal import KERNELS

logger = logging.getLogger(__name__)


def make_layout(kv: KVConfig, loaded: LoadedModel) -> KVLayout:
    key_bits = kv.key_bits or 4
    # affine has one width for both legs; KVarN's value leg defaults to 2 bits (k4v2)
    value_bits = kv.value_bits or (key_bits if kv.scheme == "affine" else 2)
    return KVLayout(scheme=kv.scheme, key_bits=key_bits, value_bits=value_bits, tile_size=kv.tile,
                    group_size=kv.group_size, storage_dtype=loaded.compute_dtype, max_kv_size=kv.max_kv_size)


def make_engine(loaded: LoadedModel, config: SchedulerConfig | None = None, kv: KVConfig | None = None,
                apc: ApcConfig | None = None, spec: SpecConfig | None = None) -> Engine:
    """An engine running ``loaded`` with the KV layout ``kv`` (KVarN k4v2 by default), the
    prefix cache ``apc`` (on by default, memory only) and speculative decoding ``spec`` (None: off).

    Fails at once, not at the first request, if the layout cannot run on this model: the
    attention seam is installed (every layout routes through it: KVarN rows, batches of rows,
    affine where MLX lacks its kernels) and one token is run through a fresh cache. A KV budget
    left unset (``config.kv_budget_bytes`` None) is derived from the machine's memory; the
    prefix cache keeps what running requests leave of it (no share of its own)."""
    layout = make_layout(kv or KVConfig(), loaded)
    config = config or SchedulerConfig()
    apc = apc or ApcConfig()
    install_attention_seam(loaded.model)
    keep_cpu_buffers()
    KERNELS.cpu()  # on the CPU: its kernels built (once a machine) and self-checked before anything is traced
    use_cpu_rope(loaded.model)
    use_cpu_swiglu(loaded.model)
    use_cpu_rows_matmul(loaded.model)
    probe = make_cache(loaded.model, layout, capacity=1)
    mx.eval(loaded.model(mx.array([[0]], dtype=mx.int32), cache=probe))
    row = paged_row(probe)
    if row is not None:  # every tile count a step can commit: decode rows, or one prompt chunk
        heads, dim = row.pool.shapes[min(row.layers)]
        warm_quantizer(layout, heads, dim, max(config.max_num_seqs, -(-config.prefill_chunk_size // layout.tile_size)))
        KERNELS.attention_path()  # decide the decode attention (the fused kernel's self-check) before serving
        KERNELS.cpu()  # on the CPU: build and check kvarn's C++ kernels now, not in the first request
    elif layout.scheme == "fp16" and hasattr(mx, "cuda") and mx.cuda.is_available():
        KERNELS.ragged_decode_path()  # the fp16 slots' fused decode kernel: its self-check, before serving
    pricing = make_pricing(loaded, layout, config.prefill_chunk_size)
    if config.kv_budget_bytes is None:
        weights = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
        budget = default_budget_bytes(machine_memory_bytes(mx.device_info()), weights)
        config = replace(config, kv_budget_bytes=budget)
    if apc.enabled and apc.memory_bytes is not None and apc.memory_bytes > config.kv_budget_bytes:
        raise ValueError(f"the prefix cache's memory cap ({apc.memory_bytes:,} bytes) exceeds the KV budget "
                         f"({config.kv_budget_bytes:,} bytes) it shares with running requests")
    return Engine(loaded, layout, config, pricing, batch_decode=can_batch_decode(loaded, layout),
                  apc=apc if apc.enabled else None, spec=spec)


def make_pricing(loaded: LoadedModel, layout: KVLayout, prefill_chunk: int) -> Pricing:
    """Pricing from the model's own caches after one token: a plain attention layer takes the
    layout, a sliding window is priced as a window, anything else (recurrent state) as
    measured."""
    caches = make_prompt_cache(loaded.model)
    mx.eval(loaded.model(mx.array([[0]], dtype=mx.int32), cache=caches))
    layers = []
    for cache in caches:
        if type(cache) in (KVCache, RotatingKVCache):
            _, heads, _, dim = cache.keys.shape
            kind, window = ("layout", 0) if type(cache) is KVCache else ("window", cache.max_size)
            layers.append(LayerSpec(kind, heads, dim, cache.keys.dtype.size, window=window))
        else:
            layers.append(LayerSpec("fixed", fixed_bytes=cache.nbytes))
    args = getattr(loaded.model, "args", None)
    n_q_heads = getattr(args, "num_attention_heads", None) or max(l.n_kv_heads for l in layers) * 8
    return Pricing(layout, tuple(layers), n_q_heads, loaded.context_length, prefill_chunk)


def can_batch_decode(loaded: LoadedModel, layout: KVLayout) -> bool:
    """Whether decoding rows can run as one batch: every layer's cache must be an attention
    cache the batch understands, and a two-row probe must run (else rows decode alone)."""
    store = RowStore(loaded.model, layout)
    rows = [store.new_row(2) for _ in range(2)]
    try:
        if not batchable(rows[0]):
            logger.warning("this model's caches cannot be batched: decoding rows run one at a time")
            return False
        for row in rows:
            mx.eval(loaded.model(mx.array([[0]], dtype=mx.int32), cache=row))
        batch = [make_batch_cache([row[l] for row in rows]) for l in range(len(rows[0]))]
        mx.eval(loaded.model(mx.array([[1], [2]], dtype=mx.int32), cache=batch))
        return True
    except Exception:  # a model that reads the offset as a Python int, etc.
        logger.warning("batched decode failed on this model: decoding rows run one at a time", exc_info=True)
        return False
    finally:
        for row in rows:
            store.release(row)


class RequestTooLarge(ValueError):
    """A request whose reservation exceeds the whole KV budget: it could never be admitted."""


class Engine:
    """Requests in, ``RequestOutput`` deltas out. Invariant: every added request gets exactly one
    output with ``finish_reason`` set, after which the engine holds nothing of it."""

    def __init__(self, loaded: LoadedModel, layout: KVLayout, config: SchedulerConfig | None = None,
                 pricing: Pricing | None = None, batch_decode: bool = True, apc: ApcConfig | None = None,
                 spec: SpecConfig | None = None) -> None:
        """``apc``: the prefix cache (None: off); ``spec``: speculative decoding (None: off)."""
        self.loaded = loaded
        self.layout = layout
        config = config or SchedulerConfig()
        self.pricing = pricing or make_pricing(loaded, layout, config.prefill_chunk_size)
        # built in order, each with what it needs: where rows live, what they cost, the prefix
        # cache (in what the budget leaves), then admission and the runner, both handed the cache
        store = RowStore(loaded.model, layout)
        budget = self._make_budget(store, config.kv_budget_bytes)
        self.prefix: PrefixReuse | None = None
        if apc is not None:
            self.prefix = make_prefix_reuse(loaded.fingerprint, layout, store, budget.free_bytes, apc)
        try:
            self.scheduler = Scheduler(config, budget, cache=self.prefix)
            self.runner = ModelRunner(loaded, layout, batch_decode=batch_decode, capacity=self._capacity,
                                      restore=self.prefix.make_row if self.prefix is not None else None,
                                      release=self.prefix.release if self.prefix is not None else None,
                                      batch_prefill=config.batch_prefill, store=store,
                                      compile_decode=config.compile_decode)
            # rows that cannot be cut at blocks (sliding windows, recurrent state) end prompt chunks
            # where the checkpoint tier snapshots them, with or without the cache (same numbers)
            self.cuts_for_snapshots = not exact_tier_possible(make_cache(loaded.model, layout))
            self.requests: dict[RequestId, Request] = {}
            self._outputs: dict[RequestId, OutputState] = {}
            self._eos_token_ids = frozenset(loaded.tokenizer.eos_token_ids)
            self._async = config.async_scheduling
            self._ahead: Dispatched | None = None  # async scheduling: the step launched, not read back
            self.speculator = None if spec is None else Speculator(spec, make_proposer(spec, loaded),
                                                                   loaded.context_length, config.max_num_batched_tokens)
        except BaseException:  # the prefix cache's threads and KV events sockets go with the failed engine
            self.close()
            raise

    def _make_budget(self, store: RowStore, budget_bytes: int | None) -> StaticBudget:
        """KVarN rows in the block pool whose every layer is in it, unwindowed: shared blocks
        counted once, as the pool counts them (windowed rows drop shared blocks and take their own,
        and rows with layers of their own are priced whole: each holds its price). The pool never
        needs more ids than the budget pays for."""
        pool = store.pool
        if pool is None:
            return StaticBudget(self._price, budget_bytes)
        if budget_bytes is not None:
            sink = self.pricing.window_bytes() // getattr(mx, self.layout.window_dtype).size  # a float16 sink copy
            pool.max_blocks["records"] = budget_bytes // max(self.pricing.block_bytes(), 1) + 1
            pool.max_blocks["sinks"] = budget_bytes // max(sink, 1) + 1
        if store.exact and self.layout.max_kv_size is None:
            return PoolBudget(self.pricing, budget_bytes, pool.shared_bytes, self._row_records)
        return StaticBudget(self._price, budget_bytes)

    def _verify_room(self, request_id: RequestId) -> int:
        return verify_room(self.runner.rows[request_id].cache)

    def _row_records(self, request_id: RequestId) -> int | None:
        return self.runner.row_records(request_id)

    @contextmanager
    def prefix_cache_paused(self) -> Iterator[None]:
        """Requests run meanwhile (a warm-up) neither hit nor fill the prefix cache."""
        with self.prefix.paused() if self.prefix is not None else nullcontext():
            yield

    def _price(self, request: Request, n: int) -> Reservation:
        return self.pricing.reservation(request.num_prompt_tokens, request.params.max_tokens, n)

    def _capacity(self, request: Request) -> int:
        return self.pricing.reserved_tokens(request.num_prompt_tokens, request.params.max_tokens)

    def cost_alone(self, prompt_tokens: int, max_tokens: int, n: int = 1) -> int:
        """What a request costs in an empty engine (the front door's check; pure Python, any thread)."""
        probe = Request(RequestId("probe"), [0] * prompt_tokens, SamplingParams(max_tokens=max_tokens))
        return self.scheduler.budget.cost(probe, n)

    # --- prefix cache ---
    def close(self) -> None:
        """Finish the prefix cache's disk writes, then close its KV events publisher (shutdown)."""
        self._ahead = None
        if self.prefix is not None:
            self.prefix.close()

    def prefix_cache_stats(self) -> dict[str, object]:
        if self.prefix is None:
            return {"enabled": False}
        return self.prefix.cache.describe()

    def reset_prefix_cache(self) -> dict[str, object]:
        if self.prefix is None:
            return {"enabled": False, "memory_bytes": 0, "disk_bytes": 0}
        return {"enabled": True, **self.prefix.cache.reset()}

    def release_idle_memory(self) -> int:
        """Give memory back once the engine has gone idle (``EngineClient``): the block pool's
        arrays shrink past the highest id still in use (a burst of rows grew them by doubling;
        after a prefix cache reset nothing is in use), the baselines' slot buffers go when no row
        holds a slot, then MLX's buffer cache and malloc's free pages go back to the OS
        (``engine.memory``). Returns the KV bytes released."""
        store = self.runner.store
        released = store.pool.shrink() if store.pool is not None else 0
        released += sum(slots.shrink() for slots in store.slots or () if slots is not None)
        release_memory()
        return released

    def prefix_cache_counters(self) -> dict[str, int]:
        """Counters and sizes for the server's metrics (zeros with the cache off)."""
        if self.prefix is None:
            return {}
        c = self.prefix.cache
        disk = c.disk.stats if c.disk is not None else None
        return {"apc_lookups": c.stats.lookups, "apc_query_tokens": c.stats.query_tokens,
                "apc_hit_tokens": c.stats.hit_tokens, "apc_inserted_blocks": c.memory.stats.inserted,
                "apc_evicted_blocks": c.memory.stats.evicted + c.checkpoints.evicted,
                "apc_memory_bytes": c.memory_bytes,
                "apc_memory_budget_bytes": c.memory_cap if c.memory_cap is not None else self.kv_budget_bytes,
                "apc_disk_bytes": disk.bytes if disk else 0,
                "apc_disk_errors": (disk.bad_files + disk.write_errors) if disk else 0}

    def describe_speculative(self) -> dict[str, object] | None:
        """Speculative decoding in force (None: off): method, draft length, limits."""
        return None if self.speculator is None else self.speculator.config.describe()

    def speculative_counters(self) -> dict[str, int]:
        """Drafted tokens verified and accepted, and verifies run, for the server's metrics."""
        if self.speculator is None:
            return {}
        c = self.speculator.counters
        return {"spec_draft_tokens": c.proposed, "spec_accepted_tokens": c.accepted, "spec_verifies": c.verifies}

    @property
    def kv_budget_bytes(self) -> int | None:
        return self.scheduler.config.kv_budget_bytes

    def describe_kv(self) -> dict[str, object]:
        """The layout in force, with how many layers use it (others keep their own cache)."""
        used, total = count_quantized_layers(self.loaded.model, self.layout)
        return {**self.layout.describe(self.loaded.fingerprint), "max_kv_size": self.layout.max_kv_size,
                "layers": total, "layers_with_layout": used, "budget_bytes": self.kv_budget_bytes,
                "batched_decode": self.runner.batch_decode}

    def add_request(self, request: Request, forks: tuple[Request, ...] = ()) -> None:
        """Queue ``request`` and its other choices (``n > 1``: ``forks`` share its prompt).
        Raises ``RequestTooLarge`` if their reservation exceeds the whole budget."""
        group = (request, *forks)
        for member in group:
            if member.request_id in self.requests:
                raise ValueError(f"duplicate request id {member.request_id}")
        if not self.scheduler.fits_alone(request, len(group)):
            need = self.scheduler.budget.cost(request, len(group))
            raise RequestTooLarge(f"this request needs {need:,} bytes of KV cache (prompt {request.num_prompt_tokens} "
                                  f"+ max_tokens {request.params.max_tokens}, n={len(group)}) but the whole "
                                  f"KV budget is {self.kv_budget_bytes:,} bytes; reduce max_tokens, the prompt or n")
        points = ()  # where chunks end for whole-row snapshots (checkpoint-tier models only)
        if self.cuts_for_snapshots:
            # the system prompt's end, and the prompt's last token but one (a repeat of this
            # prompt, or any prompt extending it, restores all but its last token)
            last = request.num_prompt_tokens - 1
            points = tuple(sorted({p for p in request.snapshot_at if 0 < p < last} | ({last} if last > 0 else set())))
        for member in group:
            member.snapshot_at = points
            self.requests[member.request_id] = member
            self._outputs[member.request_id] = OutputState(new_text_stream(self.loaded.tokenizer), member.params.stop)
        self.scheduler.add(request)
        for fork in forks:
            fork.fork_of = request.request_id
            self.scheduler.add(fork)

    def abort_request(self, request_id: RequestId) -> list[RequestOutput]:
        """End a request now (with the choices it had not forked yet)."""
        request = self.requests.get(request_id)
        if request is None:
            return []
        outputs = self._finish(request, FinishReason.ABORT)
        self._publish_cache_events()
        return outputs

    def fail_all(self, error: str) -> list[RequestOutput]:
        """End every request with ``error`` (a shutdown that could not wait for them)."""
        outputs = []
        for request_id in list(self.requests):
            request = self.requests.get(request_id)
            if request is not None:
                outputs += self._finish(request, FinishReason.ERROR, error=error)
        self._publish_cache_events()
        return outputs

    def _publish_cache_events(self) -> None:
        if self.prefix is not None:
            self.prefix.cache.sync_events()  # evictions since the last step, told to routers

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._ahead is not None

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def step(self) -> list[RequestOutput]:
        """One step: plan, run, update. With ``async_scheduling`` a step may instead read back the
        step launched by the last call, after launching the one after it (``_run_ahead``)."""
        if self._ahead is not None:
            current, self._ahead = self._ahead, None
            live = tuple(i for i in current.plan.decodes if i in self.requests)
            if not live:  # every row it ran for was aborted meanwhile: nothing to read
                return []
            current = replace(current, plan=replace(current.plan, decodes=live),
                              pending={i: a for i, a in current.pending.items() if i in self.requests})
        else:
            if self.prefix is not None:
                self.prefix.cache.poll()  # blocks read from disk since the last step join the memory tier
            plan = self.scheduler.plan()
            if self.speculator is not None:  # decoding rows may verify drafts instead (``engine/speculator.py``)
                plan = self.speculator.plan_drafts(plan, self.requests, self._verify_room)
            if plan.is_empty and self.prefix is not None and self.prefix.cache.reading:
                self.prefix.cache.wait(0.05)  # nothing to run but a disk read: wait for it, not spin
                return []
            if not self._async:
                return self.update(plan, self.runner.run(plan, self.requests))
            current = self.runner.dispatch(plan, self.requests)
        self._ahead = self._run_ahead(current)
        return self.update(current.plan, self.runner.collect(current))

    def _run_ahead(self, current: Dispatched) -> Dispatched | None:
        """The next step, launched now from ``current``'s sampled tokens (still lazy on the device),
        when it is certain to be exactly the decode step the scheduler would plan next if no row
        stops on one of them: every running row sampled in ``current`` and nothing else waits;
        no row is constrained (its mask needs the token on the host) and none can reach
        ``max_tokens`` or the context with ``current``'s token (its next write could pass its
        reservation). A row that does stop on its token (EOS, a stop string) ran one token too
        many on the device; that token is dropped with the row. An abort meanwhile drops the
        row's result. Anything else (arrivals, prompts, forks) waits for the next ordinary step,
        and so does the step after one that ran prompt chunks: launching the next step first
        would hold a new request's first token back by that launch (on the CPU, where MLX's
        ``async_eval`` returns only once most of the graph has run, by a whole step)."""
        sched = self.scheduler
        if current.failed is not None or sched.waiting or any(sched.forks.values()) or sched.has_freed_rows:
            return None
        if current.plan.prefills:  # a prompt's first token goes out now, not after the next step is launched
            return None
        if self.speculator is not None and self.speculator.may_speculate(sched.running):
            return None  # the next step may verify drafts: it is planned after this one is read
        limit = self.loaded.context_length
        for request in sched.running:
            params = request.params
            if (request.request_id not in current.pending or params.constraint is not None
                    or len(request.output_ids) + 2 > params.max_tokens
                    or request.num_prompt_tokens + len(request.output_ids) + 2 > limit):
                return None
        plan = StepPlan(decodes=tuple(r.request_id for r in sched.running))
        if not plan.decodes:
            return None
        return self.runner.dispatch(plan, self.requests, after=current)

    def update(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        outputs = []
        for request_id, reason in result.failed.items():
            request = self.requests.get(request_id)
            if request is not None:
                outputs += self._finish(request, FinishReason.ERROR, error=reason)
        self._score_prompts(plan, result)
        if self.speculator is not None:
            self.speculator.observe(plan, result)
        advanced = self.scheduler.update(plan, result)
        if self.prefix is not None:  # cache what the step completed, before finished rows are freed
            self.prefix.after_step(plan, self.requests, self.runner.rows)
        for chunk in plan.prefills:  # max_tokens 0: the prompt was all there was to do
            request = self.requests.get(chunk.request_id)
            if chunk.is_last and request is not None and not request.is_finished and request.params.max_tokens == 0:
                for member in (request, *(self.requests[f] for f in chunk.forks if f in self.requests)):
                    outputs += self._finish(member, FinishReason.LENGTH)
        for request in advanced:
            state = self._outputs[request.request_id]
            tokens = (*result.accepted.get(request.request_id, ()), result.sampled[request.request_id])
            delta = advance_tokens(state, request, tokens, self._eos_token_ids, self.loaded.context_length)
            if delta.finish_reason is not None:
                self.scheduler.finish(request, delta.finish_reason)
                self._forget(request)
            if delta.text or delta.token_ids or delta.finish_reason is not None:
                outputs.append(RequestOutput(
                    request.request_id, delta.text, delta.token_ids, delta.logprobs,
                    request.num_prompt_tokens, len(request.output_ids), delta.finish_reason, index=request.index,
                    num_cached_tokens=request.num_cached_tokens, prompt_logprobs=state.take_prompt_logprobs()))
        for request_id, reason in result.ended.items():  # a grammar with no allowed token: no token
            request = self.requests.get(request_id)
            if request is not None and not request.is_finished:
                outputs += self._finish(request, reason)
        self._publish_cache_events()
        return outputs

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None) -> list[RequestOutput]:
        orphans = self.scheduler.finish(request, reason)
        return [self._final(r, reason, error) for r in (request, *orphans)]

    def _final(self, request: Request, reason: FinishReason, error: str | None = None) -> RequestOutput:
        state = self._outputs.get(request.request_id)
        prompt_logprobs = state.take_prompt_logprobs() if state is not None else None
        self._forget(request)
        return RequestOutput(request.request_id, "", (), (), request.num_prompt_tokens,
                             len(request.output_ids), reason, error, index=request.index,
                             num_cached_tokens=request.num_cached_tokens, prompt_logprobs=prompt_logprobs)

    def _score_prompts(self, plan: StepPlan, result: StepResult) -> None:
        """Prompt entries of the chunks the step ran for requests with ``prompt_logprobs``; at
        the prompt's end the other choices (``n > 1``) get the same entries."""
        for chunk in plan.prefills:
            request = self.requests.get(chunk.request_id)
            if request is None or request.is_finished or request.params.prompt_logprobs is None:
                continue
            state = self._outputs[chunk.request_id]
            add_prompt_scores(state, request.prompt_ids, chunk, result.prompt_scores.get(chunk.request_id))
            for fork_id in chunk.forks:
                fork = self._outputs.get(fork_id)
                if fork is not None:
                    fork.prompt_stream, fork.prompt_logprobs = state.prompt_stream, list(state.prompt_logprobs)
                    fork.prompt_done = True

    def _forget(self, request: Request) -> None:
        self.runner.free((request.request_id,))
        if self.speculator is not None:
            self.speculator.forget(request.request_id)
        if self.prefix is not None:
            self.prefix.forget(request.request_id)
            self.prefix.trim()  # blocks the row let go of are the cache's now: within its cap
        self.requests.pop(request.request_id, None)
        self._outputs.pop(request.request_id, None)
