"""The scheduler: pure Python, never touches tensors.

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

Admission is by capacity: a waiting request is admitted only if its reservation (``Pricing``:
the exact KV bytes of prompt + max_tokens, plus one prefill chunk's transient memory until its
prompt is done) fits in the KV budget beside what running requests hold. The queue is FIFO: a
head that does not fit yet waits, and nothing behind it overtakes it.

``n > 1``: the other choices of a request are added with ``fork_of`` set. They wait beside
their parent (priced with it), and when the parent's last prompt chunk runs they become rows
sharing its history (no second prefill), each with its own share of the reservation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from engine.pricing import Reservation
from engine.request import FinishReason, Request, RequestId, RequestStatus
from engine.step_types import PrefillChunk, StepPlan, StepResult

PriceFn = Callable[[Request, int], Reservation]  # (request, number of choices) -> reservation
LookupFn = Callable[[Request], Any]  # request -> a prefix-cache hit (its ``tokens`` restored) or None


@dataclass(frozen=True)
class SchedulerConfig:
    """``max_num_seqs`` rows at once; ``max_num_batched_tokens`` tokens per step (decode rows
    count one each); prompt chunks of at most ``prefill_chunk_size`` tokens; reservations
    within ``kv_budget_bytes`` (None: no byte limit)."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    prefill_chunk_size: int = 512
    kv_budget_bytes: int | None = None

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
    next plan's ``freed`` exactly once; ``reserved_bytes`` is the sum of the reservations of
    running requests and never exceeds the budget.
    """

    def __init__(self, config: SchedulerConfig, price: PriceFn | None = None, lookup: LookupFn | None = None) -> None:
        self.config = config
        self.price = price
        self.lookup = lookup
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.forks: dict[RequestId, list[Request]] = {}
        self.reservations: dict[RequestId, Reservation] = {}
        self._freed: list[RequestId] = []

    # --- admission ---
    def reservation(self, request: Request, n: int = 1) -> Reservation:
        return self.price(request, n) if self.price is not None else Reservation(0)

    def fits_alone(self, request: Request, n: int = 1) -> bool:
        budget = self.config.kv_budget_bytes
        return budget is None or self.reservation(request, n).total <= budget

    @property
    def reserved_bytes(self) -> int:
        return sum(r.total for r in self.reservations.values())

    def _fits(self, reservation: Reservation) -> bool:
        budget = self.config.kv_budget_bytes
        return budget is None or self.reserved_bytes + reservation.total <= budget

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
            self._shrink_parent(request.fork_of)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.reservations.pop(request.request_id, None)
        orphans = self.forks.pop(request.request_id, [])
        for fork in orphans:
            fork.status = RequestStatus.FINISHED
            fork.finish_reason = reason
        return orphans

    def _shrink_parent(self, parent_id: RequestId) -> None:
        """A pending fork left: its parent (if admitted) holds one choice less."""
        parent = next((r for r in self.running if r.request_id == parent_id), None)
        if parent is not None:
            self.reservations[parent_id] = self.reservation(parent, 1 + len(self.forks[parent_id]))

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
            reservation = self.reservation(request, n)
            if not self._fits(reservation):
                break
            if self.lookup is not None and not request.looked_up:  # once, when it could run now
                request.looked_up = True
                request.prefix_hit = self.lookup(request)
                hit_tokens = request.prefix_hit.tokens if request.prefix_hit is not None else 0
                request.num_cached_tokens = request.num_computed_tokens = hit_tokens
            chunk = self._chunk(request)
            if chunk.num_tokens > budget:
                break
            if request.prefix_hit is not None:  # the first chunk takes the hit to the runner
                chunk, request.prefix_hit = replace(chunk, restore=request.prefix_hit), None
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self.reservations[request.request_id] = reservation
            prefills.append(chunk)
            budget -= chunk.num_tokens
        freed, self._freed = tuple(self._freed), []
        return StepPlan(prefills=tuple(prefills), decodes=decodes, freed=freed)

    def _chunk(self, request: Request) -> PrefillChunk:
        """Chunk ends are multiples of the chunk size from token 0 (a prompt restored from the
        prefix cache at any block first finishes its chunk), and the prompt lengths in
        ``snapshot_at`` (where the checkpoint tier keeps a whole-row snapshot)."""
        start, C = request.num_computed_tokens, self.config.prefill_chunk_size
        end = min((start // C + 1) * C, request.num_prompt_tokens,
                  *(p for p in request.snapshot_at if p > start))
        is_last = end == request.num_prompt_tokens
        forks = tuple(f.request_id for f in self.forks.get(request.request_id, ())) if is_last else ()
        return PrefillChunk(request.request_id, start, end, is_last=is_last, forks=forks)

    def update(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Advance computed counts, start forks, append sampled tokens; return requests that
        got a token."""
        by_id = {r.request_id: r for r in self.running}
        for chunk in plan.prefills:
            request = by_id.get(chunk.request_id)
            if request is None:
                continue
            request.num_computed_tokens = chunk.end_idx
            if chunk.is_last:
                self._end_prefill(request, chunk, by_id)
        for request_id in plan.decodes:
            request = by_id.get(request_id)
            if request is not None:
                request.num_computed_tokens += 1
        advanced = []
        for request_id, sampled in result.sampled.items():
            request = by_id.get(request_id)
            if request is not None:
                request.output_ids.append(sampled.token_id)
                advanced.append(request)
        return advanced

    def _end_prefill(self, request: Request, chunk: PrefillChunk, by_id: dict[RequestId, Request]) -> None:
        """The prompt is in the cache: the transient is released and the forks become rows
        (a request whose step failed was finished before this, with its forks)."""
        forks = [f for f in self.forks.pop(request.request_id, []) if f.request_id in chunk.forks]
        held = self.reservations[request.request_id]
        share = Reservation(kv=held.kv // (1 + len(forks)))
        self.reservations[request.request_id] = share
        position = self.running.index(request) + 1
        for fork in forks:
            fork.status = RequestStatus.RUNNING
            fork.num_computed_tokens = chunk.end_idx
            fork.num_cached_tokens = request.num_cached_tokens
            self.running.insert(position, fork)
            position += 1
            self.reservations[fork.request_id] = share
            by_id[fork.request_id] = fork
