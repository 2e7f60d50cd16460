"""How a row is stored and how the model reaches it: the one place that knows every storage (the
storage factory), and the attention seam, the model's one way into the storages.

A row is one cache per layer. Which storage a layer gets is decided here, and so is everything
that differs by storage: making, forking, releasing and batching rows (prefix reuse's rebuilding
and snapshotting of rows: ``kvarn.snapshots``). Nowhere else branches on cache classes.

- KVarN: every plain attention layer (mlx-lm ``KVCache``) is a view of one ``PagedRow`` in the
  ``KVarNPool`` (block tables; ``kvarn.paged``), so a decode batch runs one graph per layer for
  all rows. The one KVarN storage: a row made outside the engine (``make_cache``: tests,
  ``kvarn kld``) is a row of a pool of its own.
- fp16 / affine: every plain attention layer's rows share one slot buffer per layer
  (``kvarn.slots``), so a decode batch runs one fused attention per layer. With ``--max-kv-size``
  they are rotating caches of their own (``kvarn.rotating``, as mlx-lm's ``max_kv_size``),
  batched row by row; rows made outside the engine with no capacity are mlx-lm's caches with an
  exact reservation (``kvarn.baselines``).
- Layers with a cache of their own (sliding windows, recurrent state) keep their model's cache,
  for every layout. Their prefix reuse is whole-row snapshots (the checkpoint tier), which each
  storage writes and reads itself (``kvarn.snapshots``).

The attention seam, the one place attention is routed. mlx-lm models call
``scaled_dot_product_attention(queries, keys, values, cache, scale, mask)`` from
``mlx_lm.models.base`` after ``cache.update_and_fetch``; each model module binds that name at
import time. ``install_attention_seam`` (called once, by ``engine.make_engine``) replaces it
in every loaded ``mlx_lm.models.*`` module with ``make_dispatch``'s function, which routes by the
cache the model passes, by capability: a storage that attends its own way has
``attend(queries, keys, values, *, scale, mask, sinks, dispatch, default)``, and no class is
named here:

- ``kvarn.paged.PagedLayer.attend``: one KVarN row's prompt chunk
  (``kvarn.attention.chunk_attention_over``) or lone decode token; a decode step's layer
  (``kvarn.decode_graph.PagedStepLayer.attend``, also behind ``kvarn.paged.PagedBatch``): a whole
  decode batch in one graph (a fused kernel, else ``kvarn.attention.decode_attention_over``);
- ``kvarn.slot_step.SlotStepLayer.attend`` (also behind ``kvarn.slots.SlotBatch``): the
  baselines' decode batch (the fused ragged kernel where the device has it, one call per deep row
  where that is faster, else ``default``);
- ``kvarn.batch.BatchRows.attend``: other rows batched together, each row through ``dispatch``;
- any other cache: ``default``, mlx-lm's own function (affine codes dequantized first where MLX
  lacks their ``quantized_matmul`` kernels, CUDA; float32 on the CPU through
  ``kvarn.cpu_attention``).

mlx-lm 0.32 has no attention-backend hook to register with, so this is the one seam; a model
whose module no longer holds the name fails at start-up rather than silently running fp16.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from kvarn import cpu_attention
from kvarn.attention import reads_codes_directly
from kvarn.baselines import AffineKVCache, FP16KVCache, fork_other
from kvarn.batch import BatchRows
from kvarn.decode_graph import DecodePlan, paged_plan
from kvarn.layout import KVLayout
from kvarn.paged import PagedBatch, PagedLayer, PagedRow
from kvarn.pool import KVarNPool
from kvarn.rotating import WINDOW_CACHES, AffineRotatingKVCache, make_window_cache
from kvarn.slot_step import slot_plan
from kvarn.slots import SlotBatch, SlotRow, SlotStore


def plain_layers(model: nn.Module) -> list[int]:
    """The layers that take the KV layout: plain full attention (mlx-lm ``KVCache``)."""
    return [l for l, cache in enumerate(make_prompt_cache(model)) if type(cache) is KVCache]


def make_stores(model: nn.Module, layout: KVLayout) -> list[SlotStore | None]:
    """One slot store per plain attention layer (``plain_layers``), None for layers that keep
    their model's own cache (fp16 / affine layouts)."""
    if layout.scheme == "kvarn":
        raise ValueError("slots hold the fp16 and affine baselines, not KVarN")
    bits = layout.key_bits if layout.scheme == "affine" else None
    plain = set(plain_layers(model))
    return [SlotStore(bits, layout.group_size) if l in plain else None for l in range(len(make_prompt_cache(model)))]


def make_row_cache(model: nn.Module, stores: Sequence[SlotStore | None], capacity: int) -> list[Any]:
    """A row's per-layer cache: a ``SlotRow`` of ``capacity`` tokens per store, the model's own
    cache elsewhere."""
    return [cache if store is None else store.new_row(capacity)
            for store, cache in zip(stores, make_prompt_cache(model), strict=True)]


class RowStore:
    """The rows of one model under one layout (owned by the engine's model runner)."""

    def __init__(self, model: nn.Module, layout: KVLayout) -> None:
        self.model = model
        self.layout = layout
        self.num_layers = len(make_prompt_cache(model))
        self.pool_layers = plain_layers(model) if layout.scheme == "kvarn" else []
        self.pool = KVarNPool(layout, self.num_layers) if layout.scheme == "kvarn" else None
        if layout.scheme == "kvarn" and layout.max_kv_size is not None and not self.exact:
            raise ValueError("--max-kv-size with kvarn needs a model whose every layer is plain attention "
                             "(its rows in the block pool); this model has layers of its own (sliding windows, "
                             "recurrent state): use --kv-scheme fp16 or affine")
        # windowed fp16 / affine rows are rotating caches of their own (``kvarn.rotating``), not slots
        windowed = layout.max_kv_size is not None
        self.slots = make_stores(model, layout) if layout.scheme != "kvarn" and not windowed else None

    @property
    def exact(self) -> bool:
        """Whether every layer is in the block pool (rows cut at blocks: the exact prefix tier)."""
        return self.pool is not None and len(self.pool_layers) == self.num_layers

    @property
    def in_place(self) -> bool:
        """Whether rows live in shared buffers that each step updates in place (pool or slots)."""
        return self.pool is not None or self.slots is not None

    def new_row(self, capacity: int | None) -> list[Any]:
        """A fresh row (one cache per layer) reserving ``capacity`` tokens."""
        if self.slots is not None and capacity is not None:
            return make_row_cache(self.model, self.slots, capacity)
        if self.pool is None:
            return make_cache(self.model, self.layout, capacity)
        return _paged(self.model, PagedRow(self.pool, self.pool_layers, self.layout.max_kv_size))

    @staticmethod
    def settle(cache: list[Any]) -> None:
        """After a prompt chunk was evaluated: a windowed paged row drops the records its next
        token will not attend (every layer has read them by now)."""
        row = paged_row(cache)
        if row is not None:
            row.evict()

    @staticmethod
    def fork(cache: list[Any]) -> list[Any]:
        """A second row with the same history (``n > 1``): paged layers share their blocks (the
        row forked once for all layers), slot rows copy their tokens into a slot of their own,
        other caches share buffers until either writes."""
        row = paged_row(cache)
        child = row.fork() if row is not None else None
        return [child.layers[layer.l] if isinstance(layer, PagedLayer) else
                layer.fork() if hasattr(layer, "fork") else fork_other(layer) for layer in cache]

    @staticmethod
    def release(cache: list[Any]) -> None:
        """Give a row's blocks and slots back (rows of other kinds are freed with their arrays)."""
        for layer in cache:
            if isinstance(layer, (PagedLayer, SlotRow)):
                layer.release()

    @staticmethod
    def own_nbytes(cache: list[Any]) -> int:
        """Bytes a row holds outside the shared pool and slot buffers."""
        return sum(c.nbytes for c in cache if not isinstance(c, (PagedLayer, SlotRow)))


def make_cache(model: nn.Module, layout: KVLayout, capacity: int | None = None) -> list[Any]:
    """A fresh row for ``layout`` outside the engine (one entry per layer): KVarN layers in a pool
    of the row's own, fp16 / affine layers as mlx-lm's caches with an exact reservation (rotating
    windows with ``layout.max_kv_size``); other layers keep their model's own cache."""
    if layout.scheme == "kvarn":
        layers = plain_layers(model)
        return _paged(model, PagedRow(KVarNPool(layout, len(make_prompt_cache(model))), layers, layout.max_kv_size))
    return [_baseline(cache, layout, capacity) for cache in make_prompt_cache(model)]


def _paged(model: nn.Module, row: PagedRow) -> list[Any]:
    return [row.layers[l] if l in row.layers else cache for l, cache in enumerate(make_prompt_cache(model))]


def _baseline(cache: Any, layout: KVLayout, capacity: int | None) -> Any:
    if type(cache) is not KVCache:
        return cache
    if layout.max_kv_size is not None:
        return make_window_cache(layout, capacity)
    if layout.scheme == "fp16":
        return FP16KVCache(capacity)
    return AffineKVCache(layout.group_size, layout.key_bits, capacity)


def paged_row(cache: Sequence[Any]) -> PagedRow | None:
    """The pool row a row's paged layers view (None: no layer is in the pool)."""
    return next((layer.row for layer in cache if isinstance(layer, PagedLayer)), None)


def uses_layout(cache: Any) -> bool:
    """Whether a layer cache is one of the layout's caches (others keep their model's own)."""
    return isinstance(cache, (FP16KVCache, AffineKVCache, PagedLayer, SlotRow))


def count_quantized_layers(model: nn.Module, layout: KVLayout) -> tuple[int, int]:
    """(layers that use ``layout``, windowed fp16 / affine rows included, all layers)."""
    caches = make_cache(model, layout)
    return sum(uses_layout(c) or isinstance(c, WINDOW_CACHES) for c in caches), len(caches)


def make_batch_cache(layer_rows: Sequence[Any]) -> Any:
    """The batch cache for one layer's decoding rows: rows in the KVarN pool (``PagedBatch``) or
    in the baselines' slots (``SlotBatch``), which their storage's decode step runs as one graph
    for all rows; rows of other caches (sliding windows, rotating windows) attend one by one
    (``BatchRows``)."""
    if layer_rows and isinstance(layer_rows[0], PagedLayer):
        return PagedBatch(layer_rows)
    if layer_rows and isinstance(layer_rows[0], SlotRow):
        return SlotBatch(layer_rows)
    return BatchRows(layer_rows, row_type=type(layer_rows[0]) if layer_rows else object)


class DecodeBatch:
    """The rows decoding together as one batch cache per layer. A row keeps its place while it
    decodes: one that leaves leaves a hole, filled by a row that joins, else by the batch's last
    row, so the rows' storage stays where the step reads it (``kvarn.decode_graph.place_windows``,
    ``kvarn.slots.SlotStore``: a hole costs one row's move, a join into a hole none) and the plan's
    structure stays the same (``engine/model_runner.py: DecodeGraphs``)."""

    def __init__(self) -> None:
        self.ids: list[Hashable] = []
        self.layers: list[BatchRows] = []

    def sync(self, wanted: tuple[Hashable, ...], caches: Mapping[Hashable, Sequence[Any]]) -> None:
        """The batch becomes ``wanted`` (row ids; ``caches``: a joining row's cache, one per layer):
        rows not in it leave, new ones take the holes, then the end (nobody's cache is copied here)."""
        keep, present = set(wanted), set(self.ids)
        joining = [i for i in wanted if i not in present]
        order = [i if i in keep else None for i in self.ids]
        if None not in order and not joining:
            return
        for k, i in enumerate(order):
            if i is None and joining:
                order[k] = joining.pop(0)
        while None in order:  # holes left: the last rows move into them
            last = order.pop()
            if last is not None:
                order[order.index(None)] = last
        order += joining
        survivors = [i for i in self.ids if i in keep]
        if len(survivors) < len(self.ids):
            index = {i: k for k, i in enumerate(self.ids)}
            for layer in self.layers:
                layer.filter([index[i] for i in survivors])
        new = [i for i in order if i not in present]
        if new and not self.layers:
            self.layers = [make_batch_cache([caches[i][l] for i in new]) for l in range(len(caches[new[0]]))]
        elif new:
            for l, layer in enumerate(self.layers):
                layer.extend(caches[i][l] for i in new)
        held = survivors + new  # the layers' order now
        if held != order:
            index = {i: k for k, i in enumerate(held)}
            for layer in self.layers:
                layer.filter([index[i] for i in order])
        self.ids = order

    def drop(self, gone: tuple[Hashable, ...]) -> None:
        """Rows that ended leave at once (their caches are released with them)."""
        if any(i in gone for i in self.ids):
            self.sync(tuple(i for i in self.ids if i not in gone), {})

    def clear(self) -> None:
        self.ids, self.layers = [], []


def plan_decode(batches: Sequence[Any], pad: bool = True, counts: Sequence[int] | None = None) -> DecodePlan | None:
    """A decode step of these batch caches (one per layer) planned as arrays, so that it can be
    compiled (``kvarn.decode_graph``, ``kvarn.slot_step``): rows in the KVarN pool or in the
    baselines' slots, every layer's; None for anything else (layers of other caches: the model
    then runs through the batch caches, whose storage takes the same step layer by layer; slot
    rows attending one by one). ``counts``: tokens per row (a verify's; KVarN rows only:
    ``verifies_in_batch``)."""
    if batches and all(isinstance(b, PagedBatch) for b in batches):
        return paged_plan(batches, pad, counts)
    if batches and all(isinstance(b, SlotBatch) for b in batches) and not (counts and max(counts) > 1):
        return slot_plan(batches, pad)
    return None


def verifies_in_batch(cache: Sequence[Any]) -> bool:
    """Whether this row's verify (its last token and drafts) can ride in the planned decode batch
    (``plan_decode`` with counts): every layer a paged KVarN view, unwindowed; other rows verify in
    a chunk forward of their own (``engine/verify.py``)."""
    row = paged_row(cache)
    return row is not None and row.max_kv_size is None and all(isinstance(c, PagedLayer) for c in cache)


def batchable(cache: Sequence[Any]) -> bool:
    """Whether rows of these caches can decode as one batch (attention caches only: recurrent
    state cannot take a batch's rows)."""
    return all(isinstance(c, (KVCache, RotatingKVCache, QuantizedKVCache, AffineRotatingKVCache, PagedLayer, SlotRow))
               for c in cache)


# --- speculative verify: a row writes its drafted tokens, then drops the rejected ones ---

def verify_room(cache: Sequence[Any]) -> int:
    """How many tokens a verify (a chunk of the row's last token and its drafts) may write now:
    a paged row stays inside its tile (``PagedRow.verify_room``), a slot row inside its
    reservation; 0 where a layer cannot drop tokens again (rotating windows, recurrent state)."""
    row = paged_row(cache)
    room = row.verify_room() if row is not None else 1 << 30
    for layer in cache:
        if isinstance(layer, SlotRow):
            room = min(room, layer.capacity - layer.offset)
        elif not isinstance(layer, PagedLayer):
            return 0
    return room


def begin_verify(cache: Sequence[Any]) -> None:
    """The row's next chunk is a verify: a paged row commits no tile until ``end_verify``."""
    row = paged_row(cache)
    if row is not None:
        row.hold()


def end_verify(cache: Sequence[Any], rejected: int) -> None:
    """The verify's ``rejected`` newest tokens leave the row; a paged row then commits the tile
    its accepted tokens filled."""
    row = paged_row(cache)
    if row is not None:
        row.accept(rejected)
    for layer in cache:
        if isinstance(layer, SlotRow) and layer.trim(rejected) != rejected:
            raise RuntimeError("a slot row could not drop its rejected tokens")


# --- the attention seam ---

SEAM_NAME = "scaled_dot_product_attention"
_SEAM_MARK = "__kvarn_seam__"


def affine_dequantized_attention(queries: mx.array, keys: tuple, values: tuple, cache: QuantizedKVCache,
                                 scale: float, mask: Any, sinks: mx.array | None) -> mx.array:
    """mlx-lm's affine cache through dequantization: where MLX CUDA has no ``quantized_matmul``
    kernel for a sequence length (any odd one), this gives the same values to float noise."""
    k = mx.dequantize(*keys, group_size=cache.group_size, bits=cache.bits).astype(queries.dtype)
    v = mx.dequantize(*values, group_size=cache.group_size, bits=cache.bits).astype(queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask, sinks=sinks)


def make_dispatch(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """The seam around mlx-lm's ``original`` function: a cache that knows how it attends (it has
    ``attend``: paged KVarN rows and batches, slot batches, batches of other rows) is asked;
    otherwise mlx-lm's own attention runs (affine codes dequantized first where MLX lacks their
    kernels), or on the CPU, for float32 keys, ``kvarn.cpu_attention.attention`` (MLX's CPU SDPA
    is unfused, with a scalar exp: fp16 slots decoding one 3,072-token row took 1.77 ms a layer
    there against ~0.8 ms)."""
    def default(queries, keys, values, cache, scale, mask, sinks=None):  # noqa: ANN001
        if isinstance(keys, tuple) and getattr(cache, "bits", None) is not None and not reads_codes_directly():
            return affine_dequantized_attention(queries, keys, values, cache, scale, mask, sinks)
        if cpu_attention.runs(queries, keys, mask, sinks):  # MLX's CPU SDPA: a scalar exp, B-packing products
            if isinstance(mask, str):
                mask = cpu_attention.causal_mask(queries.shape[2], keys.shape[2])
            return cpu_attention.attention(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):  # noqa: ANN001
        attend = getattr(cache, "attend", None)
        if attend is None:
            return default(queries, keys, values, cache, scale, mask, sinks)
        return attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks,
                      dispatch=scaled_dot_product_attention, default=default)

    setattr(scaled_dot_product_attention, _SEAM_MARK, True)
    return scaled_dot_product_attention


def install_attention_seam(model: Any) -> list[str]:
    """Route every mlx-lm model module's ``scaled_dot_product_attention`` through KVarN.

    mlx-lm model modules bind the function at import time, so each loaded ``mlx_lm.models.*``
    module that holds it is patched. Fails loudly if the model's own module does not hold it
    (a new mlx-lm that moved the seam must not silently run fp16). Returns the patched modules.
    """
    own = sys.modules[type(model).__module__]
    if not callable(getattr(own, SEAM_NAME, None)):
        raise RuntimeError(f"{own.__name__} has no '{SEAM_NAME}': cannot route attention to KVarN "
                           "(mlx-lm's attention seam moved; refusing to run without it)")
    patched = []
    for name, module in list(sys.modules.items()):
        current = getattr(module, SEAM_NAME, None) if name.startswith("mlx_lm.models.") else None
        if current is None:
            continue
        if not getattr(current, _SEAM_MARK, False):  # installed once per module, never wrapped twice
            setattr(module, SEAM_NAME, make_dispatch(current))
        patched.append(name)
    if own.__name__ not in patched:
        raise RuntimeError(f"failed to install the KVarN attention seam in {own.__name__}")
    return patched
