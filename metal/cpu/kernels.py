"""The CPU kernels' Python faces: what ``kvarn`` calls, in shapes as the pool stores them, and an
adapter with ``metal.cuda.paged_decode.paged_decode_attention``'s signature (what the selector's
self-check and the tests compare with ``metal.reference``)."""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx

from metal.paged_plan import RowLengths
from metal.records import RECORD_FIELDS
from metal.reference import hadamard, validity_mask

WIDTHS = (2, 4, 8)  # code widths whose codes never straddle a 32-bit word
MAX_ROWS = 4  # rows of x ``rows_matmul`` takes (metal/cpu/src/kvarn_cpu.cpp)


class CpuKernels:
    """The built extension (``metal.cpu.build.load``) behind two entries."""

    def __init__(self, module: ModuleType) -> None:
        self.module = module
        self._scales: dict[int, float] = {}

    def rotate(self, x: mx.array, width: int, *, half: bool = False) -> mx.array:
        """``x`` (float32 [..., D], any strides) @ H along the last axis, H the normalized Hadamard
        matrix block-diagonal over slices of ``width`` (a power of two dividing D): the bits of
        ``mx.hadamard_transform`` over each slice, without its scalar loop (~120 us for a decode
        step's keys and values of 16 rows there, a few us here). ``half``: each result rounded to
        float16 and widened back, the bits of ``.astype(mx.float16).astype(mx.float32)`` after it
        (a KVarN window's values) without MLX's two one-thread conversions."""
        return self.module.rotate(x, width, self._scale(width), half)

    def _scale(self, width: int) -> float:
        """MLX's own normalization of a ``width``-wide Hadamard transform (a unit vector's first output)."""
        if width not in self._scales:
            self._scales[width] = mx.hadamard_transform(mx.eye(1, width, dtype=mx.float32))[0, 0].item()
        return self._scales[width]

    def rope(self, x: mx.array, offset: mx.array, *, dims: int, base: float, scale: float) -> mx.array:
        """``mx.fast.rope(x, dims, traditional=False, base=base, scale=scale, offset=offset)`` for
        float32 ``x`` [B, N, T, D] (any strides) and an int32 ``offset`` (one, or one a row): its
        CPU fallback's bits in one primitive instead of ~20 graph nodes a call."""
        return self.module.rope(x, offset, dims, base, scale)

    def rows_matmul(self, x: mx.array, w: mx.array) -> mx.array:
        """``x @ w.T`` for float32 ``x`` [..., K] of 1 to ``MAX_ROWS`` rows and ``w`` [N, K] (float32,
        or bfloat16: widened exactly, the bits of its float32 copy): each row of ``w`` read once
        from memory (OpenBLAS's sgemm packs all of ``w`` a call), float32 sums in another order
        (~1e-7 relative, closer to float64 than sgemm's)."""
        return self.module.rows_matmul(x, w)

    def swiglu(self, gate: mx.array, up: mx.array) -> mx.array:
        """``nn.silu(gate) * up`` (mlx-lm's ``swiglu``) for float32 ``gate`` and ``up`` of one
        shape (any strides): the bits of MLX's CPU kernels (its sigmoid and exp on every element)
        in vectorized loops, 7-30x faster than MLX's scalar exp."""
        return self.module.swiglu(gate, up)

    @staticmethod
    def is_supported(*, head_dim: int, key_bits: int, value_bits: int) -> bool:
        """Whether ``decode_attention`` takes this layout: one 128-channel slice a head (or a
        64-channel head), codes within a word."""
        return head_dim in (64, 128) and key_bits in WIDTHS and value_bits in WIDTHS

    @staticmethod
    def quantizes(*, head_dim: int, tile_size: int, key_bits: int, value_bits: int) -> bool:
        """Whether ``quantize_tiles`` takes this layout: one slice a head, codes filling whole words."""
        return (head_dim in (64, 128) and key_bits in WIDTHS and value_bits in WIDTHS
                and (tile_size * key_bits) % 32 == 0 and tile_size >= 2)

    def quantize_tiles(self, *, keys: mx.array, values: mx.array, key_bits: int, value_bits: int,
                       iters: int) -> dict[str, mx.array]:
        """The record fields (block-major, ``metal.records.RECORD_FIELDS``) of rotated tiles
        [n, H, G, D] (float16 or float32): ``metal.cuda.commit.quantize_tiles``' signature, the
        pure-MLX quantizer's bytes."""
        return dict(zip(RECORD_FIELDS, self.module.quantize_tiles(keys, values, key_bits, value_bits, iters)))

    def quantize_window_tails(self, *, win_k: mx.array, win_v: mx.array, slots: mx.array, key_bits: int,
                              value_bits: int, iters: int) -> dict[str, mx.array]:
        """``quantize_tiles`` of the tails of windows ``slots`` ([n] int32) of window buffers
        [Nw, H, 2G, D]: a decode step's commit (``metal.cuda.commit.quantize_window_tails``' signature)."""
        G = win_k.shape[2] // 2
        return self.quantize_tiles(keys=win_k[slots][:, :, G:], values=win_v[slots][:, :, G:], key_bits=key_bits,
                                   value_bits=value_bits, iters=iters)

    def dequantize_records(self, records: dict[str, mx.array], table: mx.array, *, key_bits: int,
                           value_bits: int) -> tuple[mx.array, mx.array]:
        """Rotated keys and values [B, H, nb*G, D] (float32) of the records ``table`` [B, nb]
        (fields as the pool stores them, read in place): ``kvarn.pool.dequantize_blocks``' bits."""
        k_rec, v_rec = self.module.dequantize_records(
            table, _key_codes(records), records["k_alpha"], records["k_beta"], records["k_r"],
            records["v_codes"], records["v_alpha"], records["v_beta"], records["v_c"], key_bits, value_bits)
        return k_rec, v_rec

    def exp_rows(self, scores: mx.array, top: mx.array | None = None, *, mask: mx.array | None = None,
                 floor: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """(exp(x - top), their sums [..., 1], top [..., 1]) for x = float32 ``scores`` [..., n]
        plus, where given, an additive float32 ``mask`` [m, n] (row i of the scores takes mask row
        i % m: a [L, T] mask under scores [..., L, T]; the bits of ``scores + mask``); ``top``
        [..., 1], by default each row's max of x, raised to ``floor`` [..., 1] where given
        (``kvarn.cpu_attention._exp_below``'s bits). One pass a row on every core, where MLX's add
        and max reduction are a pass over the whole score matrix each, on one thread."""
        weights, sums, top = self.module.exp_rows(scores, top, mask, floor)
        return weights, sums, top

    def decode_attention(self, q: mx.array, records: dict[str, mx.array], win_k: mx.array, win_v: mx.array,
                         win_ids: mx.array, table: mx.array | None, mask: mx.array, *, win_len: int,
                         key_bits: int, value_bits: int, scale: float | None = None) -> mx.array:
        """Softmax attention [B, H, R, D] of ``q`` (float32 [B, H, R, D], rotated and scaled) over
        each row's window ``win_ids`` [B] (its first ``win_len`` tokens of the windows [Nw, H, 2G, D],
        float32 or float16) and its records ``table`` [B, nb] (None: none), under the validity
        ``mask`` [B, 1 | R, win_len + nb*G] (bool); ``records`` as the pool stores them. With
        ``scale``, ``q`` is the model's queries: rotated (``rotate``'s bits) and scaled inside, and
        the output rotated back, the same bits as doing both around the call (two graph nodes and
        a multiply fewer a layer)."""
        if table is None:
            table = mx.zeros((q.shape[0], 0), mx.int32)
        width = 0 if scale is None else q.shape[-1]  # one slice a head (``is_supported``)
        return self.module.decode_records(
            q, win_k, win_v, win_ids, table, mask, _key_codes(records),
            records["k_alpha"], records["k_beta"], records["k_r"], records["v_codes"], records["v_alpha"],
            records["v_beta"], records["v_c"], win_len, key_bits, value_bits, width,
            self._scale(width) if width else 1.0, 1.0 if scale is None else scale)

    def paged_decode_attention(self, *, queries: mx.array, records: dict[str, mx.array], win_k: mx.array,
                               win_v: mx.array, table: mx.array | None, lengths: RowLengths, scale: float,
                               key_bits: int, value_bits: int, plan: object = None,
                               variant: object = None) -> mx.array:
        """``decode_attention`` behind ``metal.reference.reference_paged_decode_attention``'s
        signature (queries [B, n_q, 1, D] unrotated; the rows' lengths as host integers)."""
        B, n_q, _, D = queries.shape
        H = win_k.shape[1]
        G = win_k.shape[2] // 2
        q = (hadamard(queries.astype(mx.float32)) * scale).reshape(B, H, n_q // H, D)
        mask = validity_mask(lengths, G, 0 if table is None else table.shape[1])
        out = self.decode_attention(q, records, win_k, win_v, mx.array(lengths.slots, dtype=mx.int32), table,
                                    mask[:, None], win_len=2 * G, key_bits=key_bits, value_bits=value_bits)
        return hadamard(out).astype(queries.dtype).reshape(B, n_q, 1, D)


def _key_codes(records: dict[str, mx.array]) -> mx.array:
    """The key codes [N, H, 1, D, words] as the kernels read them: [N, H, D, words] (one slice)."""
    k_codes = records["k_codes"]
    N, H, _, D, words = k_codes.shape
    return k_codes.reshape(N, H, D, words)
