"""KVarN's CPU kernels (metal/cpu): built at first use (``metal.cpu.build``), they must match an
independent float64 NumPy attention over the pool's records (the decode attention) and the
pure-MLX exp bit for bit (the softmax's exp), inside ``mx.compile`` too; the selector uses them
only once they built and passed their self-check, and otherwise says why and runs the pure-MLX
paths."""

from __future__ import annotations

import logging
from pathlib import Path
from unittest import mock

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu as mlx_lm_swiglu

from kvarn import attention, cpu_attention
from kvarn.layout import KVLayout
from kvarn.pool import RECORD_FIELDS, LayerArrays, dequantize_blocks, quantize_blocks_reference
from metal.cpu import build
from metal.cpu.kernels import CpuKernels
from metal.selector import CPU_NATIVE, REFERENCE, Kernels
from metal.reference import validity_mask
from tests.metal.cases import dequantize_block, make_case, max_rel_error, numpy_attention

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU kernels run where MLX runs on the CPU")

# float32 against float64: each code dequantized before its product, fused multiply-adds (measured
# 1e-7 .. 1e-6; the pure-MLX path, factored, reaches 1.4e-5 on the same rows)
TOL = 5e-6


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    try:
        return CpuKernels(build.load())
    except build.Unavailable as exc:
        pytest.fail(f"the CPU kernels do not build here: {exc}")


CASES = {  # rows' token counts, KV heads, query heads a KV head, head_dim, tile, key bits, value bits
    "k4v2-ragged": ([300, 1, 129, 700], 2, 4, 128, 128, 4, 2),
    "k2v4-tile64": ([65, 64, 200], 2, 2, 64, 64, 2, 4),
    "k8v8-one-row": ([900], 1, 8, 128, 128, 8, 8),
    "k4v4-no-records": ([5, 128], 2, 2, 128, 128, 4, 4),
}


@pytest.mark.parametrize("window_dtype", [mx.float32, mx.float16], ids=["f32-windows", "f16-windows"])
@pytest.mark.parametrize("name", list(CASES))
def test_decode_attention_matches_a_float64_attention_over_the_records(kernels, name, window_dtype):
    tokens, H, n_rep, D, G, kb, vb = CASES[name]
    case = make_case(tokens, n_kv_heads=H, n_rep=n_rep, head_dim=D, tile_size=G, key_bits=kb, value_bits=vb,
                     dtype=mx.float32, window_dtype=window_dtype, seed=len(tokens))
    out = kernels.paged_decode_attention(**case.kwargs())
    assert out.shape == case.queries.shape and out.dtype == mx.float32
    assert max_rel_error(np.array(out), numpy_attention(case)) < TOL


def test_decode_attention_reads_a_mask_per_query_row(kernels):
    """A mask [B, R, cols] (one per query head of a KV head): a row whose query heads see different
    keys gets each its own softmax, as the float64 attention over what that head sees."""
    case = make_case([400], n_kv_heads=1, n_rep=2, head_dim=128, tile_size=128, key_bits=4, value_bits=2,
                     dtype=mx.float32, window_dtype=mx.float32, seed=3)
    G, D = 128, 128
    s = case.lengths.slots[0]
    q = mx.random.normal((1, 1, 2, D), key=mx.random.key(0))
    cols = 2 * G + 2 * G
    seen = np.zeros((1, 2, cols), bool)
    seen[0, 0, :G] = True  # query head 0: the sink only
    seen[0, 1, :G] = seen[0, 1, 2 * G:] = True  # query head 1: the sink and both records
    seen[0, 1, G: G + case.lengths.tail_len[0]] = True  # and the tail
    out = kernels.decode_attention(q, case.records, case.win_k, case.win_v, mx.array([s], dtype=mx.int32),
                                   case.table, mx.array(seen), win_len=2 * G, key_bits=4, value_bits=2)
    wk, wv = np.array(case.win_k[s, 0]).astype(np.float64), np.array(case.win_v[s, 0]).astype(np.float64)
    recs = [dequantize_block(case, blk, 0) for blk in case.tables[0]]
    keys = np.concatenate([wk] + [k for k, _ in recs])
    vals = np.concatenate([wv] + [v for _, v in recs])
    qq = np.array(q[0, 0]).astype(np.float64)
    for r in range(2):
        sc = keys[seen[0, r]] @ qq[r]
        p = np.exp(sc - sc.max())
        want = (p / p.sum()) @ vals[seen[0, r]]
        assert max_rel_error(np.array(out[0, 0, r]), want) < TOL


def test_decode_attention_in_a_compiled_function_gives_the_same_bits(kernels):
    case = make_case([300, 140], n_kv_heads=2, n_rep=2, head_dim=128, tile_size=128, key_bits=4, value_bits=2,
                     dtype=mx.float32, window_dtype=mx.float32, seed=4)
    eager = kernels.paged_decode_attention(**case.kwargs())
    compiled = mx.compile(lambda q: kernels.paged_decode_attention(**{**case.kwargs(), "queries": q}))
    assert mx.array_equal(compiled(case.queries), eager).item()


def test_bad_inputs_are_refused_with_their_reason(kernels):
    case = make_case([300], n_kv_heads=2, n_rep=2, head_dim=128, tile_size=128, key_bits=4, value_bits=2,
                     dtype=mx.float32, window_dtype=mx.float32)
    q = mx.zeros((1, 2, 2, 128))
    good = dict(win_len=256, key_bits=4, value_bits=2)
    ids = mx.array([case.lengths.slots[0]], dtype=mx.int32)
    with pytest.raises(ValueError, match="mask must be bool"):
        kernels.decode_attention(q, case.records, case.win_k, case.win_v, ids, case.table,
                                 mx.ones((1, 1, 7), mx.bool_), **good)
    with pytest.raises(ValueError, match="code widths"):
        kernels.decode_attention(q, case.records, case.win_k, case.win_v, ids, case.table,
                                 mx.ones((1, 1, 384), mx.bool_), win_len=256, key_bits=3, value_bits=2)


@pytest.mark.parametrize("given_top", [False, True])
def test_the_softmax_exp_is_the_pure_mlx_exp_bit_for_bit(kernels, given_top):
    scores = mx.random.normal((2, 3, 5, 1000), key=mx.random.key(1)) * 8
    scores = mx.where(mx.random.uniform(shape=scores.shape, key=mx.random.key(2)) < 0.2, -mx.inf, scores)
    top = mx.max(scores, axis=-1, keepdims=True)
    weights, sums, used_top = kernels.exp_rows(scores, top if given_top else None)
    want = cpu_attention._exp_below(scores, top)
    assert mx.array_equal(weights, want).item()
    assert mx.array_equal(used_top, top).item()
    assert sums.shape == (2, 3, 5, 1)
    # float32 sums of 1,000 terms in another order (8 lanes): 1.3e-6 apart measured
    assert mx.allclose(sums, mx.sum(want, axis=-1, keepdims=True), rtol=5e-6, atol=0).item()
    compiled = mx.compile(lambda s: kernels.exp_rows(s)[0])
    assert mx.array_equal(compiled(scores), kernels.exp_rows(scores)[0]).item()


def test_a_mask_added_in_the_softmax_pass_gives_the_bits_of_adding_it_first(kernels):
    """An additive [L, T] mask under scores [..., L, T] added inside the pass (each row its mask row),
    the top raised to a floor where one is given: the bits of MLX's add, max and maximum before the
    kernel, eagerly and inside ``mx.compile``; ``kvarn.cpu_attention.masked_softmax_parts`` takes the
    kernel and, without it, gives the same bits."""
    k1, k2, k3 = mx.random.split(mx.random.key(21), 3)
    scores = mx.random.normal((2, 3, 7, 500), key=k1) * 8
    mask = mx.where(mx.random.uniform(shape=(7, 500), key=k2) < 0.4, -mx.inf, mx.random.normal((7, 500)) * 0.1)
    mask = mx.concatenate([mx.full((1, 500), -mx.inf), mask[1:]])  # a row that sees nothing
    i = mx.arange(42).reshape(2, 3, 7, 1)  # a floor on every row that sees nothing (MLX's exp of nan is nan, the kernel's 0)
    floor = mx.where((i % 3 == 0) | (i % 7 == 0), 30.0, -mx.inf) + mx.random.normal((2, 3, 7, 1), key=k3)
    x = scores + mask
    for fl in (None, floor):
        top = mx.max(x, axis=-1, keepdims=True)
        top = top if fl is None else mx.maximum(top, fl)
        want_w, want_s, _ = kernels.exp_rows(x, top)
        for got in (kernels.exp_rows(scores, mask=mask, floor=fl),
                    mx.compile(lambda s, m: kernels.exp_rows(s, mask=m, floor=fl))(scores, mask)):
            assert mx.array_equal(got[0], want_w, equal_nan=True).item()
            assert mx.array_equal(got[1], want_s, equal_nan=True).item()
            assert mx.array_equal(got[2], top).item()
    with mock.patch("kvarn.cpu_attention.KERNELS.cpu", return_value=kernels):
        fused = cpu_attention.masked_softmax_parts(scores, mask, floor)
    with mock.patch("kvarn.cpu_attention.KERNELS.cpu", return_value=None):
        plain = cpu_attention.masked_softmax_parts(scores, mask, floor)
    assert mx.array_equal(fused[0], plain[0]).item() and mx.array_equal(fused[2], plain[2]).item()
    assert mx.allclose(fused[1], plain[1], rtol=5e-6, atol=0).item()  # sums in another order (8 lanes)


def test_the_softmax_pass_refuses_what_it_cannot_take(kernels):
    scores = mx.zeros((2, 4, 10))
    with pytest.raises(ValueError, match="m divides"):
        kernels.exp_rows(scores, mask=mx.zeros((3, 10)))  # 8 rows, 3 mask rows
    with pytest.raises(ValueError, match="m divides"):
        kernels.exp_rows(scores, mask=mx.zeros((4, 10), mx.float16))
    with pytest.raises(ValueError, match="m divides"):
        kernels.exp_rows(scores, mask=mx.zeros((4, 9)))
    with pytest.raises(ValueError, match="not both"):
        kernels.exp_rows(scores, mx.zeros((2, 4, 1)), floor=mx.zeros((2, 4, 1)))
    with pytest.raises(ValueError, match="one a row"):
        kernels.exp_rows(scores, floor=mx.zeros((2, 1, 1)))


def test_a_rotation_rounded_to_float16_gives_mlx_s_conversions_bits(kernels):
    """``rotate(.., half=True)``: the rotation's bits rounded as MLX's ``astype(float16)`` and widened
    back by its ``astype(float32)``: across float16's range and past it (infinities), subnormals,
    NaN (MLX's own NaN) and every 7,919th float32 bit pattern; for views read in place (a model's
    transposed keys, a slice, a broadcast row) and inside ``mx.compile``. ``kvarn.quantize.rotate``
    and ``kvarn.decode_graph.rounded`` take it on the CPU and give the same bits without it."""
    patterns = mx.array(np.arange(0, 2**32, 7919, dtype=np.uint64).astype(np.uint32).view(np.float32))
    patterns = patterns[: patterns.size // 128 * 128].reshape(-1, 128)
    want = patterns.astype(mx.float16).astype(mx.float32)
    got = kernels.rotate(patterns, 1, half=True)  # a width of 1: the identity, then the rounding alone
    assert np.array_equal(np.array(got).view(np.uint32), np.array(want).view(np.uint32))
    x = mx.random.normal((4, 96, 3, 128), key=mx.random.key(23)) * mx.power(10.0, mx.linspace(-9, 3.5, 128))
    x = mx.concatenate([x[:3], mx.full((1, 96, 3, 128), float("nan"))])
    for view in (x.transpose(0, 2, 1, 3), x[:, ::3, 1:], mx.broadcast_to(x[:1, :1, :1], (2, 5, 1, 128)), x):
        want = mx.hadamard_transform(view).astype(mx.float16).astype(mx.float32)
        for out in (kernels.rotate(view, 128, half=True), mx.compile(lambda a: kernels.rotate(a, 128, half=True))(view)):
            assert np.array_equal(np.array(out).view(np.uint32), np.array(want).view(np.uint32))
    assert mx.isinf(kernels.rotate(mx.eye(1, 128) * 1e6, 128, half=True)).all().item()  # each +-88,388
    from kvarn.decode_graph import rounded
    from kvarn.quantize import rotate
    keys = x[:3].transpose(0, 2, 1, 3)
    with mock.patch("kvarn.quantize.KERNELS.cpu", return_value=kernels):
        fused = rounded(keys, mx.float32)
    with mock.patch("kvarn.quantize.KERNELS.cpu", return_value=None):
        plain = rounded(keys, mx.float32)
        assert mx.array_equal(rounded(keys, mx.float16), plain.astype(mx.float16)).item()
        with pytest.raises(ValueError, match="takes float32"):
            rotate(keys.astype(mx.bfloat16), half=True)
    assert mx.array_equal(fused, plain).item()


@pytest.mark.parametrize("width,D", [(64, 64), (128, 128), (128, 256), (128, 512)])
def test_the_rotation_is_mlx_s_hadamard_transform_bit_for_bit(kernels, width, D):
    """Each ``width`` slice of the last axis through MLX's own butterflies: the same bits as
    ``mx.hadamard_transform`` of the sliced array, eagerly and inside ``mx.compile``; it is its own
    inverse to float noise; ``kvarn.quantize.rotate`` takes it on the CPU."""
    x = mx.random.normal((3, 2, 5, D), key=mx.random.key(4)) * mx.linspace(0.01, 50.0, D)
    want = mx.hadamard_transform(x.reshape(3, 2, 5, D // width, width)).reshape(x.shape)
    assert mx.array_equal(kernels.rotate(x, width), want).item()
    assert mx.array_equal(mx.compile(lambda a: kernels.rotate(a, width))(x), want).item()
    assert mx.allclose(kernels.rotate(kernels.rotate(x, width), width), x, rtol=1e-5, atol=1e-4).item()
    from kvarn.quantize import rotate
    with mock.patch("metal.cpu.kernels.CpuKernels.rotate", side_effect=AssertionError("the kernel ran")) as kernel, \
            mock.patch("kvarn.quantize.KERNELS.cpu", return_value=kernels):
        with pytest.raises(AssertionError, match="the kernel ran"):
            rotate(x)
    assert kernel.called
    with mock.patch("kvarn.quantize.KERNELS.cpu", return_value=None):
        assert mx.array_equal(rotate(x), want).item()


def test_inputs_that_are_views_read_as_their_contiguous_copies(kernels):
    """A transposed, broadcast or sliced input (no Contiguous node is put in the graph for it) gives
    what its contiguous copy gives, for each primitive."""
    x = mx.random.normal((4, 128, 6), key=mx.random.key(8)).transpose(0, 2, 1)
    row = mx.broadcast_to(mx.random.normal((1, 128), key=mx.random.key(9)), (5, 128))
    for view in (x, row, mx.random.normal((9, 256), key=mx.random.key(10))[::2, 64:192]):
        for half in (False, True):
            copy = mx.array(view.tolist())
            assert mx.array_equal(kernels.rotate(view, 128, half=half), kernels.rotate(copy, 128, half=half)).item()
    scores = mx.random.normal((300, 7), key=mx.random.key(12)).T
    for got, want in zip(kernels.exp_rows(scores), kernels.exp_rows(mx.array(scores.tolist()))):
        assert mx.array_equal(got, want).item()
    case = make_case([300, 140], n_kv_heads=2, n_rep=2, head_dim=128, tile_size=128, key_bits=4, value_bits=2,
                     dtype=mx.float32, window_dtype=mx.float32)
    q = mx.random.normal((2, 128, 2, 2), key=mx.random.key(13)).transpose(0, 2, 3, 1)  # [B, H, R, D], a view
    ids = mx.array(case.lengths.slots, dtype=mx.int32)
    nb = case.table.shape[1]
    mask = mx.broadcast_to(mx.arange(256 + nb * 128)[None, None] < 200, (2, 1, 256 + nb * 128))
    kw = dict(win_len=256, key_bits=4, value_bits=2)
    got = kernels.decode_attention(q, case.records, case.win_k, case.win_v, ids, case.table, mask, **kw)
    want = kernels.decode_attention(mx.array(q.tolist()), case.records, case.win_k, case.win_v, ids, case.table,
                                    mx.array(mask.tolist()), **kw)
    assert mx.array_equal(got, want).item()


def test_the_rotation_refuses_what_it_cannot_rotate(kernels):
    with pytest.raises(ValueError, match="float32"):
        kernels.rotate(mx.zeros((2, 128), mx.float16), 128)
    with pytest.raises(ValueError, match="power-of-two width"):
        kernels.rotate(mx.zeros((2, 96)), 64)
    with pytest.raises(ValueError, match="power-of-two width"):
        kernels.rotate(mx.zeros((2, 96)), 96)


def test_a_rotation_off_mlx_s_bits_keeps_the_kernels_out(caplog):
    """The rotation must give MLX's bits (windows and records may not depend on who rotated them):
    one flipped bit is enough for the CPU to run the pure-MLX paths."""
    registry = Kernels()
    real = CpuKernels.rotate

    def off(self, x, width, **kw):  # noqa: ANN001, ANN003, ANN202
        out = real(self, x, width, **kw)
        return mx.where(mx.arange(out.size).reshape(out.shape) == 7, out * (1 + 2 ** -20), out)

    with mock.patch("metal.cpu.kernels.CpuKernels.rotate", off), caplog.at_level(logging.WARNING):
        assert registry.cpu() is None
    assert registry.decided_cpu_path() == REFERENCE


def test_the_seam_routes_cpu_decode_attention_to_the_kernel_when_it_runs():
    """``kvarn.attention`` calls the kernel where the registry hands it out, the pure-MLX path where
    it does not, and both agree."""
    case = make_case([300, 20], n_kv_heads=2, n_rep=2, head_dim=128, tile_size=128, key_bits=4, value_bits=2,
                     dtype=mx.float32, window_dtype=mx.float32, seed=6)
    layout = KVLayout.kvarn("k4v2")
    G = 128
    a = LayerArrays(records=case.records, win_k=case.win_k, win_v=case.win_v)
    L = case.lengths
    mask = np.zeros((2, 1, 1, 2 * G + case.table.shape[1] * G), bool)
    for b in range(2):
        mask[b, ..., : L.sink_len[b]] = True
        mask[b, ..., G: G + L.tail_len[b]] = True
        mask[b, ..., 2 * G: 2 * G + L.num_tiles[b] * G] = True
    kw = dict(windows=mx.array(L.slots, dtype=mx.int32), win_len=2 * G, table=case.table, mask=mx.array(mask))
    registry = Kernels()
    with mock.patch.object(attention, "KERNELS", registry):
        native = attention.decode_attention_over(case.queries, a, layout, case.scale, **kw)
        assert registry.decided_cpu_path() == CPU_NATIVE
    with mock.patch.object(registry, "cpu", lambda: None), mock.patch.object(cpu_attention, "KERNELS", registry):
        with mock.patch.object(attention, "KERNELS", registry):
            plain = attention.decode_attention_over(case.queries, a, layout, case.scale, **kw)
    want = numpy_attention(case)
    assert max_rel_error(np.array(native), want) < TOL
    assert max_rel_error(np.array(plain), want) < 5e-5


def test_the_registry_uses_the_kernels_once_built_and_checked(caplog):
    registry = Kernels()
    with caplog.at_level(logging.WARNING):
        first = registry.cpu()
    assert isinstance(first, CpuKernels) and registry.cpu() is first
    assert registry.decided_cpu_path() == CPU_NATIVE
    assert not caplog.records


def test_kernels_off_their_references_are_not_used(caplog):
    registry = Kernels()
    with mock.patch("metal.selector.cpu_self_check", lambda kernels: 0.5), caplog.at_level(logging.WARNING):
        assert registry.cpu() is None
    assert registry.decided_cpu_path() == REFERENCE
    assert "off their references" in caplog.text


def test_switched_off_or_unbuildable_kernels_give_the_pure_mlx_paths_with_the_reason(caplog, monkeypatch, tmp_path):
    monkeypatch.setenv(build.DISABLE_ENV, "0")
    registry = Kernels()
    with caplog.at_level(logging.WARNING):
        assert registry.cpu() is None
    assert "KVARN_CPU_KERNELS=0" in caplog.text
    monkeypatch.delenv(build.DISABLE_ENV)
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")  # a compiler that fails
    with pytest.raises(build.Unavailable, match="the build failed"):
        build.load()
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built is left to load


def test_asked_first_inside_a_trace_the_verdict_is_decided_and_the_kernels_run_there():
    """The self-check evaluates arrays of its own, so a first ask inside ``mx.compile``'s trace
    decides as anywhere else, and the traced function runs the kernel."""
    registry = Kernels()
    scores = mx.random.normal((4, 300), key=mx.random.key(3))

    def traced(x):
        return registry.cpu().exp_rows(x)[0]

    out = mx.compile(traced)(scores)
    assert registry.decided_cpu_path() == CPU_NATIVE
    assert mx.array_equal(out, cpu_attention._exp_below(scores, mx.max(scores, axis=-1, keepdims=True))).item()


def test_a_built_library_is_reused_not_rebuilt(kernels):
    """A second load finds the library of the same source, flags and versions in the cache."""
    path = Path(kernels.module.__file__)
    before = path.stat().st_mtime_ns
    again = build.load()
    assert Path(again.__file__) == path and path.stat().st_mtime_ns == before


@pytest.mark.parametrize("preset,G", [("k4v2", 128), ("k2v4", 64), ("k8v8", 128), ("k4v4", 64)])
def test_the_quantizer_gives_the_pure_mlx_quantizers_bytes(kernels, preset, G):
    """Every record field, byte for byte, on tiles with uneven channels and one channel far off
    zero (the case the float64 moments are for)."""
    layout = KVLayout.kvarn(preset, tile_size=G)
    rng = np.random.default_rng(G)
    n, H, D = 3, 2, G
    keys = rng.standard_normal((n, H, G, D)) * rng.uniform(0.2, 3.0, (1, H, 1, D))
    keys[..., 5] += 40.0
    keys, values = mx.array(keys.astype(np.float16)), mx.array(rng.standard_normal((n, H, G, D)).astype(np.float16))
    got = kernels.quantize_tiles(keys=keys, values=values, key_bits=layout.key_bits, value_bits=layout.value_bits,
                                 iters=layout.iters)
    want = quantize_blocks_reference(keys, values, layout)
    for name in RECORD_FIELDS:
        assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype, name
        assert mx.array_equal(got[name], want[name]).item(), name


def test_on_the_cpu_the_commit_is_the_cpp_quantizer_checked_against_the_reference():
    registry = Kernels()
    called = []

    def reference(**kw):
        called.append(1)
        layout = KVLayout(scheme="kvarn", key_bits=kw["key_bits"], value_bits=kw["value_bits"],
                          tile_size=kw["keys"].shape[2], iters=kw["iters"])
        return quantize_blocks_reference(kw["keys"], kw["values"], layout)

    assert registry.commit_path(reference=reference, head_dim=128, tile_size=128) == CPU_NATIVE
    assert called  # the self-check ran it
    commit = registry.commit(reference=reference, head_dim=128, tile_size=128, key_bits=4, value_bits=2, iters=8)
    assert commit is not None
    windows = mx.random.normal((3, 2, 256, 128), key=mx.random.key(9))
    tails = commit.window_tails(win_k=windows, win_v=windows * 0.5, slots=mx.array([2, 0], dtype=mx.int32),
                                key_bits=4, value_bits=2, iters=8)
    want = commit.tiles(keys=windows[mx.array([2, 0])][:, :, 128:], values=(windows * 0.5)[mx.array([2, 0])][:, :, 128:],
                        key_bits=4, value_bits=2, iters=8)
    assert all(mx.array_equal(tails[name], want[name]).item() for name in RECORD_FIELDS)


@pytest.mark.parametrize("preset,G", [("k4v2", 128), ("k2v4", 64), ("k8v8", 128)])
def test_records_read_in_place_dequantize_to_the_pure_mlx_bits(kernels, preset, G):
    """A prompt chunk's history: the rows' records by their table, without gathering them first,
    into the float32 keys and values ``kvarn.pool.dequantize_blocks`` makes of the gathered ones."""
    layout = KVLayout.kvarn(preset, tile_size=G)
    case = make_case([700, 300, 5], n_kv_heads=2, n_rep=2, head_dim=G, tile_size=G, key_bits=layout.key_bits,
                     value_bits=layout.value_bits, seed=G)
    got = kernels.dequantize_records(case.records, case.table, key_bits=layout.key_bits,
                                     value_bits=layout.value_bits)
    want = dequantize_blocks({name: case.records[name][case.table] for name in RECORD_FIELDS}, layout, mx.float32)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == mx.float32
        assert mx.array_equal(g, w).item()


@pytest.mark.parametrize("B,T,N,D,dims,base,scale", [(1, 1, 4, 128, 128, 10000.0, 1.0), (16, 1, 2, 128, 128, 10000.0, 1.0),
                                                   (3, 37, 4, 128, 128, 500000.0, 1.0), (2, 5, 3, 64, 32, 10000.0, 0.5)])
def test_the_rope_is_mlx_s_fast_rope_bit_for_bit(kernels, B, T, N, D, dims, base, scale):
    """Queries as a model passes them (a transposed view), one offset for the batch and one a row, in
    a compiled function too: the bits of ``mx.fast.rope`` (MLX's CPU fallback), including channels
    past ``dims`` passed through."""
    x = (mx.random.normal((B, T, N, D), key=mx.random.key(B * T)) * 3).transpose(0, 2, 1, 3)
    for offset in (mx.array(0, dtype=mx.int32), mx.array(4000, dtype=mx.int32),
                   mx.array([7 + 1001 * b for b in range(B)], dtype=mx.int32)):
        want = mx.fast.rope(x, dims, traditional=False, base=base, scale=scale, offset=offset)
        got = kernels.rope(x, offset, dims=dims, base=base, scale=scale)
        assert got.shape == want.shape and got.dtype == mx.float32
        assert mx.array_equal(got, want).item()
        traced = mx.compile(lambda a, o: kernels.rope(a, o, dims=dims, base=base, scale=scale))(x, offset)
        assert mx.array_equal(traced, want).item()


def test_the_rope_refuses_what_it_cannot_take(kernels):
    with pytest.raises(ValueError, match="float32"):
        kernels.rope(mx.zeros((1, 2, 1, 128), mx.float16), mx.array(0, dtype=mx.int32), dims=128, base=1e4, scale=1.0)
    with pytest.raises(ValueError, match="even dims"):
        kernels.rope(mx.zeros((1, 2, 1, 128)), mx.array(0, dtype=mx.int32), dims=129, base=1e4, scale=1.0)
    with pytest.raises(ValueError, match="offset"):
        kernels.rope(mx.zeros((2, 2, 1, 128)), mx.array([1, 2, 3], dtype=mx.int32), dims=128, base=1e4, scale=1.0)


def test_a_rope_off_mlx_s_bits_is_not_used_and_the_other_kernels_still_are(caplog):
    registry = Kernels()
    real = CpuKernels.rope

    def off(self, x, offset, **kw):  # noqa: ANN001, ANN202
        out = real(self, x, offset, **kw)
        return mx.where(mx.arange(out.size).reshape(out.shape) == 5, out * (1 + 2 ** -20), out)

    with mock.patch("metal.cpu.kernels.CpuKernels.rope", off), caplog.at_level(logging.WARNING):
        assert registry.cpu_rope() is None
    assert registry.cpu() is not None
    assert "rope is off mx.fast.rope's bits" in caplog.text
    assert Kernels().cpu_rope() is not None


@pytest.mark.parametrize("rows, N, K", [(1, 1536, 512), (2, 512, 1536), (3, 37, 24), (4, 8192, 64), (1, 5, 3)],
                         ids=["one-row", "two", "three-odd", "four-head", "tiny"])
def test_rows_matmul_is_x_times_w_transposed_to_float32_rounding(kernels, rows, N, K):
    """Each output within float32's rounding of a float64 product (closer than OpenBLAS's sgemm);
    rows of w past the 4-row blocks and K past the 8 lanes included. A bfloat16 w gives the bits
    of its float32 copy."""
    x = mx.random.normal((1, rows, K), key=mx.random.key(rows)) * 3
    w = mx.random.normal((N, K), key=mx.random.key(N)).astype(mx.bfloat16).astype(mx.float32)
    assert mx.array_equal(kernels.rows_matmul(x, w.astype(mx.bfloat16)), kernels.rows_matmul(x, w)).item()
    want = np.array(x, dtype=np.float64) @ np.array(w, dtype=np.float64).T
    got = kernels.rows_matmul(x, w)
    assert got.shape == (1, rows, N) and got.dtype == mx.float32
    scale = np.abs(np.array(x, np.float64)) @ np.abs(np.array(w, np.float64)).T  # the sum of |terms|
    assert (np.abs(np.array(got) - want) / scale).max() < 2e-6
    sgemm = np.array(x @ w.T)
    assert (np.abs(np.array(got) - want) / scale).max() <= max((np.abs(sgemm - want) / scale).max(), 2e-7)


def test_rows_matmul_reads_views_runs_compiled_and_refuses_what_it_cannot_take(kernels):
    x, w = mx.random.normal((64, 2), key=mx.random.key(5)), mx.random.normal((64, 48), key=mx.random.key(6))
    want = np.array(x.T, np.float64) @ np.array(w.T, np.float64).T  # both transposed views
    assert np.abs(np.array(kernels.rows_matmul(x.T, w.T)) - want).max() < 1e-4
    traced = mx.compile(lambda a, b: kernels.rows_matmul(a, b) * 2)(x.T, w.T)
    assert mx.array_equal(traced, kernels.rows_matmul(x.T, w.T) * 2).item()
    with pytest.raises(ValueError, match="1 to 4 rows"):
        kernels.rows_matmul(mx.zeros((5, 8)), mx.zeros((3, 8)))
    with pytest.raises(ValueError, match="float32"):
        kernels.rows_matmul(mx.zeros((1, 8), mx.float16), mx.zeros((3, 8), mx.float16))
    with pytest.raises(ValueError, match="bfloat16 w"):
        kernels.rows_matmul(mx.zeros((1, 8)), mx.zeros((3, 8), mx.float16))
    with pytest.raises(ValueError, match="one K"):
        kernels.rows_matmul(mx.zeros((1, 8)), mx.zeros((3, 9)))


SPECIAL_GATES = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 88.0, -88.0, 88.7, -88.7, 1e-30, -1e-30,
                 0.34657359, -0.34657359]  # the last two: |g| log2(e) + 0.5 at an integer, where exp rounds


@pytest.mark.parametrize("shape, spread", [((1, 1536), 4.0), ((16, 1536), 8.0), ((3, 37, 512), 100.0),
                                           ((4096, 24), 30.0)], ids=["one-row", "16-rows", "chunk", "threaded"])
def test_the_swiglu_is_mlx_s_silu_times_up_bit_for_bit(kernels, shape, spread):
    """The decode rows' sizes run on one thread, a prompt chunk's on several; gates over exp's whole
    range and past it, NaN and infinities, and the points where exp's float64 rounding matters."""
    k1, k2 = mx.random.split(mx.random.key(shape[-1]))
    gate = (mx.random.normal(shape, key=k1) * spread).reshape(-1)
    gate = mx.concatenate([mx.array(SPECIAL_GATES), gate[len(SPECIAL_GATES):]]).reshape(shape)
    up = mx.random.normal(shape, key=k2)
    got = kernels.swiglu(gate, up)
    assert got.dtype == mx.float32 and got.shape == shape
    assert mx.array_equal(got, nn.silu(gate) * up, equal_nan=True).item()
    assert mx.array_equal(got, mlx_lm_swiglu(gate, up), equal_nan=True).item()


def test_the_swiglu_reads_views_and_runs_in_a_compiled_graph(kernels):
    gate, up = mx.random.normal((64, 96), key=mx.random.key(3)) * 5, mx.random.normal((96, 64), key=mx.random.key(4))
    want = nn.silu(gate.T) * up
    assert mx.array_equal(kernels.swiglu(gate.T, up), want).item()
    traced = mx.compile(lambda g, u: kernels.swiglu(g, u) * 2)(gate.T, up)
    assert mx.array_equal(traced, want * 2).item()
    sweep = mx.linspace(-100, 100, 1 << 20)  # every magnitude exp's polynomial and its 2**n meet
    assert mx.array_equal(kernels.swiglu(sweep, mx.ones_like(sweep)), nn.silu(sweep)).item()


def test_the_swiglu_refuses_what_it_cannot_take(kernels):
    with pytest.raises(ValueError, match="float32"):
        kernels.swiglu(mx.zeros((2, 8), mx.float16), mx.zeros((2, 8), mx.float16))
    with pytest.raises(ValueError, match="one shape"):
        kernels.swiglu(mx.zeros((2, 8)), mx.zeros((1, 8)))


def test_a_swiglu_off_mlx_s_bits_is_not_used_and_the_other_kernels_still_are(caplog):
    registry = Kernels()
    real = CpuKernels.swiglu

    def off(self, gate, up):  # noqa: ANN001, ANN202
        out = real(self, gate, up)
        return mx.where(mx.arange(out.size).reshape(out.shape) == 7, out * (1 + 2 ** -20), out)

    with mock.patch("metal.cpu.kernels.CpuKernels.swiglu", off), caplog.at_level(logging.WARNING):
        assert registry.cpu_swiglu() is None
    assert registry.cpu() is not None
    assert "SwiGLU is off MLX's bits" in caplog.text
    assert Kernels().cpu_swiglu() is not None


def test_the_build_finds_mlx_s_headers_past_a_folder_named_mlx_on_the_path(monkeypatch, tmp_path):
    """MLX's own compile cache (/tmp/mlx) is a namespace-package portion of ``mlx`` for a script run
    from /tmp: its headers and library are still the installed package's."""
    (tmp_path / "mlx").mkdir()
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path))
    import mlx
    monkeypatch.setattr(mlx, "__path__", [str(tmp_path / "mlx"), *mlx.__path__])
    assert build.load().rope is not None


@pytest.mark.parametrize("name", ["k4v2-ragged", "k2v4-tile64"])
def test_decode_attention_rotating_inside_gives_the_bits_of_rotating_around_it(kernels, name):
    """The model's queries given with the attention scale: the kernel rotates and scales them and
    rotates its output back with ``rotate``'s operations, the same bits as the two rotations and the
    multiply done around the call (three graph nodes a layer)."""
    tokens, H, n_rep, D, G, kb, vb = CASES[name]
    case = make_case(tokens, n_kv_heads=H, n_rep=n_rep, head_dim=D, tile_size=G, key_bits=kb, value_bits=vb,
                     dtype=mx.float32, window_dtype=mx.float32, seed=3)
    B, n_q = case.queries.shape[:2]
    q = case.queries.reshape(B, H, n_rep, D)
    nb = 0 if case.table is None else case.table.shape[1]
    kw = dict(records=case.records, win_k=case.win_k, win_v=case.win_v,
              win_ids=mx.array(case.lengths.slots, dtype=mx.int32), table=case.table,
              mask=validity_mask(case.lengths, G, nb)[:, None], win_len=2 * G, key_bits=kb, value_bits=vb)
    around = kernels.rotate(kernels.decode_attention(kernels.rotate(q, D) * case.scale, **kw), D)
    inside = kernels.decode_attention(q, scale=case.scale, **kw)
    assert mx.array_equal(inside, around).item()
    traced = mx.compile(lambda x: kernels.decode_attention(x, scale=case.scale, **kw))(q)
    assert mx.array_equal(traced, around).item()


@pytest.mark.skipif(__import__("platform").machine() != "x86_64", reason="checks an x86-64 build without vector extensions")
def test_the_source_compiles_for_a_cpu_without_f16c_or_avx2():
    """``-march=native`` builds for the host: on a CPU without F16C or AVX2 (or another
    architecture) every intrinsic must sit behind its feature test, or the kernels do not build
    there and that machine falls back to the pure-MLX paths. A syntax-only compile for baseline
    x86-64 (SSE2) catches one that does not."""
    import subprocess
    import nanobind
    from metal.sources import source

    compiler = build.shutil.which("g++") or build.shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    flags = [f for f in build.FLAGS if not f.startswith("-march")] + ["-march=x86-64", "-fsyntax-only", "-x", "c++", "-"]
    done = subprocess.run([compiler, *flags, *build.include_flags(Path(mx.__file__).parent, Path(nanobind.__file__).parent)],
                          input=source("cpu", build.SOURCE), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
