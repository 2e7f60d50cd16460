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
    sinks (float16)       sink_k / sink_v [Ns, H, G, D]    cached copies of rows' sinks (the prefix
                                                           cache's block 0, ``apc/pool_tier.py``)

    block n, head h of k_codes:  [ channel 0: G*bk/32 words | channel 1 | ... | channel W-1 ]  (contiguous)
    block n, head h of v_codes:  [ token 0: D*bv/32 words   | token 1   | ... | token G-1  ]  (contiguous)

So a kernel reads one tile of one head as one contiguous run per field (D = S*W; S = 1 for
head_dim <= 128). Id 0 of each kind is reserved: a *pad* target that batched gathers point unused
table entries at and batched writes send rows that have nothing to write to (it is never handed
out, and what lands there is never read unmasked).

Allocation (``kvarn.allocator.BlockAllocator``, pure Python): reference counts, a queue of plain free ids and an
LRU queue of cached ones (lazy eviction as in vLLM v1's block pool): a hashed block whose count
drops to 0 is cached, keeps its hash and stays findable (``lookup``) until it is evicted, least
recently released first (by the pool past ``max_blocks``, or by the prefix cache when admission
needs its room: ``evict_to``). Arrays grow by doubling when no plain id is left (one copy,
amortized) and shrink only past the highest id in use (``shrink``, when the engine is idle); a
block's bytes are never moved otherwise, and nothing in the pool is ever written
except through ``write_*`` / ``save_sink`` with fresh ids, so MLX updates the arrays in place (the
pool holds the only reference).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import mlx.core as mx

from kvarn.layout import KVLayout
from kvarn.quantize import quantize_keys_values
from kvarn.allocator import BlockAllocator, counter
from metal import KERNELS
from metal.selector import CommitKernel

PAD = 0  # the reserved id of every kind
RECORD_FIELDS = ("k_codes", "k_alpha", "k_beta", "k_r", "v_codes", "v_alpha", "v_beta", "v_c")
STORE_DTYPE = mx.float16


def _grown(a: mx.array, capacity: int) -> mx.array:
    pad = mx.zeros((capacity - a.shape[0], *a.shape[1:]), a.dtype)
    return mx.concatenate([a, pad], axis=0)


@dataclass
class LayerArrays:
    """One layer's storage (see the module docstring for shapes); allocated at the layer's first write."""

    records: dict[str, mx.array] = field(default_factory=dict)
    win_k: mx.array | None = None
    win_v: mx.array | None = None
    sink_k: mx.array | None = None  # cached sinks [Ns, H, G, D] float16
    sink_v: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        return list(self.records.values()) + [a for a in (self.win_k, self.win_v, self.sink_k, self.sink_v)
                                              if a is not None]


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


@functools.lru_cache(maxsize=64)
def block_nbytes(layout: KVLayout, H: int, D: int) -> int:
    """Bytes of one record block of one layer (a function of its arguments alone, kept once
    computed: the metrics and the prefix cache ask at every step)."""
    total = 0
    for dims, dtype in record_shapes(layout, H, D).values():
        size = dtype.size
        for d in dims:
            size *= d
        total += size
    return total


def quantize_blocks(keys: mx.array, values: mx.array, layout: KVLayout) -> dict[str, mx.array]:
    """Quantize rotated float16 tiles [n, H, G, D] into n blocks (block-major record fields).

    Where ``metal.KERNELS`` has a commit kernel for the layout (it has the layout's template and
    passed its self-check against this module's quantizer: ``metal.cuda.commit.quantize_tiles`` on
    CUDA, the same bytes (tested); its Metal twin on an Apple GPU; on the CPU the C++ quantizer of
    ``metal.cpu``, the same bytes), one operation for every tile, head, K and V. Elsewhere the
    pure-MLX quantizer (``quantize_blocks_reference``)."""
    kernel = _commit_kernel(layout, keys.shape[3])
    if kernel is not None:
        return kernel.tiles(keys=keys, values=values, key_bits=layout.key_bits, value_bits=layout.value_bits,
                            iters=layout.iters)
    return quantize_blocks_reference(keys, values, layout)


def _commit_kernel(layout: KVLayout, D: int) -> CommitKernel | None:
    """The fused commit for this layout and head dim, or None (the pure-MLX quantizer runs)."""
    return KERNELS.commit(reference=_reference, head_dim=D, tile_size=layout.tile_size, key_bits=layout.key_bits,
                          value_bits=layout.value_bits, iters=layout.iters)


def quantize_window_tails(win_k: mx.array, win_v: mx.array, slots: mx.array, layout: KVLayout) -> dict[str, mx.array]:
    """``quantize_blocks`` of the tails of windows ``slots`` ([n] int32) of a layer's window
    buffers [Nw, H, 2G, D] (each window: sink then tail, G tokens each): a decode step's commit.
    Where a fused kernel runs it reads the tails in place (``metal.cuda.commit.quantize_window_tails``
    or its Metal twin: no gather, no copy, one launch); elsewhere the tails are gathered for the
    pure-MLX quantizer."""
    _, H, G2, D = win_k.shape
    G = G2 // 2
    kernel = _commit_kernel(layout, D)
    if win_k.dtype == mx.float16 and kernel is not None:
        return kernel.window_tails(win_k=win_k, win_v=win_v, slots=slots, key_bits=layout.key_bits,
                                   value_bits=layout.value_bits, iters=layout.iters)
    return quantize_blocks(win_k[slots][:, :, G:].astype(STORE_DTYPE), win_v[slots][:, :, G:].astype(STORE_DTYPE),
                           layout)


def _reference(*, keys: mx.array, values: mx.array, key_bits: int, value_bits: int, iters: int) -> dict[str, mx.array]:
    """``quantize_blocks_reference`` called as the fused commit's self-check calls it
    (``metal.selector.Kernels.commit_path``)."""
    layout = replace(KVLayout.kvarn((key_bits, value_bits), tile_size=keys.shape[2]), iters=iters)
    return quantize_blocks_reference(keys, values, layout)


def quantize_blocks_reference(keys: mx.array, values: mx.array, layout: KVLayout) -> dict[str, mx.array]:
    """The pure-MLX quantizer (``kvarn.quantize``: each tile on its own, the same codes and factors
    as the paper's reference in ``tests/kvarn/reference.py``, tested), laid out block-major, through
    ``mx.compile``: the ~200 small operations of the quantizer are built once and fused instead of
    built in Python at every commit, for tile counts padded to a power of two (tiles are quantized
    independently, so the zero padding changes nothing; on CUDA each compiled shape costs a JIT
    compile)."""
    fn = _compiled_quantizer(layout)
    n = keys.shape[0]
    bucket = 1 << max(n - 1, 0).bit_length()  # padded to a power of two: a few compiled shapes, not one per n
    if bucket != n:
        pad = mx.zeros((bucket - n, *keys.shape[1:]), keys.dtype)
        keys, values = mx.concatenate([keys, pad]), mx.concatenate([values, pad])
    return {name: x[:n] for name, x in zip(RECORD_FIELDS, fn(keys, values))}


@functools.lru_cache(maxsize=None)
def _compiled_quantizer(layout: KVLayout) -> Callable[[mx.array, mx.array], tuple[mx.array, ...]]:
    """The quantizer of one layout under ``mx.compile`` (made once per layout and process)."""
    return mx.compile(lambda k, v: tuple(_quantize_blocks(k, v, layout)[n] for n in RECORD_FIELDS))


def warm_quantizer(layout: KVLayout, H: int, D: int, max_tiles: int) -> None:
    """Decide the commit path (the fused kernel's self-check) and, where the pure-MLX quantizer
    runs, compile it for every tile-count bucket up to ``max_tiles`` now (at start-up) rather than
    in the first step that commits that many tiles (a JIT compile on CUDA); where the fused kernel
    runs, build the decode commit's template for these heads (``quantize_window_tails``). A bucket is warmed
    once per process (a second engine, as in the tests, finds it compiled: warming buckets 1..64
    evaluates 127 zero tiles, 1.5 s on a CPU)."""
    n = 1
    while True:
        key = (layout, H, D, n)
        if key not in _WARMED:
            tiles = mx.zeros((n, H, layout.tile_size, D), STORE_DTYPE)
            mx.eval(list(quantize_blocks(tiles, tiles, layout).values()))
            _WARMED.add(key)
        fused = _commit_kernel(layout, D) is not None
        if fused and (layout, H, D, "window") not in _WARMED:
            # the decode commit's kernel is its own template (WIN = 1, NH = the model's heads), which
            # the self-check (other heads) does not build: its first use in a step cost 3.9 s on the
            # H200 (the whole batch waited)
            G = layout.tile_size
            windows = mx.zeros((1, H, 2 * G, D), STORE_DTYPE)
            mx.eval(list(quantize_window_tails(windows, windows, mx.zeros((1,), mx.int32), layout).values()))
            _WARMED.add((layout, H, D, "window"))
        if n >= max_tiles or fused:
            return
        n *= 2


_WARMED: set[tuple[KVLayout, int, int, int | str]] = set()  # (layout, H, D, tile-count bucket or "window") evaluated once


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
    arrays per layer (allocated lazily at a layer's first write, grown by doubling).

    Three kinds of ids: ``records`` (quantized tiles, hashed when the prefix cache keeps them),
    ``windows`` (a row's float16 sink and tail) and ``sinks`` (cached copies of a row's sink, for
    the prefix cache: a hit copies one into the new row's window). ``max_blocks`` caps how many
    ids a kind may grow to (the engine sets it from the KV budget); past it, allocation evicts the
    least recently released cached block of that kind."""

    def __init__(self, layout: KVLayout, num_layers: int) -> None:
        if layout.scheme != "kvarn":
            raise ValueError("KVarNPool needs a kvarn layout")
        self.layout = layout
        clock = counter()  # one clock: cached records and sinks are evicted in one LRU order
        self.records = BlockAllocator(clock=clock)
        self.windows = BlockAllocator(lowest_first=True)  # consecutive windows read as one slice
        self.sinks = BlockAllocator(clock=clock)
        self.max_blocks: dict[str, int | None] = {"records": None, "windows": None, "sinks": None}
        self.window_rows: dict[int, object] = {}  # window id -> the PagedRow holding it
        self.window_dtype = getattr(mx, layout.window_dtype)  # float16 values, see KVLayout.window_dtype
        self.layers = [LayerArrays() for _ in range(num_layers)]
        self.shapes: list[tuple[int, int] | None] = [None] * num_layers  # (H, D) per layer
        self.rows_made = 0  # serial numbers for rows (ids of freed Python objects get reused)

    # --- ids ---
    def allocate(self, kind: str, n: int) -> list[int]:
        """``n`` plain ids of ``kind``: free ones, else the arrays grow (doubling, up to
        ``max_blocks``), else cached blocks are evicted, least recently released first."""
        allocator: BlockAllocator = getattr(self, kind)
        short = n - len(allocator.free)
        if short > 0:
            cap = self.max_blocks[kind]
            want = max(2 * allocator.capacity, allocator.capacity + short + 1)
            grown = want if cap is None else min(want, max(cap + 1, allocator.capacity))
            if grown > allocator.capacity:
                allocator.grow(grown)
                for l in range(len(self.layers)):
                    self._fit(l)
            while len(allocator.free) < n and allocator.cached:
                allocator.evict()
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
            arrays.sink_k, arrays.sink_v = (mx.zeros((self.sinks.capacity, H, G, D), STORE_DTYPE) for _ in range(2))
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
        if a.sink_k.shape[0] < self.sinks.capacity:
            a.sink_k, a.sink_v = _grown(a.sink_k, self.sinks.capacity), _grown(a.sink_v, self.sinks.capacity)
        if a.records["k_codes"].shape[0] < self.records.capacity:
            a.records = {name: _grown(x, self.records.capacity) for name, x in a.records.items()}

    def shrink(self) -> int:
        """Give back the arrays' rows past the highest id in use of each kind (plain free ids at the
        end: all of them once no row holds any and the prefix cache keeps none), as fresh copies,
        so the larger buffers are freed; returns the bytes released. Arrays grow by doubling and
        never shrink otherwise: after a burst of rows they would keep its high-water mark. The
        engine calls this when it goes idle (``Engine.release_idle_memory``)."""
        before = self.nbytes()
        for kind in ("records", "windows", "sinks"):
            getattr(self, kind).shrink()
        fresh = []
        for l, a in enumerate(self.layers):
            if self.shapes[l] is None:
                continue
            if a.records["k_codes"].shape[0] > self.records.capacity:
                a.records = {name: mx.array(x[: self.records.capacity]) for name, x in a.records.items()}
                fresh += a.records.values()
            if a.win_k.shape[0] > self.windows.capacity:
                a.win_k, a.win_v = (mx.array(x[: self.windows.capacity]) for x in (a.win_k, a.win_v))
                fresh += [a.win_k, a.win_v]
            if a.sink_k.shape[0] > self.sinks.capacity:
                a.sink_k, a.sink_v = (mx.array(x[: self.sinks.capacity]) for x in (a.sink_k, a.sink_v))
                fresh += [a.sink_k, a.sink_v]
        if fresh:
            mx.eval(fresh)  # the copies exist now: the old buffers go with their last reference
        return before - self.nbytes()

    def write_records(self, l: int, blocks: Sequence[int] | mx.array, fields: dict[str, mx.array]) -> None:
        """Blocks ``blocks`` of layer ``l`` := ``fields`` (block-major, one entry per block); ``blocks``
        ids, or an int32 array of them (a decode step makes it once for all its layers)."""
        records = self.layers[l].records
        if not isinstance(blocks, mx.array):
            blocks = list(blocks)
            if (blocks and blocks[-1] - blocks[0] == len(blocks) - 1 and mx.default_device().type == mx.DeviceType.cpu
                    and blocks == list(range(blocks[0], blocks[-1] + 1))):
                # consecutive ids (a fresh allocation, as a prompt chunk's or a disk read's usually is): one
                # slice update a field, in place like the scatter and 7x cheaper on the CPU (MLX's CPU scatter
                # computes an index per element: 11.6 of a 27-block disk load's 18 ms here); GPUs keep the
                # scatter they were measured with
                where = slice(blocks[0], blocks[-1] + 1)
                for name in RECORD_FIELDS:
                    records[name][where] = fields[name].astype(records[name].dtype)
                return
        ids = blocks if isinstance(blocks, mx.array) else mx.array(blocks, dtype=mx.int32)
        for name in RECORD_FIELDS:
            records[name][ids] = fields[name].astype(records[name].dtype)

    def gather_records(self, l: int, table: mx.array) -> dict[str, mx.array]:
        """The record fields of blocks ``table`` (any int32 shape; the result has it in front)."""
        records = self.layers[l].records
        return {name: records[name][table] for name in RECORD_FIELDS}

    # --- cached sinks ---
    def save_sink(self, slot: int, part: str = "sink") -> int:
        """A new sink id (count 1) holding window ``slot``'s sink (``part`` "sink": its first G
        tokens) or its tail part (``part`` "tail": the G positions after the sink, of which the
        row's ``tail_len`` are tokens), every layer."""
        sink = self.allocate("sinks", 1)[0]
        where = self._part(part)
        saved = []
        for l, a in enumerate(self.layers):
            if self.shapes[l] is not None:
                a.sink_k[sink: sink + 1] = mx.array(a.win_k[slot: slot + 1, :, where].astype(STORE_DTYPE))
                a.sink_v[sink: sink + 1] = mx.array(a.win_v[slot: slot + 1, :, where].astype(STORE_DTYPE))
                saved += [a.sink_k, a.sink_v]
        # copied now: a pending copy holds the windows' current version, so the next step's write of
        # the windows could not be in place (it would copy every window of every layer first)
        mx.eval(saved)
        return sink

    def load_sink(self, sink: int, slot: int, part: str = "sink") -> None:
        """Window ``slot``'s sink (or tail part, ``part`` "tail") := cached sink ``sink``, every layer."""
        where = self._part(part)
        for l, a in enumerate(self.layers):
            if self.shapes[l] is not None:
                a.win_k[slot: slot + 1, :, where] = mx.array(a.sink_k[sink: sink + 1].astype(self.window_dtype))
                a.win_v[slot: slot + 1, :, where] = mx.array(a.sink_v[sink: sink + 1].astype(self.window_dtype))

    def _part(self, part: str) -> slice:
        G = self.layout.tile_size
        if part not in ("sink", "tail"):
            raise ValueError(f"a window has a sink part and a tail part, not {part!r}")
        return slice(0, G) if part == "sink" else slice(G, 2 * G)

    def write_sink(self, l: int, sink: int, keys: mx.array, values: mx.array) -> None:
        """Layer ``l`` of cached sink ``sink`` := ``keys``, ``values`` [1, H, G, D] (a block read from disk)."""
        _, H, _, D = keys.shape
        a = self.ensure_layer(l, H, D)
        a.sink_k[sink: sink + 1] = keys.astype(STORE_DTYPE)
        a.sink_v[sink: sink + 1] = values.astype(STORE_DTYPE)

    # --- bytes ---
    def nbytes(self) -> int:
        """What the pool's arrays hold in memory (all ids, free or not)."""
        return sum(a.nbytes for layer in self.layers for a in layer.arrays())

    def block_bytes(self) -> int:
        """Bytes of one record block summed over the layers."""
        return sum(block_nbytes(self.layout, *shape) for shape in self.shapes if shape is not None)

    def sink_bytes(self) -> int:
        """Bytes of one cached sink (float16) summed over the layers."""
        G = self.layout.tile_size
        return sum(2 * H * G * D * STORE_DTYPE.size for H, D in filter(None, self.shapes))

    def window_bytes(self) -> int:
        """Bytes of one window (sink and tail, K and V, in the window's dtype) summed over the layers."""
        G = self.layout.tile_size
        return sum(4 * H * G * D * self.window_dtype.size for H, D in filter(None, self.shapes))

    def held_bytes(self) -> int:
        """What rows hold: their windows, the record blocks held (each once, however shared) and
        cached sinks pinned for a prefix hit."""
        return self.windows.num_held * self.window_bytes() + self.shared_bytes()

    def shared_bytes(self) -> int:
        """What rows hold in blocks that may be shared: the record blocks held (each once, however
        many rows and hits hold it) and cached sinks pinned for a prefix hit; not the windows,
        each row's own (what the KV budget counts from the pool; it prices windows per row)."""
        return self.records.num_held * self.block_bytes() + self.sinks.num_held * self.sink_bytes()

    def cached_bytes(self) -> int:
        """Bytes of the blocks and sinks that only the prefix cache keeps (count 0, hashed)."""
        return self.records.num_cached * self.block_bytes() + self.sinks.num_cached * self.sink_bytes()

    def evict_to(self, target: int) -> int:
        """Evict cached records and sinks, least recently released first, until at most
        ``target`` bytes stay cached; returns how many were evicted."""
        evicted = 0
        while self.cached_bytes() > max(target, 0):
            oldest = [(got, kind) for kind in (self.records, self.sinks) if (got := kind.oldest_cached())]
            min(oldest, key=lambda pair: pair[0])[1].evict()
            evicted += 1
        return evicted


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
