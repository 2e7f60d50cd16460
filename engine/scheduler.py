"""The scheduler and its admission: pure Python (no tensors). It plans each step (which rows
decode, which prompt chunks run) and admits a request with the one check against the KV budget
(``StaticBudget`` / ``PoolBudget``) at its price in the KV cache (``engine/pricing.py``:
``Pricing``, what a request reserves); the engine builds the pricing from a probe of the model's
caches at load, and the HTTP front door refuses what can never fit with the same price.

Each step it plans decode-first: every running row whose prompt is done decodes one token;
the rest of the token budget goes to prompt chunks, first of rows already admitted, then of
newly admitted waiting requests (FIFO). A long prompt therefore never stalls running streams
for more than one chunk.

Chunk boundaries are fixed: chunk i of a prompt is always tokens [i*C, (i+1)*C) whatever else
runs in the step (a prompt restored from the prefix cache at token h starts with [h, next
multiple of C)); a chunk that does not fit in the step's remaining budget waits for the next
step instead of being cut. Every chunk attends with decode's view, but matmuls of other shapes
round differently, so fixed boundaries make a request compute the same alone and in any batch. The config guarantees
the first chunk of a step always fits (budget >= max_num_seqs + chunk).

Admission is by capacity, checked in one place (the budget, below): a waiting request is
admitted only if its cost (the exact KV bytes of prompt + max_tokens, less the blocks a prefix
hit shares, plus one prefill chunk's transient memory until its prompt is done) fits in the KV
budget beside what running requests hold; the prefix cache keeps what is left and is evicted
from to make the room. The queue is FIFO: a head that does not fit yet, or whose prefix is
being read from disk, waits, and nothing behind it overtakes it.

``n > 1``: the other choices of a request are added with ``fork_of`` set. They wait beside
their parent (priced with it), and when the parent's last prompt chunk runs they become rows
sharing its history (no second prefill).

The budget is also the ledger of who holds KV: ``running`` (the rows the scheduler admitted)
and ``forks`` (choices waiting beside their parent); the scheduler moves requests in and out of
them. It admits the head of the queue when ``reserved() + cost(request) <= budget``; the
front door refuses (400) a request whose ``cost`` alone exceeds the budget; the prefix cache keeps
what is left (``free_bytes()``, less what it keeps) and admission evicts from it when a request
needs the room. Two accountings behind the same calls:

- ``StaticBudget`` (fp16 / affine slot rows, rows with layers of their own, windowed rows): a
  request holds its price, the bytes of ``T = prompt + max_tokens`` tokens per choice, plus one chunk's transient while its
  prompt is prefilled (``Pricing``). Rows share nothing.
- ``PoolBudget`` (KVarN rows in the block pool): record blocks are shared (forks, prefix hits),
  so what rows hold is counted from the pool, each block once: the blocks held now, plus per
  running request its window and the blocks it may still commit up to ``T``:

      committed = held blocks x B (+ pinned sinks)  +  sum over requests (window + (records(T)
                  - records held) x B)  + the transient of every request still prefilling

  A prefix hit's blocks are held (pinned) from the lookup on, so a request's cost leaves them out
  (its cached sink too, until the row has copied it into its window);
  ``n > 1`` choices share their prompt's records. This is exact: a running request can always
  commit its next tile, because its blocks were counted before it was admitted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from apc.prefix_cache import PENDING  # a lookup still reading from disk (``CacheHooks.lookup``)
from engine.pricing import Pricing, Reservation
from engine.request import FinishReason, Request, RequestId, RequestStatus
from engine.step_types import PrefillChunk, StepPlan, StepResult


class CacheHooks(Protocol):
    """What admission asks of the prefix cache (``apc.reuse.PrefixReuse``)."""

    def lookup(self, request: Request) -> Any:
        """A hit (with ``tokens``: prompt tokens it restores, pinned until taken or released),
        None, or ``PENDING`` (ask again next step)."""

    def release(self, hit: Any) -> None:
        """A hit looked up for a request that is not admitted now."""

    def admit(self, request: Request, hit: Any) -> None:
        """The request is admitted with ``hit`` (None: a miss)."""

    def cached_bytes(self) -> int:
        """What the cache keeps in memory that no running request holds."""

    def evict_to(self, target: int) -> None:
        """Keep at most ``target`` bytes."""


@dataclass(frozen=True)
class SchedulerConfig:
    """``max_num_seqs`` rows at once; ``max_num_batched_tokens`` tokens per step (decode rows
    count one each); prompt chunks of at most ``prefill_chunk_size`` tokens; reservations
    within ``kv_budget_bytes`` (None: no byte limit); ``async_scheduling``: in steady decode the
    engine builds and launches the next step from this step's sampled tokens (still on the
    device) before it reads them back, so the host's work overlaps the device's (``Engine.step``);
    ``batch_prefill``: a step's prompt chunks of similar lengths run in one forward
    (``ModelRunner``; False runs each in its own); ``compile_decode``: the decode forward runs
    under ``mx.compile``, one graph per shape bucket (``engine/model_runner.py: DecodeGraphs``; False:
    ``--enforce-eager``, the same step built in Python every time)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    prefill_chunk_size: int = 512
    kv_budget_bytes: int | None = None
    async_scheduling: bool = False  # the engine launches step N+1 before reading step N back
    batch_prefill: bool = True  # prompt chunks of several rows in one forward
    compile_decode: bool = True  # the decode forward compiled by shape bucket

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.prefill_chunk_size < 1:
            raise ValueError("max_num_seqs and prefill_chunk_size must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs + self.prefill_chunk_size:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs + prefill_chunk_size (every decode "
                             "row and one whole prompt chunk fit in a step)")
        if self.kv_budget_bytes is not None and self.kv_budget_bytes < 0:
            raise ValueError("kv_budget_bytes must be >= 0")


class Scheduler:
    """Waiting and running queues; ``plan()`` makes a ``StepPlan``, ``update()`` consumes its result.

    Invariants: a request is in at most one queue (pending forks live beside their parent);
    ``running`` keeps admission order; a row that finished or was aborted is reported in the
    next plan's ``freed`` exactly once; ``reserved_bytes`` (what running requests hold or may
    still take, the budget's ledger) never exceeds the budget, and with what the prefix cache
    keeps it does not exceed it after an admission.
    """

    def __init__(self, config: SchedulerConfig, budget: StaticBudget | None = None,
                 cache: CacheHooks | None = None) -> None:
        """``budget``: what requests cost and hold, and the ledger of running requests and
        waiting choices (None: nothing is priced); ``cache``: the prefix cache's admission hooks
        (None: no cache)."""
        self.config = config
        self.budget = budget if budget is not None else StaticBudget(_free_of_charge)
        self.cache = cache
        self.waiting: deque[Request] = deque()
        self._freed: list[RequestId] = []

    @property
    def running(self) -> list[Request]:
        """Requests with a row, in admission order (the budget's ledger)."""
        return self.budget.running

    @property
    def forks(self) -> dict[RequestId, list[Request]]:
        """By parent, the choices waiting to become rows (the budget's ledger)."""
        return self.budget.forks

    @property
    def has_freed_rows(self) -> bool:
        """Whether rows finished since the last plan (the next plan reports them in ``freed``)."""
        return bool(self._freed)

    # --- admission (one check: the budget's) ---
    def fits_alone(self, request: Request, n: int = 1) -> bool:
        budget = self.config.kv_budget_bytes
        return budget is None or self.budget.cost(request, n) <= budget

    @property
    def reserved_bytes(self) -> int:
        """What running requests (and choices waiting to fork) hold or may still take."""
        return self.budget.reserved()

    def headroom(self) -> int:
        """The KV budget left beside running requests and what the prefix cache keeps."""
        budget = self.config.kv_budget_bytes
        if budget is None:
            return 1 << 62
        cached = self.cache.cached_bytes() if self.cache is not None else 0
        return budget - self.reserved_bytes - cached

    # --- queues ---
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        if request.fork_of is not None:
            parent = next((r for r in self.waiting if r.request_id == request.fork_of), None)
            if parent is None:
                raise ValueError(f"fork {request.request_id} needs its parent {request.fork_of} waiting")
            self.forks.setdefault(request.fork_of, []).append(request)
            return
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._freed)

    def finish(self, request: Request, reason: FinishReason) -> list[Request]:
        """Remove a request from whichever queue holds it; its row is freed at the next step.
        Returns the pending forks that ended with it (a parent that never finished its prompt
        takes its unforked choices along)."""
        if request.is_finished:
            return []
        if request in self.running:
            self.running.remove(request)
            self._freed.append(request.request_id)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request.fork_of is not None and request in self.forks.get(request.fork_of, []):
            self.forks[request.fork_of].remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        orphans = self.forks.pop(request.request_id, [])
        for fork in orphans:
            fork.status = RequestStatus.FINISHED
            fork.finish_reason = reason
        return orphans

    def plan(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        decodes = tuple(r.request_id for r in self.running if r.is_prefill_done)
        budget -= len(decodes)
        prefills: list[PrefillChunk] = []
        blocked = False  # a chunk that did not fit: nothing behind it prefills this step (FIFO)
        for request in self.running:
            if not request.is_prefill_done:
                chunk = self._chunk(request)
                if chunk.num_tokens > budget:
                    blocked = True
                    break
                prefills.append(chunk)
                budget -= chunk.num_tokens
        while self.waiting and not blocked:
            request = self.waiting[0]
            n = 1 + len(self.forks.get(request.request_id, ()))
            if len(self.running) + n > self.config.max_num_seqs and self.running:
                break
            hit = self.cache.lookup(request) if self.cache is not None else None
            if hit is PENDING:  # its prefix is being read from disk: running rows go on
                break
            hit_tokens = hit.tokens if hit is not None else 0
            chunk = self._chunk(request, start=hit_tokens)
            cost = self.budget.cost(request, n, hit_tokens)
            room = self.config.kv_budget_bytes - self.reserved_bytes - cost \
                if self.config.kv_budget_bytes is not None else None
            if (room is not None and room < 0) or chunk.num_tokens > budget:
                if hit is not None:
                    self.cache.release(hit)
                break
            if room is not None and self.cache is not None and self.cache.cached_bytes() > room:
                self.cache.evict_to(room)  # the prefix cache gives the request its room
            if self.cache is not None:
                self.cache.admit(request, hit)
            request.num_cached_tokens = request.num_computed_tokens = hit_tokens
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            prefills.append(replace(chunk, restore=hit) if hit is not None else chunk)
            budget -= chunk.num_tokens
        freed, self._freed = tuple(self._freed), []
        return StepPlan(prefills=tuple(prefills), decodes=decodes, freed=freed)

    def _chunk(self, request: Request, start: int | None = None) -> PrefillChunk:
        """Chunk ends are multiples of the chunk size from token 0 (a prompt restored from the
        prefix cache at any block first finishes its chunk), and the prompt lengths in
        ``snapshot_at`` (where the checkpoint tier keeps a whole-row snapshot)."""
        start = request.num_computed_tokens if start is None else start
        C = self.config.prefill_chunk_size
        end = min((start // C + 1) * C, request.num_prompt_tokens,
                  *(p for p in request.snapshot_at if p > start))
        is_last = end == request.num_prompt_tokens
        forks = tuple(f.request_id for f in self.forks.get(request.request_id, ())) if is_last else ()
        return PrefillChunk(request.request_id, start, end, is_last=is_last, forks=forks)

    def update(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Advance computed counts, start forks, append sampled tokens (a verifying row's
        accepted drafts first); return requests that got a token."""
        by_id = {r.request_id: r for r in self.running}
        for chunk in plan.prefills:
            request = by_id.get(chunk.request_id)
            if request is None:
                continue
            request.num_computed_tokens = chunk.end_idx
            if chunk.is_last:
                self._end_prefill(request, chunk, by_id)
        accepted = result.accepted
        for request_id in plan.decodes:  # a verifying row also wrote the drafts it kept
            request = by_id.get(request_id)
            if request is not None:
                request.num_computed_tokens += 1 + len(accepted[request_id]) if request_id in accepted else 1
        advanced = []
        for request_id, sampled in result.sampled.items():
            request = by_id.get(request_id)
            if request is not None:
                if request_id in accepted:
                    request.output_ids += [t.token_id for t in accepted[request_id]]
                request.output_ids.append(sampled.token_id)
                advanced.append(request)
        return advanced

    def _end_prefill(self, request: Request, chunk: PrefillChunk, by_id: dict[RequestId, Request]) -> None:
        """The prompt is in the cache: its transient ends (it is no longer prefilling) and the
        forks become rows (a request whose step failed was finished before this, with its forks)."""
        forks = [f for f in self.forks.pop(request.request_id, []) if f.request_id in chunk.forks]
        position = self.running.index(request) + 1
        for fork in forks:
            fork.status = RequestStatus.RUNNING
            fork.num_computed_tokens = chunk.end_idx
            fork.num_cached_tokens = request.num_cached_tokens
            self.running.insert(position, fork)
            position += 1
            by_id[fork.request_id] = fork


def _free_of_charge(request: Request, n: int) -> Reservation:
    """The price of a request where nothing is priced."""
    return Reservation(0)


# --- the budget: the one admission check ---

@dataclass
class StaticBudget:
    """Requests hold their price (``price(request, n)``: ``n`` choices, the transient once).

    ``running``: the requests with a row, in admission order; ``forks``: by parent, the choices
    (``n > 1``) that wait to become rows when their parent's prompt is done."""

    price: Callable[[Request, int], Reservation]
    budget_bytes: int | None = None
    running: list[Request] = field(default_factory=list)
    forks: dict[RequestId, list[Request]] = field(default_factory=dict)

    def cost(self, request: Request, n: int = 1, hit_tokens: int = 0) -> int:
        return self.price(request, n).total

    def holds(self, request: Request) -> int:
        """What a running request holds now (one choice), its transient while it prefills."""
        r = self.price(request, 1)
        return r.kv + (0 if request.is_prefill_done else r.transient)

    def pending(self, fork: Request) -> int:
        """What a choice that has not forked yet (``n > 1``) holds beside its parent."""
        return self.price(fork, 1).kv

    def shared(self) -> int:
        return 0

    def committed(self, running: Iterable[Request], pending: Iterable[Request]) -> int:
        return self.shared() + sum(map(self.holds, running)) + sum(map(self.pending, pending))

    def reserved(self) -> int:
        """What the running requests (and their choices waiting to fork) hold or may still take."""
        pending = [f for r in self.running for f in self.forks.get(r.request_id, ())]
        return self.committed(self.running, pending)

    def free_bytes(self) -> int:
        """The budget left beside what running requests reserve (very large without a budget)."""
        return (1 << 62) if self.budget_bytes is None else self.budget_bytes - self.reserved()


class PoolBudget(StaticBudget):
    """KVarN rows in the block pool: shared blocks counted once (module docstring).

    ``held_bytes()``: what the pool's record blocks held by rows and cached sinks pinned by hits
    (count > 0) take, each once (``KVarNPool.shared_bytes``); ``row_records(request_id)``: how many records a request's row holds (None
    before its row exists)."""

    def __init__(self, pricing: Pricing, budget_bytes: int | None, held_bytes: Callable[[], int],
                 row_records: Callable[[RequestId], int | None]) -> None:
        super().__init__(lambda request, n: pricing.reservation(request.num_prompt_tokens, request.params.max_tokens, n),
                         budget_bytes)
        self.pricing = pricing
        self.held_bytes = held_bytes
        self.row_records = row_records
        self.block_bytes = pricing.block_bytes()
        self.window_bytes = pricing.window_bytes()

    def _tokens(self, request: Request) -> int:
        return self.pricing.reserved_tokens(request.num_prompt_tokens, request.params.max_tokens)

    def cost(self, request: Request, n: int = 1, hit_tokens: int = 0) -> int:
        """``n`` windows; the prompt's records past the hit, once; each choice's later records;
        the transient of the prefill."""
        records, prompt = self.pricing.records(self._tokens(request)), self.pricing.records(request.num_prompt_tokens)
        own = records - self.pricing.records(hit_tokens) + (n - 1) * (records - prompt)
        return n * self.window_bytes + own * self.block_bytes + self.price(request, n).transient

    def holds(self, request: Request) -> int:
        held = self.row_records(request.request_id)
        if held is None:  # admitted this step: its row is made when the step runs, from its hit
            held = self.pricing.records(request.num_cached_tokens)
        future = max(self.pricing.records(self._tokens(request)) - held, 0)
        transient = 0 if request.is_prefill_done else self.price(request, 1).transient
        return self.window_bytes + future * self.block_bytes + transient

    def pending(self, fork: Request) -> int:
        records = self.pricing.records(self._tokens(fork)) - self.pricing.records(fork.num_prompt_tokens)
        return self.window_bytes + records * self.block_bytes

    def shared(self) -> int:
        return self.held_bytes()
