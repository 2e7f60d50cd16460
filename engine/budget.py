"""The KV budget's one admission check: what a request would add, and what running requests hold.

Pure Python. The budget is also the ledger of who holds KV: ``running`` (the rows the scheduler
admitted) and ``forks`` (choices waiting beside their parent); the scheduler moves requests in and
out of them. It admits the head of the queue when ``reserved() + cost(request) <= budget``; the
front door refuses (400) a request whose ``cost`` alone exceeds the budget; the prefix cache keeps
what is left (``free_bytes()``, less what it keeps) and admission evicts from it when a request
needs the room. Two accountings behind the same calls:

- ``StaticBudget`` (fp16 / affine slot rows, rows with layers of their own, windowed rows): a request holds its price, the
  bytes of ``T = prompt + max_tokens`` tokens per choice, plus one chunk's transient while its
  prompt is prefilled (``engine/pricing.py``). Rows share nothing.
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

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.pricing import Pricing, Reservation
from engine.request import Request, RequestId


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
