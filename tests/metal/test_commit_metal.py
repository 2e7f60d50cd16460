"""The Metal twin of the fused tile commit (metal/msl/commit.py) against kvarn's pure-MLX
quantizer (``kvarn.pool.quantize_blocks_reference``): its Metal source run by the CPU emulator
(tests/metal/metal_emulator.py) under test_commit.py's rules (codes identical except at a rounding
boundary, factors identical except in a flipped matrix that dequantizes the same), the self-check
that decides it (passing on the body, failing on a broken one), that the body keeps its bytes
where a compiler contracts products into fused multiply-adds, and, on an Apple GPU only, the real
kernel."""

from __future__ import annotations

import platform
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from metal import KERNELS
from metal.cuda.commit import shared_bytes as cuda_shared_bytes
from metal.launch import minify
from metal.msl import commit as CM
from metal.msl.commit import HEADER, SOURCE
from metal.selector import COMMIT_SELF_CHECK_CODES, COMMIT_SELF_CHECK_FACTORS, CommitKernel, Kernels, \
    commit_self_check
from tests.metal import metal_emulator
from tests.metal import test_commit as TC
from tests.metal.test_commit import ITERS, make_tiles, reference, windows_holding

HAS_METAL = hasattr(mx, "metal") and mx.metal.is_available()
needs_metal = pytest.mark.skipif(not HAS_METAL, reason="no Apple GPU: the Metal commit kernel runs only there")
needs_gxx = pytest.mark.skipif(not metal_emulator.available(), reason="no g++ for the Metal emulator")
FMA = ("-O2", "-mfma", "-ffp-contract=fast")  # g++ fuses a * b + c where it may (x86-64 with FMA)


def check(got: dict, keys: mx.array, values: mx.array, kb: int, vb: int):
    """test_commit.py's rules against the pure-MLX quantizer (its counts kept out of the CUDA
    kernel's report line)."""
    counts = TC.compare(got, reference(keys=keys, values=values, key_bits=kb, value_bits=vb), keys, values, kb, vb)
    TC.REPORT.subtract(counts)
    return counts


def emulated(keys: mx.array, values: mx.array, kb: int, vb: int, rows: int = CM.DEFAULT_ROWS,
             slots: mx.array | None = None, **kw) -> dict:
    """``metal.msl.commit.quantize_tiles`` (with ``slots``: ``quantize_window_tails``) with the
    kernel run by the emulator; outputs start poisoned."""
    call = CM.commit_launch(keys, values, kb, vb, ITERS, rows, slots=slots)
    return {name: mx.array(o) for name, o in zip(CM.RECORD_FIELDS, metal_emulator.run_launch(call, **kw))}


def test_limits():
    """Apple's limits: the CUDA layout would need 52 KB of threadgroup memory at G = W = 128; the
    Metal one fits 32 KB everywhere, and the default 8 rows a thread give 512 threads."""
    assert cuda_shared_bytes(128, 128) > CM.MAX_THREADGROUP_MEMORY
    for D in CM.SUPPORTED_HEAD_DIMS:
        for G in CM.SUPPORTED_TILE_SIZES:
            assert CM.threadgroup_bytes(D, G) <= CM.MAX_THREADGROUP_MEMORY
            assert CM.is_supported(head_dim=D, tile_size=G, key_bits=4, value_bits=2)
    assert CM.threadgroup_bytes(128, 128) == 19072 and CM.threads(128, 128, CM.DEFAULT_ROWS) == 512
    assert not CM.is_supported(head_dim=96, tile_size=128, key_bits=4, value_bits=2)
    assert not CM.is_supported(head_dim=128, tile_size=128, key_bits=7, value_bits=2)
    call = CM.commit_launch(*make_tiles(3, 2, 64, 128), 4, 2, ITERS)
    assert call.output_shapes == [tuple(s) for s in TC.C.output_shapes(3, 2, 64, 128, 4, 2).values()]
    assert call.grid == (3 * 2 * 256, 2, 1) and call.threadgroup == (256, 1, 1)


# (G, D, kb, vb, n, H, rows): G = W (the plain path), G != W (the K path's SPECIAL first stds),
# 512 threads at G = W = 128, 4 rows a thread
EMULATED = [(64, 64, 4, 2, 2, 1, 8), (64, 128, 2, 4, 1, 1, 8), (128, 128, 8, 4, 1, 1, 8), (128, 64, 3, 2, 1, 1, 4)]


@needs_gxx
@pytest.mark.parametrize("case", EMULATED, ids=lambda c: "G{}-D{}-k{}v{}-n{}-H{}-rows{}".format(*c))
def test_emulated_kernel_matches_quantize_blocks(case):
    G, D, kb, vb, n, H, rows = case
    keys, values = make_tiles(n, H, G, D, seed=G + D + kb)
    check(emulated(keys, values, kb, vb, rows), keys, values, kb, vb)


@needs_gxx
def test_emulated_window_tails_match_quantize_blocks():
    """The decode commit (WIN = 1): each tile read in place as the tail of its window (scattered
    windows full of noise around it) gives the records of the gathered tails."""
    G, D, kb, vb, slots, H = 64, 64, 2, 8, [3, 0], 2
    keys, values = make_tiles(len(slots), H, G, D, seed=9)
    win_k, win_v = windows_holding(keys, values, slots, num_windows=5)
    check(emulated(win_k, win_v, kb, vb, slots=mx.array(slots, dtype=mx.int32)), keys, values, kb, vb)


def _kernels(**kw):
    def tiles(*, keys, values, key_bits, value_bits, iters):
        assert iters == ITERS
        return emulated(keys, values, key_bits, value_bits, **kw)

    def tails(*, win_k, win_v, slots, key_bits, value_bits, iters):
        assert iters == ITERS
        return emulated(win_k, win_v, key_bits, value_bits, slots=slots, **kw)
    return tiles, tails


# a butterfly one step short: every sum misses half of its lanes
BROKEN = minify(HEADER.replace("for (int m = L / 2; m > 0; m >>= 1) v = v + simd_shuffle_xor",
                               "for (int m = L / 2; m > 1; m >>= 1) v = v + simd_shuffle_xor"))


@needs_gxx
def test_emulated_self_check_passes_on_the_body_and_fails_on_a_broken_one():
    """``commit_self_check`` (what the selector runs on an Apple GPU) with the emulated Metal
    kernel: past the verdict's thresholds; with a broken butterfly it is below them, so the
    verdict would be the reference."""
    assert BROKEN != minify(HEADER)
    kw = dict(head_dim=64, tile_size=64, key_bits=4, value_bits=2, iters=ITERS)
    same, worst = commit_self_check(reference, CommitKernel(*_kernels()), **kw)
    assert same >= COMMIT_SELF_CHECK_CODES and worst <= COMMIT_SELF_CHECK_FACTORS
    same, worst = commit_self_check(reference, CommitKernel(*_kernels(header=BROKEN)), **kw)
    assert same < COMMIT_SELF_CHECK_CODES


@needs_gxx
def test_emulated_contraction_does_not_move_a_byte():
    """Built with g++ allowed to fuse (-O2 -mfma -ffp-contract=fast), the body gives the bytes of
    its unfused build: ``kc_mul`` keeps every product out of reach of contraction. The control:
    the same body with a plain ``a * b`` in ``kc_mul`` does change a factor under contraction."""
    cpuinfo = Path("/proc/cpuinfo")
    if platform.machine() != "x86_64" or not cpuinfo.exists() or "fma" not in cpuinfo.read_text().split():
        pytest.skip("not an x86-64 CPU with FMA instructions (the build uses -mfma)")
    keys, values = make_tiles(2, 1, 64, 64, seed=7)
    base = emulated(keys, values, 4, 2)
    fused = emulated(keys, values, 4, 2, flags=FMA)
    for name in CM.RECORD_FIELDS:
        assert np.array_equal(np.array(base[name]), np.array(fused[name])), name
    plain = minify(HEADER.replace("return as_type<float>(as_type<uint>(a * b) | z);", "return a * b;"))
    assert plain != minify(HEADER)
    plain_fused = emulated(keys, values, 4, 2, header=plain, flags=FMA)
    assert any(not np.array_equal(np.array(base[n]), np.array(plain_fused[n])) for n in CM.RECORD_FIELDS)


def test_the_opaque_zero_is_an_input():
    """``kc_mul``'s zero comes from the ``bits`` input (a constant the compiler could see through
    would not stop it fusing)."""
    assert "const uint z = (uint)bits[2];" in SOURCE
    call = CM.commit_launch(*make_tiles(1, 1, 64, 64), 4, 2, ITERS)
    assert np.array(call.inputs[2]).tolist() == [4, 2, 0]


def test_verdict_off_metal_is_not_metal_fused():
    path = Kernels().commit_path(reference=reference, head_dim=64, tile_size=64)
    if not HAS_METAL:
        assert path != "metal-fused"


# ---- the real kernel on an Apple GPU ----
@needs_metal
@pytest.mark.parametrize("G,D,kb,vb", [(128, 128, 4, 2), (64, 64, 3, 8), (64, 256, 8, 3), (128, 64, 2, 4)])
def test_kernel_matches_quantize_blocks(G, D, kb, vb):
    keys, values = make_tiles(5, 2, G, D, seed=G + D)
    check(CM.quantize_tiles(keys=keys, values=values, key_bits=kb, value_bits=vb), keys, values, kb, vb)


@needs_metal
def test_kernel_window_tails():
    slots = [5, 2, 7]
    keys, values = make_tiles(len(slots), 8, 128, 128, seed=3)
    win_k, win_v = windows_holding(keys, values, slots, num_windows=9)
    got = CM.quantize_window_tails(win_k=win_k, win_v=win_v, slots=mx.array(slots, dtype=mx.int32), key_bits=4,
                                   value_bits=2)
    check(got, keys, values, 4, 2)


@needs_metal
def test_commit_path_on_metal():
    assert KERNELS.commit_path(reference=reference, head_dim=128, tile_size=128) in ("metal-fused", "reference")
    same, worst = commit_self_check(reference, CommitKernel(CM.quantize_tiles, CM.quantize_window_tails),
                                    head_dim=128, tile_size=128, key_bits=4, value_bits=2, iters=ITERS)
    assert same >= COMMIT_SELF_CHECK_CODES and worst <= COMMIT_SELF_CHECK_FACTORS
