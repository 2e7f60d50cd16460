"""The fused tile commit (metal/cuda/commit.py) against kvarn's own pure-MLX quantizer
(``kvarn.pool.quantize_blocks_reference``):
its CUDA source run by the CPU emulator on a few small layouts, and the kernel on a GPU across
bits, head dims, tile sizes and tile counts (those skip on the CPU).

What must hold (docs/kernels.md): every code identical, except where kvarn's own pre-rounding
value (x - z) / a lies within CODE_WINDOW of a .5 boundary (then it may differ by one); every
float16 factor identical, except in a matrix whose normalization kept another of two iterates
whose imbalances tie to float noise (a "flip"; measured on converged tiles, where the iterates
differ by a gauge lr + t, lc - t), and then the matrix must dequantize to the same values within
FLIP_TOL. Counts are printed in the pytest summary (tests/metal/conftest.py) and, where the
environment names a file in KVARN_COMMIT_LOG, appended there one JSON line a comparison."""

from __future__ import annotations

import json
import os
from collections import Counter

import mlx.core as mx
import numpy as np
import pytest

from kvarn import quantize as Q
from kvarn.layout import KVLayout
from kvarn.pool import RECORD_FIELDS, quantize_blocks_reference, record_shapes
from metal.cuda import commit as C
from metal.selector import COMMIT_SELF_CHECK_CODES, Kernels, commit_self_check, cuda_backend
from tests.kvarn.reference import unpack
from tests.metal import cuda_emulator

HAS_CUDA = hasattr(mx, "cuda") and mx.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU: the fused commit kernel runs only there")
needs_gxx = pytest.mark.skipif(not cuda_emulator.available(), reason="no g++ for the CUDA emulator")
ITERS = 8
CODE_WINDOW = 1e-3  # distance of kvarn's pre-rounding value to a .5 boundary that explains a differing code
FLIP_TOL = 4e-3  # a flipped matrix dequantizes within this of the reference (max |diff| / max |ref|)
REPORT: Counter = Counter()
REPORT_KEYS = ("matrices", "codes", "code_mismatch", "factors", "factor_mismatch", "flip_matrices")


def format_report() -> str:
    counts = ", ".join(f"{k}={REPORT[k]}" for k in REPORT_KEYS)
    return "commit kernel vs kvarn.pool.quantize_blocks_reference: " + counts


def make_tiles(n: int, H: int, G: int, D: int, seed: int = 0) -> tuple[mx.array, mx.array]:
    """Rotated-looking float16 tiles: keys with uneven channels and a few loud tokens, values
    with an offset (the normalization and the asymmetric rounding both have work to do)."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n, H, G, D)) * rng.uniform(0.1, 4.0, (n, H, 1, D))
    keys[:, :, rng.integers(0, G, 3)] *= 6.0
    values = rng.standard_normal((n, H, G, D)) * 0.7 + rng.uniform(-0.5, 0.5, (n, H, 1, D))
    return mx.array(keys.astype(np.float16)), mx.array(values.astype(np.float16))


def reference(*, keys: mx.array, values: mx.array, key_bits: int, value_bits: int, iters: int = ITERS) -> dict:
    layout = KVLayout(scheme="kvarn", key_bits=key_bits, value_bits=value_bits, tile_size=keys.shape[2], iters=iters)
    return quantize_blocks_reference(keys, values, layout)


def _pre_rounding(m: mx.array, bits: int) -> np.ndarray:
    """kvarn's (x - z) / a for matrices m [..., R, C] (rows rounded)."""
    lr, lc = Q.normalize(m, ITERS)
    b = Q._balanced(m.astype(mx.float32), lr, lc)
    lo, hi = mx.min(b, axis=-1), mx.max(b, axis=-1)
    step = mx.maximum((hi - lo) / ((1 << bits) - 1), Q.STEP_MIN)
    return np.array((b - lo[..., None]) / step[..., None])


def compare(got: dict, ref: dict, keys: mx.array, values: mx.array, kb: int, vb: int) -> Counter:
    """Assert the module docstring's rules; return the counts."""
    n, H, G, D = keys.shape
    W = min(D, 128)
    S = D // W
    g = {k: np.array(v) for k, v in got.items()}
    r = {k: np.array(v) for k, v in ref.items()}
    for name in RECORD_FIELDS:
        assert g[name].shape == r[name].shape and g[name].dtype == r[name].dtype, name
    # codes, as matrices [n, H, S, R, C]: K rows = channels, V rows = tokens
    kq = [unpack(x, kb, G).astype(np.int32) for x in (g["k_codes"], r["k_codes"])]
    vq = [unpack(x.reshape(n, H, G, S, W * vb // 32), vb, W).transpose(0, 1, 3, 2, 4).astype(np.int32)
          for x in (g["v_codes"], r["v_codes"])]
    counts = Counter(matrices=2 * n * H * S, codes=2 * n * H * D * G)
    kv = keys.reshape(n, H, G, S, W).transpose(0, 1, 3, 2, 4).astype(mx.float32)  # [n,H,S,G,W]
    vv = values.reshape(n, H, G, S, W).transpose(0, 1, 3, 2, 4).astype(mx.float32)
    for (mine, theirs), bits, m in ((kq, kb, mx.swapaxes(kv, -1, -2)), (vq, vb, vv)):
        diff = mine != theirs
        if diff.any():
            assert np.abs(mine - theirs).max() == 1, "a code differs by more than one"
            pre = _pre_rounding(m, bits)[diff]
            near = np.abs(pre - np.floor(pre) - 0.5) < CODE_WINDOW
            assert near.all(), f"{int((~near).sum())} differing codes are not at a rounding boundary: {pre[~near][:4]}"
            counts["code_mismatch"] += int(diff.sum())
    # factors: identical, or a flipped matrix that dequantizes to the same values
    def deq_k(f, q):
        a, b, rr = (f[x].astype(np.float32) for x in ("k_alpha", "k_beta", "k_r"))
        return (q * a[..., None] + b[..., None]) * rr[..., None, :]  # [n,H,S,W,G]

    def deq_v(f, q):
        a, b = (f[x].astype(np.float32).transpose(0, 1, 3, 2) for x in ("v_alpha", "v_beta"))  # [n,H,S,G]
        c = f["v_c"].astype(np.float32).reshape(n, H, S, W)
        return (q * a[..., None] + b[..., None]) * c[..., None, :]  # [n,H,S,G,W]

    k_fields, v_fields = ("k_alpha", "k_beta", "k_r"), ("v_alpha", "v_beta", "v_c")
    for fields, deq, q in ((k_fields, deq_k, kq), (v_fields, deq_v, vq)):
        counts["factors"] += sum(r[x].size for x in fields)
        counts["factor_mismatch"] += sum(int((g[x] != r[x]).sum()) for x in fields)
        if fields == k_fields:
            bad = np.zeros((n, H, S), bool)
            for x in fields:
                bad |= (g[x] != r[x]).any(axis=-1)
        else:
            bad = ((g["v_alpha"] != r["v_alpha"]) | (g["v_beta"] != r["v_beta"])).any(axis=2)
            bad |= (g["v_c"] != r["v_c"]).reshape(n, H, S, W).any(axis=-1)
        if bad.any():
            mine, theirs = deq(g, q[1]), deq(r, q[1])  # the same codes: the factors alone
            err = np.abs(mine - theirs).max(axis=(-1, -2)) / np.abs(theirs).max(axis=(-1, -2))
            assert err[bad].max() <= FLIP_TOL, f"factors differ beyond a flip: {err[bad].max()}"
            counts["flip_matrices"] += int(bad.sum())
    REPORT.update(counts)
    log_path = os.environ.get("KVARN_COMMIT_LOG")
    if log_path:  # one line a comparison, written at once (a run cut short keeps what it measured)
        with open(log_path, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                                "G": G, "D": D, "n": n, "H": H, "kb": kb, "vb": vb, **counts}) + "\n")
    return counts


# ---- CPU: shapes and the verdict ----
@pytest.mark.parametrize("G,D,kb,vb", [(128, 128, 4, 2), (64, 64, 3, 8), (128, 256, 5, 6), (64, 256, 2, 4)])
def test_output_shapes_are_the_pools(G, D, kb, vb):
    layout = KVLayout.kvarn((kb, vb), tile_size=G)
    pool = {name: (5, *shape) for name, (shape, _) in record_shapes(layout, 3, D).items()}
    assert C.output_shapes(5, 3, G, D, kb, vb) == pool
    call = C.commit_launch(*make_tiles(5, 3, G, D), kb, vb, ITERS)
    assert call.output_shapes == [pool[name] for name in RECORD_FIELDS]
    assert call.output_dtypes == [dtype for _, dtype in record_shapes(layout, 3, D).values()]


def test_supported_layouts():
    assert C.is_supported(head_dim=128, tile_size=128, key_bits=4, value_bits=2)
    assert C.is_supported(head_dim=256, tile_size=64, key_bits=5, value_bits=6)
    assert not C.is_supported(head_dim=96, tile_size=128, key_bits=4, value_bits=2)
    assert not C.is_supported(head_dim=128, tile_size=32, key_bits=4, value_bits=2)
    assert C.shared_bytes(128, 128) <= 100_000


def test_verdict_without_a_kernel_never_calls_the_reference():
    """No kernel to check (no GPU backend, and no CPU kernels: ``backend=None``; on the CPU the
    commit is the C++ quantizer's, tests/metal/test_cpu_kernels.py): the reference is the verdict
    and is never called."""
    if HAS_CUDA:
        pytest.skip("a CUDA device is present: test_commit_path_on_cuda covers it")
    called = []
    kernels = Kernels(backend=None)
    path = kernels.commit_path(reference=lambda **kw: called.append(1), head_dim=64, tile_size=64)
    assert path == "reference" and not called
    assert kernels.decided_commit_path() == "reference"


# ---- the CUDA source run by the CPU emulator (slow: one thread per CUDA thread) ----
def emulated_quantize_tiles(keys: mx.array, values: mx.array, kb: int, vb: int, rows: int,
                            slots: mx.array | None = None) -> dict:
    """``metal.cuda.commit.quantize_tiles`` with the kernel run by the emulator (with ``slots``:
    ``quantize_window_tails`` of window buffers ``keys``/``values``); the outputs start
    poisoned, so an element the kernel leaves unwritten fails the comparison."""
    call = C.commit_launch(keys, values, kb, vb, ITERS, rows, slots=slots)
    np_dtype = {mx.uint32: np.uint32, mx.float16: np.float16, mx.int32: np.int32}
    ins = [np.ascontiguousarray(np.array(a)) for a in call.inputs]
    outs = [np.full(shape, 0xDEADBEEF if dtype == mx.uint32 else np.nan, np_dtype[dtype])
            for shape, dtype in zip(call.output_shapes, call.output_dtypes)]
    lib = cuda_emulator.build("kvarn_commit", *C.KERNEL_TEXT,  # the minified text MLX compiles
                              [(name, a.dtype) for name, a in zip(C.INPUTS, ins)],
                              [(name, o.dtype) for name, o in zip(RECORD_FIELDS, outs)], call.template)
    blocks = tuple(g // t for g, t in zip(call.grid, call.threadgroup))
    cuda_emulator.launch(lib, ins + outs, blocks, call.threadgroup[0])
    return {name: mx.array(o) for name, o in zip(RECORD_FIELDS, outs)}


# (G, D, kb, vb, n, H[, rows]): every G/W pairing once (G != W takes the K path's SPECIAL first stds)
EMULATED = [(64, 64, 4, 2, 2, 1), (128, 128, 4, 2, 1, 1), (64, 128, 2, 5, 1, 1), (64, 256, 8, 3, 1, 1),
            (128, 64, 6, 4, 1, 1, 4), (128, 128, 4, 2, 1, 1, 8)]  # 8 rows: the launch of blocks that fit any driver


@needs_gxx
@pytest.mark.parametrize("case", EMULATED, ids=lambda c: "G{}-D{}-k{}v{}-n{}-H{}".format(*c[:6])
                         + (f"-rows{c[6]}" if len(c) > 6 else ""))
def test_emulated_kernel_matches_quantize_blocks(case):
    G, D, kb, vb, n, H = case[:6]
    rows = case[6] if len(case) > 6 else C.DEFAULT_ROWS
    keys, values = make_tiles(n, H, G, D, seed=G + D + kb)
    got = emulated_quantize_tiles(keys, values, kb, vb, rows)
    compare(got, reference(keys=keys, values=values, key_bits=kb, value_bits=vb), keys, values, kb, vb)


def windows_holding(keys: mx.array, values: mx.array, slots: list[int], num_windows: int) -> tuple[mx.array, mx.array]:
    """Window buffers [num_windows, H, 2G, D] of noise whose windows ``slots`` hold these tiles
    as their tails (positions G .. 2G-1): what a decode step's commit reads."""
    n, H, G, D = keys.shape
    rng = np.random.default_rng(n + G)
    win = [rng.standard_normal((num_windows, H, 2 * G, D)).astype(np.float16) for _ in range(2)]
    for i, slot in enumerate(slots):
        win[0][slot, :, G:] = np.array(keys[i])
        win[1][slot, :, G:] = np.array(values[i])
    return mx.array(win[0]), mx.array(win[1])


@needs_gxx
@pytest.mark.parametrize("case", [(64, 64, 4, 2, [3, 0], 2), (64, 128, 2, 5, [1], 3)],
                         ids=lambda c: "G{}-D{}-k{}v{}-slots{}-H{}".format(*c))
def test_emulated_window_tails_match_quantize_blocks(case):
    """The decode commit's variant (WIN = 1): each tile read in place as the tail of its window
    (scattered windows, the sinks and other windows full of noise) gives the records of the
    gathered tails."""
    G, D, kb, vb, slots, H = case
    keys, values = make_tiles(len(slots), H, G, D, seed=G + D + kb)
    win_k, win_v = windows_holding(keys, values, slots, num_windows=max(slots) + 2)
    got = emulated_quantize_tiles(win_k, win_v, kb, vb, C.DEFAULT_ROWS, slots=mx.array(slots, dtype=mx.int32))
    compare(got, reference(keys=keys, values=values, key_bits=kb, value_bits=vb), keys, values, kb, vb)


@pytest.mark.parametrize("window", [False, True])
def test_the_eight_row_fallback_is_the_eight_row_launch(window):
    """A launch re-cut to 8 rows a thread (``_with_rows``) is the one ``commit_launch`` makes for
    8 rows: template, grid, block and outputs."""
    keys, values = make_tiles(3, 2, 128, 128, seed=1)
    slots = None
    if window:
        keys, values = windows_holding(keys, values, [2, 0, 3], num_windows=5)
        slots = mx.array([2, 0, 3], dtype=mx.int32)
    four = C.commit_launch(keys, values, 4, 2, ITERS, 4, slots=slots)
    eight = C.commit_launch(keys, values, 4, 2, ITERS, 8, slots=slots)
    got = C._with_rows(four, 8, 128, 128)
    assert four.threadgroup == (1024, 1, 1) and got.threadgroup == eight.threadgroup == (512, 1, 1)
    assert (got.template, got.grid, got.output_shapes) == (eight.template, eight.grid, eight.output_shapes)


def test_blocks_that_do_not_start_fall_back_to_eight_rows(monkeypatch):
    """Where the driver's compile of the 1,024-thread template needs too many registers (its one
    probe launch raises), commits run at 8 rows a thread; the probe runs once per template."""
    runs = []

    def run(call, D, G):
        runs.append(call)
        if call.threadgroup[0] > 512:
            raise RuntimeError("too many resources requested for launch")
        return {name: mx.zeros((1,)) for name in RECORD_FIELDS}

    monkeypatch.setattr(C, "_run", run)
    C._blocks_start.cache_clear()  # the device fact is asked afresh, of the stand-in launcher
    keys, values = make_tiles(2, 2, 128, 128, seed=2)
    call = C.commit_launch(keys, values, 4, 2, ITERS, 4)
    try:
        C._launch(call, 128, 128, (4, 2))
        C._launch(call, 128, 128, (4, 2))
    finally:
        C._blocks_start.cache_clear()  # not this stand-in's answer for the real kernel
    probes = [c for c in runs if c.threadgroup[0] == 1024]
    assert len(probes) == 1 and probes[0].grid == (1024, 2, 1)  # one tile of one head, K and V
    assert [c.threadgroup[0] for c in runs[1:]] == [512, 512]
    assert dict(runs[-1].template)["ROWS"] == 8 and runs[-1].grid == (2 * 2 * 512, 2, 1)


def test_pool_window_tails_are_the_gathered_tails():
    """``kvarn.pool.quantize_window_tails`` (whichever path runs here) gives the records of
    ``quantize_blocks`` over the gathered tails, byte for byte."""
    from kvarn.pool import quantize_blocks, quantize_window_tails
    layout = KVLayout(scheme="kvarn", key_bits=4, value_bits=2, tile_size=64, iters=ITERS)
    keys, values = make_tiles(3, 2, 64, 64, seed=5)
    win_k, win_v = windows_holding(keys, values, [4, 1, 2], num_windows=6)
    got = quantize_window_tails(win_k, win_v, mx.array([4, 1, 2], dtype=mx.int32), layout)
    want = quantize_blocks(keys, values, layout)
    for name in RECORD_FIELDS:
        assert np.array_equal(np.array(got[name]), np.array(want[name])), name


def test_compare_sees_a_wrong_code():
    """The comparison discriminates: one code moved by one, away from any boundary, fails."""
    keys, values = make_tiles(1, 1, 64, 64, seed=1)
    ref = reference(keys=keys, values=values, key_bits=4, value_bits=2)
    bad = dict(ref)
    words = np.array(ref["k_codes"])
    words[0, 0, 0, 5, 0] ^= 1 << 4  # the second code of channel 5
    bad["k_codes"] = mx.array(words)
    with pytest.raises(AssertionError):
        compare(bad, ref, keys, values, 4, 2)
    scaled = dict(ref, v_c=(ref["v_c"].astype(mx.float32) * 1.05).astype(mx.float16))
    with pytest.raises(AssertionError):
        compare(scaled, ref, keys, values, 4, 2)


# ---- the kernel on a GPU ----
BITS = [(kb, vb) for kb in (2, 3, 4, 8) for vb in (2, 4, 8)] + [(5, 6)]
SHAPES = [(64, 64, 3, 2), (64, 128, 4, 8), (128, 64, 2, 4), (64, 256, 8, 3), (128, 256, 6, 2)]


@needs_cuda
@pytest.mark.parametrize("kb,vb", BITS)
def test_kernel_matches_quantize_blocks_bits(kb, vb):
    keys, values = make_tiles(3, 2, 128, 128, seed=10 * kb + vb)
    kw = dict(keys=keys, values=values, key_bits=kb, value_bits=vb)
    compare(C.quantize_tiles(**kw), reference(**kw), keys, values, kb, vb)


@needs_cuda
@pytest.mark.parametrize("G,D,kb,vb", SHAPES)
def test_kernel_matches_quantize_blocks_shapes(G, D, kb, vb):
    keys, values = make_tiles(5, 2, G, D, seed=G + D)
    kw = dict(keys=keys, values=values, key_bits=kb, value_bits=vb)
    compare(C.quantize_tiles(**kw), reference(**kw), keys, values, kb, vb)


@needs_cuda
@pytest.mark.parametrize("n", [1, 64])
def test_kernel_many_tiles(n):
    keys, values = make_tiles(n, 8, 128, 128, seed=n)
    kw = dict(keys=keys, values=values, key_bits=4, value_bits=2)
    compare(C.quantize_tiles(**kw), reference(**kw), keys, values, 4, 2)


@needs_cuda
@pytest.mark.parametrize("G,D", [(128, 128)])
def test_kernel_four_rows_a_thread(G, D):
    keys, values = make_tiles(4, 2, G, D, seed=3)
    kw = dict(keys=keys, values=values, key_bits=4, value_bits=2)
    compare(C.quantize_tiles(**kw, rows=4), reference(**kw), keys, values, 4, 2)


@needs_cuda
@pytest.mark.parametrize("slots", [[0], [5, 2, 7], list(range(31, -1, -1))])
def test_kernel_window_tails(slots):
    keys, values = make_tiles(len(slots), 8, 128, 128, seed=len(slots))
    win_k, win_v = windows_holding(keys, values, slots, num_windows=max(slots) + 3)
    got = C.quantize_window_tails(win_k=win_k, win_v=win_v, slots=mx.array(slots, dtype=mx.int32), key_bits=4,
                                  value_bits=2)
    kw = dict(keys=keys, values=values, key_bits=4, value_bits=2)
    compare(got, reference(**kw), keys, values, 4, 2)
    tiles = C.quantize_tiles(**kw)  # the same kernel either way: the same bytes
    for name in RECORD_FIELDS:
        assert np.array_equal(np.array(got[name]), np.array(tiles[name])), name


@needs_cuda
def test_commit_path_on_cuda():
    kernels = Kernels()
    assert kernels.commit_path(reference=reference, head_dim=128, tile_size=128) == "cuda-fused"
    assert kernels.commit_path(reference=reference, head_dim=96, tile_size=128) == "reference"  # no template
    kw = dict(head_dim=64, tile_size=64, key_bits=4, value_bits=2, iters=ITERS)
    same, worst = commit_self_check(reference, cuda_backend().commit, **kw)
    assert same == 1.0 and worst < 1e-3

    def broken(**kw):  # a reference that disagrees: the self-check must see it
        out = reference(**kw)
        return dict(out, k_codes=out["k_codes"] ^ mx.array(0x55555555, dtype=mx.uint32))
    same, _ = commit_self_check(broken, cuda_backend().commit, **kw)
    assert same < COMMIT_SELF_CHECK_CODES


def test_the_division_variant_is_a_template_argument():
    """Reciprocal divisions (MK = 1) unless the caller asks for IEEE divisions (the benchmark's
    comparison): an argument of the launch, not a setting of the module."""
    keys, values = make_tiles(1, 1, 64, 64, seed=1)
    assert dict(C.commit_launch(keys, values, 4, 2, ITERS).template)["MK"] == 1
    assert dict(C.commit_launch(keys, values, 4, 2, ITERS, reciprocal=False).template)["MK"] == 0


@needs_cuda
def test_reciprocal_and_ieee_divisions_give_the_same_bytes():
    keys, values = make_tiles(4, 8, 128, 128, seed=9)
    kw = dict(keys=keys, values=values, key_bits=4, value_bits=2)
    fast, ieee = C.quantize_tiles(**kw), C.quantize_tiles(**kw, reciprocal=False)
    for name in RECORD_FIELDS:
        assert np.array_equal(np.array(fast[name]), np.array(ieee[name])), name
