"""What a request costs in the KV cache: pure arithmetic (no tensors). The engine builds a
``Pricing`` from a probe of the model's caches at load; the scheduler's budget
(``engine/scheduler.py``: ``StaticBudget`` / ``PoolBudget``) admits by it, and the HTTP front door
refuses with the same price what can never fit. Also the memory the KV budget is carved from and
its default size (``machine_memory_bytes``, ``default_budget_bytes``).

A request reserves, from admission to its end, the bytes of ``T = min(prompt + max_tokens,
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
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvarn.layout import KVLayout

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
