"""Admission: what a request costs in the KV cache (capacity pricing) and the one check that
admits it against the KV budget.

Pure Python (no MLX): the engine builds a ``Pricing`` from a probe of the model's caches at
load, and a budget (``StaticBudget`` or ``PoolBudget``) from it; the scheduler and the HTTP front
door use them to admit, queue or refuse requests.

Pricing. A request reserves, from admission to its end, the bytes of ``T = min(prompt + max_tokens,
context)`` tokens in every layer (times ``n`` for ``n > 1``), plus while its prompt is being
prefilled the transient memory of one chunk. Reserving by ``max_tokens`` is what makes the
budget a guarantee (a running request can never run out of KV memory mid-stream); the price is
that a request that stops early held room it did not use, so clients that leave ``max_tokens``
unset (chat's default: up to the context) reserve a whole context each.

Per layer, for ``T`` tokens, ``H`` KV heads of ``D`` channels:
- kvarn: sink + tail buffers (2·G fp16 tokens) + one record per full tile after the sink,
  exactly what a paged row's ``nbytes`` reports (``KVLayout.sequence_bytes``);
- fp16 / affine: the row's buffers are allocated for its reservation at the first token
  (``kvarn.baselines``), so ``nbytes`` is exactly T tokens' worth from the start;
- with ``--max-kv-size N`` a row is priced at ``min(T, N)`` tokens (``held_tokens``; KVarN
  exactly, a rotating cache once decoding), and while it prefills one chunk's overshoot past the
  window rides on the transient;
- a sliding-window layer (its model's own cache): at most ``window + chunk`` fp16 tokens (a bound);
- any other cache (recurrent state): its size after one token, measured at load (constant).

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

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.request import Request, RequestId
from kvarn.layout import KVLayout

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# share of the machine's memory given to the KV budget by default (weights are taken off first)
DEFAULT_BUDGET_FRACTION = 0.5


@dataclass(frozen=True)
class LayerSpec:
    """One layer's cache as pricing sees it."""

    kind: str  # "layout" (kvarn / fp16 / affine rows), "window" or "fixed"
    n_kv_heads: int = 0
    head_dim: int = 0
    dtype_bytes: int = 2
    window: int = 0
    fixed_bytes: int = 0


@dataclass(frozen=True)
class Reservation:
    """Bytes held for one request: ``kv`` until it ends, ``transient`` until its prefill ends."""

    kv: int
    transient: int = 0

    @property
    def total(self) -> int:
        return self.kv + self.transient


@dataclass(frozen=True)
class Pricing:
    layout: KVLayout
    layers: tuple[LayerSpec, ...]
    n_q_heads: int
    context_length: int
    prefill_chunk: int

    def held_tokens(self, tokens: int) -> int:
        """Tokens a row of ``tokens`` keeps in a layout layer: all of them, or at most its window
        (``--max-kv-size``: a windowed row is priced at its window)."""
        window = self.layout.max_kv_size
        return tokens if window is None else min(tokens, window)

    def sequence_bytes(self, tokens: int) -> int:
        """Exact KV bytes of one sequence of ``tokens`` tokens (all layers; a windowed row's at
        most its window's: KVarN's sink, the records within the window and the tail, exactly;
        a rotating fp16 / affine row's ``min(tokens, window)`` token slots once decoding)."""
        if tokens <= 0:
            return 0
        total = 0
        for layer in self.layers:
            if layer.kind == "layout":
                total += self.layout.sequence_bytes(self.held_tokens(tokens), layer.head_dim, layer.n_kv_heads)
            elif layer.kind == "window":
                held = min(tokens, layer.window + self.prefill_chunk)
                total += 2 * held * layer.n_kv_heads * layer.head_dim * layer.dtype_bytes
            else:
                total += layer.fixed_bytes
        return total

    def records(self, tokens: int) -> int:
        """KVarN: record blocks of a sequence of ``tokens`` tokens (full tiles after the sink;
        a windowed row holds at most its window's)."""
        G = self.layout.tile_size
        return max(0, self.held_tokens(tokens) - G) // G

    def block_bytes(self) -> int:
        """KVarN: one record block, every layer (what ``sequence_bytes`` adds per full tile)."""
        G = self.layout.tile_size
        return sum(int(G * self.layout.bytes_per_token(l.head_dim, l.n_kv_heads)) for l in self.layers
                   if l.kind == "layout")

    def window_bytes(self) -> int:
        """KVarN: one row's window (sink and tail), every layer: ``sequence_bytes`` of one token."""
        return self.sequence_bytes(1)

    def transient_bytes(self, tokens: int) -> int:
        """Bound on the extra memory of one prefill chunk attending over ``tokens`` tokens: the
        score matrix of one layer (MLX's CPU attention materializes it for a chunk) and, for
        KVarN, the history dequantized to float16 and cast to the compute dtype (one layer at
        a time: the layer's copy is freed once its attention is done)."""
        widest = max((layer for layer in self.layers if layer.kind != "fixed"),
                     key=lambda layer: layer.n_kv_heads * layer.head_dim, default=None)
        if widest is None or tokens <= 0:
            return 0
        chunk = min(tokens, self.prefill_chunk)
        overshoot = 0
        window = self.layout.max_kv_size
        if window is not None and tokens > window:  # a chunk attends at most the window and itself
            tokens = min(tokens, window + chunk)
            overshoot = self._window_overshoot(chunk)
        scores = self.n_q_heads * chunk * tokens * 4
        history = 0
        if self.layout.scheme == "kvarn":
            history = 2 * tokens * widest.n_kv_heads * widest.head_dim * (2 + widest.dtype_bytes)
        return scores + history + overshoot

    def _window_overshoot(self, chunk: int) -> int:
        """What a windowed row may hold past its window while a prompt chunk runs: KVarN the
        records of the chunk's own tiles (dropped once the chunk is done), a rotating cache the
        chunk's tokens (trimmed by the next token), every layout layer."""
        if self.layout.scheme == "kvarn":
            return (chunk // self.layout.tile_size + 1) * self.block_bytes()
        return sum(int(round(chunk * self.layout.bytes_per_token(l.head_dim, l.n_kv_heads)))
                   for l in self.layers if l.kind == "layout")

    def reserved_tokens(self, prompt_tokens: int, max_tokens: int) -> int:
        return min(prompt_tokens + max_tokens, self.context_length)

    def reservation(self, prompt_tokens: int, max_tokens: int, n: int = 1) -> Reservation:
        tokens = self.reserved_tokens(prompt_tokens, max_tokens)
        return Reservation(kv=n * self.sequence_bytes(tokens), transient=self.transient_bytes(tokens))


def machine_memory_bytes(device_info: dict[str, object]) -> int:
    """The memory the KV budget is carved from: a GPU's working set where MLX reports one,
    else the machine's physical memory."""
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        value = device_info.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_budget_bytes(memory_bytes: int, weight_bytes: int) -> int:
    """Half the machine's memory, less the weights (activations and the OS keep the rest)."""
    return max(int(memory_bytes * DEFAULT_BUDGET_FRACTION) - weight_bytes, 0)


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
