"""The KVarN block pool: every committed record of every row, block-major, one set of arrays per layer.

One *block* is one tile of G tokens of one layer, for all KV heads. Block ids are shared by the
layers: block 7 is tile-sized slot 7 in every layer's arrays, so a row's block table (one list of
ids) serves all layers, as in vLLM. Three kinds of storage, each with its own ids:

    records (quantized)   k_codes [N, H, S, W, G*bk/32] uint32   k_alpha/k_beta [N, H, S, W] f16
                          k_r     [N, H, S, G]            f16
                          v_codes [N, H, G, D*bv/32]      uint32   v_alpha/v_beta [N, H, G, S] f16
                          v_c     [N, H, D]               f16
    windows (float16)     win_k / win_v [Nw, H, 2G, D]     one per row: its sink (first G tokens) at
                                                           [0, G), its tail (uncommitted tokens) at [G, 2G)
                                                           (float16 values; held as float32 on the CPU:
                                                           ``KVLayout.window_dtype``)

    block n, head h of k_codes:  [ channel 0: G*bk/32 words | channel 1 | ... | channel W-1 ]  (contiguous)
    block n, head h of v_codes:  [ token 0: D*bv/32 words   | token 1   | ... | token G-1  ]  (contiguous)

So a kernel reads one tile of one head as one contiguous run per field (D = S*W; S = 1 for
head_dim <= 128). Id 0 of each kind is reserved: a *pad* target that batched gathers point unused
table entries at and batched writes send rows that have nothing to write to (it is never handed
out, and what lands there is never read unmasked).

Allocation (``BlockAllocator``, pure Python): reference counts, and a free queue with lazy eviction
as in vLLM v1's block pool: a block whose count drops to 0 goes to the queue's tail but keeps its
hash and stays findable (``lookup``) until the allocator hands it out again, least recently freed
first. Arrays grow by doubling when every id is taken (one copy, amortized); a block's bytes are
never moved otherwise, and nothing in the pool is ever written except through ``write_*`` with
fresh ids, so MLX updates the arrays in place (the pool holds the only reference).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import mlx.core as mx

from kvarn.layout import KVLayout
from kvarn.quantize import quantize_keys_values

PAD = 0  # the reserved id of every kind
RECORD_FIELDS = ("k_codes", "k_alpha", "k_beta", "k_r", "v_codes", "v_alpha", "v_beta", "v_c")
STORE_DTYPE = mx.float16


class BlockAllocator:
    """Ids 1..capacity-1 (0 is the pad), reference counts, and an LRU free queue with lazy eviction.

    Invariants: every id > 0 is either held (count > 0) or in the free queue, never both; a hashed
    block is in ``by_hash`` exactly while it has its hash (held, or free and not yet reused)."""

    def __init__(self, capacity: int = 1, lowest_first: bool = False) -> None:
        self.lowest_first = lowest_first  # hand out the lowest free id (ids without hashes: windows)
        self.capacity = max(capacity, 1)
        self.refs: list[int] = [0] * self.capacity
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, self.capacity))
        self.hash_of: dict[int, Hashable] = {}
        self.by_hash: dict[Hashable, int] = {}
        self.evicted = 0

    @property
    def num_held(self) -> int:
        return self.capacity - 1 - len(self.free)

    def grow(self, capacity: int) -> None:
        """More ids: queued after the free blocks without a hash and before the cached ones, so no
        cached block is evicted while a fresh id is left."""
        if capacity <= self.capacity:
            return
        free = OrderedDict((i, None) for i in self.free if i not in self.hash_of)
        free.update((i, None) for i in range(self.capacity, capacity))
        free.update((i, None) for i in self.free if i in self.hash_of)
        self.free = free
        self.refs += [0] * (capacity - self.capacity)
        self.capacity = capacity

    def allocate(self, n: int) -> list[int]:
        """``n`` ids with count 1, least recently freed first (a cached one loses its hash).
        The caller grows the allocator first if fewer than ``n`` are free."""
        if n > len(self.free):
            raise MemoryError(f"{n} blocks asked, {len(self.free)} free")
        out = []
        for _ in range(n):
            if self.lowest_first:
                block = min(self.free)
                del self.free[block]
            else:
                block, _ = self.free.popitem(last=False)
            key = self.hash_of.pop(block, None)
            if key is not None:
                del self.by_hash[key]
                self.evicted += 1
            self.refs[block] = 1
            out.append(block)
        return out

    def incref(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if self.refs[block] == 0:  # a cached free block comes back into use
                del self.free[block]
            self.refs[block] += 1

    def decref(self, blocks: Sequence[int]) -> None:
        """Counts down; a block reaching 0 joins the free queue's tail. Blocks are given in a
        row's order; they are queued last-first so a row's tail blocks are evicted before its
        head (the head is what other prompts share)."""
        for block in reversed(blocks):
            if self.refs[block] <= 0:
                raise ValueError(f"block {block} is not held")
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = None

    def set_hash(self, block: int, key: Hashable) -> None:
        if block in self.hash_of or key in self.by_hash:
            return
        self.hash_of[block] = key
        self.by_hash[key] = block

    def lookup(self, key: Hashable) -> int | None:
        """The block with this hash, if it still exists (held or cached free); not counted."""
        return self.by_hash.get(key)


def _grown(a: mx.array, capacity: int) -> mx.array:
    pad = mx.zeros((capacity - a.shape[0], *a.shape[1:]), a.dtype)
    return mx.concatenate([a, pad], axis=0)


@dataclass
class LayerArrays:
    """One layer's storage (see the module docstring for shapes); allocated at the layer's first write."""

    records: dict[str, mx.array] = field(default_factory=dict)
    win_k: mx.array | None = None
    win_v: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        return list(self.records.values()) + [a for a in (self.win_k, self.win_v) if a is not None]


def record_shapes(layout: KVLayout, H: int, D: int) -> dict[str, tuple[tuple[int, ...], mx.Dtype]]:
    """Per-block shape and dtype of each record field for H heads of D channels."""
    G = layout.tile_size
    W = layout.slice_width(D)
    S = D // W
    f16 = STORE_DTYPE
    return {"k_codes": ((H, S, W, G * layout.key_bits // 32), mx.uint32), "k_alpha": ((H, S, W), f16),
            "k_beta": ((H, S, W), f16), "k_r": ((H, S, G), f16),
            "v_codes": ((H, G, D * layout.value_bits // 32), mx.uint32), "v_alpha": ((H, G, S), f16),
            "v_beta": ((H, G, S), f16), "v_c": ((H, D), f16)}


def block_nbytes(layout: KVLayout, H: int, D: int) -> int:
    """Bytes of one record block of one layer."""
    total = 0
    for dims, dtype in record_shapes(layout, H, D).values():
        size = dtype.size
        for d in dims:
            size *= d
        total += size
    return total


def quantize_blocks(keys: mx.array, values: mx.array, layout: KVLayout) -> dict[str, mx.array]:
    """Quantize rotated float16 tiles [n, H, G, D] into n blocks (block-major record fields).

    The same quantizer as ``kvarn.record.quantize_tiles`` on the same tiles (so the same codes and
    factors, byte for byte: tested), laid out block-major, through ``mx.compile``: the ~200 small
    operations of the quantizer are built once and fused instead of built in Python at every
    commit, for tile counts padded to a power of two (tiles are quantized independently, so the
    zero padding changes nothing; on CUDA each compiled shape costs a JIT compile)."""
    fn = _COMPILED.get(layout)
    if fn is None:
        fn = _COMPILED[layout] = mx.compile(lambda k, v: tuple(_quantize_blocks(k, v, layout)[n] for n in RECORD_FIELDS))
    n = keys.shape[0]
    bucket = 1 << max(n - 1, 0).bit_length()  # padded to a power of two: a few compiled shapes, not one per n
    if bucket != n:
        pad = mx.zeros((bucket - n, *keys.shape[1:]), keys.dtype)
        keys, values = mx.concatenate([keys, pad]), mx.concatenate([values, pad])
    return {name: x[:n] for name, x in zip(RECORD_FIELDS, fn(keys, values))}


_COMPILED: dict[KVLayout, object] = {}


def warm_quantizer(layout: KVLayout, H: int, D: int, max_tiles: int) -> None:
    """Compile the quantizer for every tile-count bucket up to ``max_tiles`` now (at start-up)
    rather than in the first step that commits that many tiles (a JIT compile on CUDA)."""
    n = 1
    while True:
        tiles = mx.zeros((n, H, layout.tile_size, D), STORE_DTYPE)
        mx.eval(list(quantize_blocks(tiles, tiles, layout).values()))
        if n >= max_tiles:
            return
        n *= 2


def _quantize_blocks(keys: mx.array, values: mx.array, layout: KVLayout) -> dict[str, mx.array]:
    n, H, G, D = keys.shape
    W = layout.slice_width(D)
    S = D // W
    k = keys.reshape(n, H, G, S, W).transpose(0, 1, 3, 2, 4)  # [n,H,S,G,W]
    v = values.reshape(n, H, G, S, W).transpose(0, 1, 3, 2, 4)
    # K: codes [n,H,S,W,Gw], alpha [n,H,S,W], r [n,H,S,G]; V: codes [n,H,S,G,Ww], alpha [n,H,S,G], c [n,H,S,W]
    kt, vt = quantize_keys_values(k, v, layout.key_bits, layout.value_bits, layout.iters)
    return {"k_codes": kt.codes, "k_alpha": kt.alpha, "k_beta": kt.beta, "k_r": kt.r,
            "v_codes": vt.codes.transpose(0, 1, 3, 2, 4).reshape(n, H, G, -1),
            "v_alpha": vt.alpha.transpose(0, 1, 3, 2), "v_beta": vt.beta.transpose(0, 1, 3, 2),
            "v_c": vt.c.reshape(n, H, D)}


class KVarNPool:
    """Every KVarN row's storage for all layers of one model: allocators shared by the layers,
    arrays per layer (allocated lazily at a layer's first write, grown by doubling)."""

    def __init__(self, layout: KVLayout, num_layers: int) -> None:
        if layout.scheme != "kvarn":
            raise ValueError("KVarNPool needs a kvarn layout")
        self.layout = layout
        self.records = BlockAllocator()
        self.windows = BlockAllocator(lowest_first=True)  # consecutive windows read as one slice
        self.window_rows: dict[int, object] = {}  # window id -> the PagedRow holding it
        self.window_dtype = getattr(mx, layout.window_dtype)  # float16 values, see KVLayout.window_dtype
        self.layers = [LayerArrays() for _ in range(num_layers)]
        self.shapes: list[tuple[int, int] | None] = [None] * num_layers  # (H, D) per layer
        self.rows_made = 0  # serial numbers for rows (ids of freed Python objects get reused)
        self.step_memo: tuple | None = None  # (rows' serials and offsets, the decode step's index)

    # --- ids ---
    def allocate(self, kind: str, n: int) -> list[int]:
        allocator = getattr(self, kind)
        if n > len(allocator.free):
            allocator.grow(max(2 * allocator.capacity, allocator.capacity + n - len(allocator.free) + 1))
            for l in range(len(self.layers)):
                self._fit(l)
        return allocator.allocate(n)

    # --- arrays ---
    def ensure_layer(self, l: int, H: int, D: int) -> LayerArrays:
        """Layer ``l``'s arrays, allocated at the allocators' current capacities if new."""
        if self.shapes[l] is None:
            self.shapes[l] = (H, D)
            G = self.layout.tile_size
            arrays = self.layers[l]
            arrays.records = {name: mx.zeros((self.records.capacity, *shape), dtype)
                              for name, (shape, dtype) in record_shapes(self.layout, H, D).items()}
            arrays.win_k, arrays.win_v = (mx.zeros((self.windows.capacity, H, 2 * G, D), self.window_dtype)
                                          for _ in range(2))
        elif self.shapes[l] != (H, D):
            raise ValueError(f"layer {l} holds {self.shapes[l]} heads x channels, not {(H, D)}")
        return self.layers[l]

    def _fit(self, l: int) -> None:
        """Grow layer ``l``'s arrays to the allocators' capacities (no-op before its first write)."""
        if self.shapes[l] is None:
            return
        a = self.layers[l]
        if a.win_k.shape[0] < self.windows.capacity:
            a.win_k, a.win_v = _grown(a.win_k, self.windows.capacity), _grown(a.win_v, self.windows.capacity)
        if a.records["k_codes"].shape[0] < self.records.capacity:
            a.records = {name: _grown(x, self.records.capacity) for name, x in a.records.items()}

    def write_records(self, l: int, blocks: Sequence[int], fields: dict[str, mx.array]) -> None:
        """Blocks ``blocks`` of layer ``l`` := ``fields`` (block-major, one entry per block)."""
        ids = mx.array(list(blocks), dtype=mx.int32)
        records = self.layers[l].records
        for name in RECORD_FIELDS:
            records[name][ids] = fields[name].astype(records[name].dtype)

    def gather_records(self, l: int, table: mx.array) -> dict[str, mx.array]:
        """The record fields of blocks ``table`` (any int32 shape; the result has it in front)."""
        records = self.layers[l].records
        return {name: records[name][table] for name in RECORD_FIELDS}

    def nbytes(self) -> int:
        """What the pool's arrays hold in memory (all ids, free or not)."""
        return sum(a.nbytes for layer in self.layers for a in layer.arrays())

    def block_bytes(self) -> int:
        """Bytes of one record block summed over the layers."""
        return sum(block_nbytes(self.layout, *shape) for shape in self.shapes if shape is not None)


def dequantize_blocks(fields: dict[str, mx.array], layout: KVLayout, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """Gathered record fields [B, nb, H, ...] -> rotated keys and values [B, H, nb*G, D] in ``dtype``."""
    k_codes = fields["k_codes"]
    B, nb, H, S, W, _ = k_codes.shape
    G = layout.tile_size
    k = mx.dequantize(k_codes, fields["k_alpha"][..., None].astype(dtype), fields["k_beta"][..., None].astype(dtype),
                      group_size=G, bits=layout.key_bits)  # [B,nb,H,S,W,G]
    k = k * fields["k_r"][..., None, :].astype(dtype)
    k = k.transpose(0, 2, 1, 5, 3, 4).reshape(B, H, nb * G, S * W)
    v = mx.dequantize(fields["v_codes"], fields["v_alpha"].astype(dtype), fields["v_beta"].astype(dtype),
                      group_size=W, bits=layout.value_bits)  # [B,nb,H,G,D]
    v = v * fields["v_c"][:, :, :, None, :].astype(dtype)
    v = v.transpose(0, 2, 1, 3, 4).reshape(B, H, nb * G, S * W)
    return k, v
