"""The fused ragged decode attention of the fp16 baseline (metal/cuda/ragged_decode.py): its reference
against a float64 NumPy attention, the split plan, the kernels' CUDA source run by the CPU emulator
against float64, the kernel against the reference (GPU only), and the dispatch's verdict."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from metal import KERNELS
from metal.cuda.ragged_decode import MIN_SPLIT, RESIDENT_BLOCKS, SPLIT_ALIGN, TARGET_WAVES, \
    check_arguments, is_supported, make_plan, plan_splits, ragged_decode_attention
from metal.cuda.ragged_decode import RaggedPlan, planned_attention, static_plan, static_splits
from metal.reference import reference_ragged_decode_attention
from metal.selector import SELF_CHECK_TOLERANCE, Kernels, ragged_decode_self_check
from tests.metal import cuda_emulator

HAS_CUDA = hasattr(mx, "cuda") and mx.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU: the fused kernel runs only there")
needs_gxx = pytest.mark.skipif(not cuda_emulator.available(), reason="no g++ for the CUDA emulator")
TOL = 1e-2  # max |a - b| / max |b|; float16 output rounding is ~5e-4, bfloat16 ~4e-3
RAGGED = [1, 7, 127, 128, 129, 1000, 2, 300]
F16, BF16 = mx.float16, mx.bfloat16
SMS = 132  # the multiprocessors the plan tests aim at (the H200's, where the policy was measured)


def make_case(lengths, *, n_kv_heads=2, n_rep=4, head_dim=128, dtype=F16, kv_dtype=F16, t_cap=None, seed=0,
              garbage=30.0):
    """Rows of ``lengths`` tokens at shuffled slots of [N, H, T_cap, D] buffers (two spare slots);
    positions past a row's length (and the spare slots) hold ``garbage``-sized values (NaN: never
    finite) that must stay masked."""
    rng = np.random.default_rng(seed)
    B, H, D = len(lengths), n_kv_heads, head_dim
    t_cap = t_cap or max(lengths) + 3
    N = B + 2
    slots = tuple(int(s) for s in rng.permutation(N)[:B])
    if np.isnan(garbage):
        k, v = np.full((N, H, t_cap, D), np.nan), np.full((N, H, t_cap, D), np.nan)
    else:
        k, v = rng.standard_normal((2, N, H, t_cap, D)) * garbage
    for s, n in zip(slots, lengths):
        k[s, :, :n] = rng.standard_normal((H, n, D)) * rng.uniform(0.5, 2.0, size=(1, 1, D))  # uneven channels
        v[s, :, :n] = rng.standard_normal((H, n, D))
    q = rng.standard_normal((B, H * n_rep, 1, D)) * 1.5
    return dict(queries=mx.array(q.astype(np.float32)).astype(dtype),
                keys=mx.array(k.astype(np.float32)).astype(kv_dtype),
                values=mx.array(v.astype(np.float32)).astype(kv_dtype), slots=slots, lengths=tuple(lengths),
                scale=D ** -0.5)


def _f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def numpy_attention(case: dict) -> np.ndarray:
    """[B, n_q, 1, D] float64: row b's query heads over tokens [0, lengths[b]) of its slot."""
    q, k, v = _f64(case["queries"]), _f64(case["keys"]), _f64(case["values"])
    B, n_q, _, D = q.shape
    H = k.shape[1]
    nr = n_q // H
    out = np.zeros_like(q)
    for b, (s, n) in enumerate(zip(case["slots"], case["lengths"])):
        for h in range(H):
            x = q[b, h * nr:(h + 1) * nr, 0] @ k[s, h, :n].T * case["scale"]  # [nr, n]
            p = np.exp(x - x.max(axis=1, keepdims=True))
            out[b, h * nr:(h + 1) * nr, 0] = (p / p.sum(axis=1, keepdims=True)) @ v[s, h, :n]
    return out


def max_rel_error(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def reference(case: dict) -> np.ndarray:
    return np.array(reference_ragged_decode_attention(**case).astype(mx.float32))


# ---- the reference ----
REFERENCE_CASES = [(64, 1, F16, F16), (64, 8, BF16, F16), (128, 2, BF16, F16), (128, 4, F16, BF16),
                   (128, 3, F16, F16), (256, 8, BF16, BF16), (256, 1, F16, F16), (128, 4, BF16, BF16)]


@pytest.mark.parametrize("D,n_rep,dtype,kv_dtype", REFERENCE_CASES)
def test_reference_matches_float64(D, n_rep, dtype, kv_dtype):
    case = make_case(RAGGED, n_rep=n_rep, head_dim=D, dtype=dtype, kv_dtype=kv_dtype, t_cap=1030)
    got = reference(case)
    assert got.shape == (len(RAGGED), 2 * n_rep, 1, D)
    assert reference_ragged_decode_attention(**case).dtype == dtype
    want = numpy_attention(case)
    for b in range(len(RAGGED)):  # each row on its own scale
        assert max_rel_error(got[b], want[b]) < TOL


def test_reference_sees_a_wrong_slot_and_a_wrong_length():
    """The tolerance discriminates: a row reading another row's slot, or 20 tokens past its length
    (large garbage), is far off."""
    case = make_case([300, 200, 129], n_rep=2, seed=3)
    want = numpy_attention(case)
    s = case["slots"]
    wrong = dict(case, slots=(s[1], s[0], s[2]))
    assert max_rel_error(reference(wrong), want) > 10 * TOL
    longer = dict(case, lengths=(300, 220, 129))
    assert max_rel_error(reference(longer), want) > 10 * TOL


def test_reference_many_rows():
    rng = np.random.default_rng(1)
    lengths = [int(n) for n in rng.integers(1, 400, size=48)]
    case = make_case(lengths, n_kv_heads=1, n_rep=2, head_dim=64)
    assert max_rel_error(reference(case), numpy_attention(case)) < TOL


# ---- the plan ----
def _blocks(work, H=8):
    return len(work) * H


def test_plan_covers_every_token_once():
    lengths = [1, 7, 511, 512, 513, 1000, 4096, 16384, 129, 70000]
    for kw in ({}, dict(single=True), dict(single=False), dict(min_split=16, align=1, single=False)):
        work = plan_splits(lengths, 8, **kw)
        assert [b for b, _, _ in work] == sorted(b for b, _, _ in work)  # row order (row_work ranges)
        for b, n in enumerate(lengths):
            spans = [(lo, hi) for row, lo, hi in work if row == b]
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(lo < hi for lo, hi in spans) and all(a[1] == c[0] for a, c in zip(spans, spans[1:]))
    plan = make_plan(tuple(range(len(lengths))), lengths, 8)
    assert np.array(plan.work).tolist() == [list(w) for w in plan.items]
    rw = np.array(plan.row_work).tolist()
    assert rw[0] == 0 and rw[-1] == plan.num_items
    assert all(plan.items[i][0] == b for b in range(len(lengths)) for i in range(rw[b], rw[b + 1]))


def test_plan_policy():
    """Rows of a few hundred tokens stay one item; a batch that fills TARGET_WAVES waves at one
    item a row is one launch (FINAL); else items of about the batch's tokens x heads / the waves,
    never much below MIN_SPLIT, edges aligned, about TARGET_WAVES..2 x TARGET_WAVES waves of blocks."""
    wave = SMS * RESIDENT_BLOCKS
    assert len(plan_splits([2 * MIN_SPLIT - 1], 8, num_sms=SMS)) == 1
    assert len(plan_splits([300, 5, 77], 8, num_sms=SMS)) == 3
    assert len(plan_splits([2 * MIN_SPLIT] * 17, 8, num_sms=SMS)) == 34
    assert make_plan(range(128), [1000] * 128, 8, num_sms=SMS).final  # 1024 row-heads of 1000 tokens: one launch
    for B, T in [(1, 4096), (1, 16384), (16, 4096)]:  # few rows, however short: split (K/V streams from HBM)
        work = plan_splits([T] * B, 8, num_sms=SMS)
        assert len(work) >= 4 * B and all(hi - lo >= MIN_SPLIT - SPLIT_ALIGN for _, lo, hi in work)
    for B, T in [(32, 4096), (32, 16384), (16, 32768), (64, 8192)]:
        work = plan_splits([T] * B, 8, num_sms=SMS)
        assert TARGET_WAVES * wave * 0.95 <= _blocks(work) <= 2 * TARGET_WAVES * wave, (B, T, len(work))
    # a long row; MIN_SPLIT binds: as many splits as it allows
    work = plan_splits([70 * MIN_SPLIT], 8, num_sms=SMS)
    assert len(work) == 70
    ragged = [int(n) for n in np.linspace(1000, 16000, 32)]
    work = plan_splits(ragged, 8, num_sms=SMS)
    per = np.ceil(sum(ragged) * 8 / (TARGET_WAVES * wave))
    sizes = [hi - lo for _, lo, hi in work]
    assert max(sizes) <= per + SPLIT_ALIGN and min(sizes) >= MIN_SPLIT - SPLIT_ALIGN
    assert _blocks(work) >= TARGET_WAVES * wave * 0.95
    for lengths in ([70000, 3], ragged, [4096] * 16):
        for b, lo, hi in plan_splits(lengths, 8, num_sms=SMS):
            assert lo % SPLIT_ALIGN == 0 and (hi % SPLIT_ALIGN == 0 or hi == lengths[b])
    assert len(plan_splits([16384], 8, num_sms=SMS, single=True)) == 1
    assert len(plan_splits([16384] * 64, 8, num_sms=SMS, single=False)) == 64 * 16384 // MIN_SPLIT


def test_plan_and_arguments_are_checked():
    case = make_case([5, 9], n_rep=2)
    plan = make_plan(case["slots"], case["lengths"], 2)
    check_arguments(case["queries"], case["keys"], case["values"], case["slots"], case["lengths"], plan)
    bad = [dict(lengths=(5, 10**6)), dict(lengths=(0, 9)), dict(slots=(0, 99)), dict(slots=(0,))]
    for change in bad:
        kw = {**case, **change}
        with pytest.raises(ValueError):
            check_arguments(kw["queries"], kw["keys"], kw["values"], kw["slots"], kw["lengths"], None)
    with pytest.raises(ValueError):  # a plan made for other lengths
        check_arguments(case["queries"], case["keys"], case["values"], case["slots"], (5, 8), plan)
    with pytest.raises(ValueError):  # K and V of different dtypes
        check_arguments(case["queries"], case["keys"], case["values"].astype(BF16), case["slots"], case["lengths"],
                        None)
    with pytest.raises(ValueError):
        ragged_decode_attention(**make_case([5], head_dim=96))


def test_is_supported():
    assert is_supported(head_dim=128, n_rep=4) and is_supported(head_dim=64, n_rep=8, dtype=BF16, kv_dtype=F16)
    assert is_supported(head_dim=256, n_rep=1, dtype=BF16)
    assert not is_supported(head_dim=96, n_rep=4) and not is_supported(head_dim=128, n_rep=9)
    assert not is_supported(head_dim=128, n_rep=4, dtype=mx.float32)
    assert not is_supported(head_dim=128, n_rep=4, kv_dtype=mx.float32)


# ---- the dispatch ----
def test_verdict_on_this_backend():
    kernels = Kernels()
    path = kernels.ragged_decode_path()
    assert path in ("cuda-fused", "reference")
    assert kernels.ragged_decode_path() == path and kernels.decided_ragged_decode_path() == path  # decided once
    if not HAS_CUDA:
        assert path == "reference"


# ---- the CUDA source, run by the CPU emulator (one std::thread per CUDA thread: small cases) ----
# (lengths, D, n_rep, queries' dtype, K/V dtype, plan keywords): split plans (the combine launch) and
# one-item-a-row plans (FINAL), every head dim, 1..8 heads a KV head, both dtypes on both sides
EMULATED = [
    ([1, 7, 129, 600], 128, 4, F16, F16, dict(single=False)),                  # 600 -> 2 items: combine
    ([1, 7, 129, 600], 128, 4, BF16, F16, dict(single=True)),                 # FINAL
    ([127, 128, 520], 64, 3, BF16, F16, dict(single=False)),
    ([33, 520], 64, 8, F16, BF16, dict(single=True)),
    ([5, 140], 256, 8, BF16, BF16, dict(single=True)),
    ([3, 530], 256, 2, F16, F16, dict(single=False)),
    ([1, 2, 3, 77], 128, 1, F16, BF16, dict(min_split=8, align=1, single=False)),  # odd, tiny splits
    ([200, 17], 128, 5, BF16, BF16, dict(min_split=24, align=8, single=False)),
]


@needs_gxx
@pytest.mark.parametrize("lengths,D,n_rep,dtype,kv_dtype,policy", EMULATED)
def test_emulated_kernel_matches_float64(lengths, D, n_rep, dtype, kv_dtype, policy):
    case = make_case(lengths, n_rep=n_rep, head_dim=D, dtype=dtype, kv_dtype=kv_dtype, seed=len(lengths) + D)
    plan = make_plan(case["slots"], case["lengths"], 2, **policy)
    assert plan.final == (plan.num_items == len(lengths)) and plan.final == bool(policy.get("single"))
    got = cuda_emulator.emulated_ragged_decode_attention(**case, plan=plan)
    want = numpy_attention(case)
    for b in range(len(lengths)):
        assert max_rel_error(got[b], want[b]) < TOL


@needs_gxx
@pytest.mark.parametrize("single", [True, False])
def test_emulated_kernel_never_reads_past_a_row(single):
    """NaN everywhere outside the rows' tokens (the rest of each slot, the spare slots)."""
    case = make_case([1, 70, 513], n_rep=2, garbage=float("nan"), seed=4)
    plan = make_plan(case["slots"], case["lengths"], 2, single=single)
    got = cuda_emulator.emulated_ragged_decode_attention(**case, plan=plan)
    assert np.isfinite(got).all() and max_rel_error(got, numpy_attention(case)) < TOL


def test_static_plan_gives_every_row_the_same_items_covering_its_tokens_once():
    for splits in (1, 3, 5):
        work, row_work, rows = static_plan((4, 5, 6), (1, 7, 600), splits)
        assert row_work.tolist() == [0, splits, 2 * splits, 3 * splits] and rows.tolist() == [4, 5, 6]
        for b, n in enumerate((1, 7, 600)):
            items = work.tolist()[b * splits: (b + 1) * splits]
            assert all(i[0] == b for i in items)
            assert [t for _, lo, hi in items for t in range(lo, hi)] == list(range(n))  # some items empty
    assert static_splits(1, 4096, 8, num_sms=132) == 4096 // MIN_SPLIT  # one row: split (K/V streams from HBM)
    assert static_splits(1, MIN_SPLIT, 8, num_sms=132) == 1  # a row shorter than two splits: one item
    assert static_splits(32, 16384, 8, num_sms=132) > 1


@needs_gxx
@pytest.mark.parametrize("splits", [1, 4, 11])
def test_emulated_kernel_with_a_static_plan_and_empty_items_matches_float64(splits):
    """A plan of fixed size (a compiled step's): rows shorter than its items leave some empty;
    11 items a row run the combine's unrolled loops past one group of 8."""
    case = make_case([1, 3, 600], n_rep=2, seed=6)
    work, row_work, rows = static_plan(case["slots"], case["lengths"], splits)
    plan = RaggedPlan(work=work, row_work=row_work, rows=rows, num_items=3 * splits, items=(), slots=case["slots"],
                      lengths=case["lengths"])
    got = cuda_emulator.emulated_ragged_decode_attention(**case, plan=plan)
    want = numpy_attention(case)
    for b in range(3):
        assert max_rel_error(got[b], want[b]) < TOL


@needs_cuda
@pytest.mark.parametrize("splits", [1, 4])
def test_kernel_with_a_static_plan_matches_reference(splits):
    case = make_case(RAGGED, n_rep=4, t_cap=1010)
    work, row_work, rows = static_plan(case["slots"], case["lengths"], splits)
    got = np.array(planned_attention(case["queries"], case["keys"], case["values"], work, row_work, rows, splits,
                                     case["scale"]).astype(mx.float32))
    assert max_rel_error(got, reference(case)) < TOL


@needs_gxx
def test_emulated_kernel_sees_a_wrong_slot():
    case = make_case([300, 200], n_rep=2, seed=3)
    want = numpy_attention(case)
    s = case["slots"]
    got = cuda_emulator.emulated_ragged_decode_attention(**dict(case, slots=(s[1], s[0])))
    assert max_rel_error(got, want) > 10 * TOL


# ---- the kernel on the GPU ----
KERNEL_CASES = [(D, n_rep, dt, kdt) for D in (64, 128, 256) for n_rep in (1, 2, 4, 8) for dt, kdt in
                ((F16, F16), (BF16, F16), (BF16, BF16))] + [(128, 3, F16, BF16), (128, 5, BF16, F16), (64, 6, F16, F16),
                                                           (256, 7, BF16, BF16)]


@needs_cuda
@pytest.mark.parametrize("D,n_rep,dtype,kv_dtype", KERNEL_CASES)
@pytest.mark.parametrize("single", [False, True])
def test_kernel_matches_reference(D, n_rep, dtype, kv_dtype, single):
    case = make_case(RAGGED + [5000], n_rep=n_rep, head_dim=D, dtype=dtype, kv_dtype=kv_dtype, t_cap=5010)
    plan = make_plan(case["slots"], case["lengths"], 2, single=single)
    assert plan.final == bool(single)
    got = np.array(ragged_decode_attention(**case, plan=plan).astype(mx.float32))
    assert max_rel_error(got, reference(case)) < TOL
    want = numpy_attention(case)
    for b in range(got.shape[0]):
        assert max_rel_error(got[b], want[b]) < TOL


@needs_cuda
@pytest.mark.parametrize("num_rows,n_rep,dtype", [(1, 4, BF16), (32, 4, BF16), (64, 8, F16), (17, 1, F16)])
def test_kernel_many_rows(num_rows, n_rep, dtype):
    rng = np.random.default_rng(num_rows)
    lengths = [int(n) for n in rng.integers(1, 9000, size=num_rows)]
    case = make_case(lengths, n_kv_heads=8, n_rep=n_rep, dtype=dtype, garbage=float("nan"))
    got = np.array(ragged_decode_attention(**case).astype(mx.float32))
    assert max_rel_error(got, numpy_attention(case)) < TOL


@needs_cuda
def test_kernel_sees_a_wrong_slot():
    case = make_case([300, 200], n_rep=2, seed=3)
    ref = reference(case)
    s = case["slots"]
    got = np.array(ragged_decode_attention(**dict(case, slots=(s[1], s[0]))).astype(mx.float32))
    assert max_rel_error(got, ref) > 10 * TOL


@needs_cuda
def test_verdict_is_the_kernel_on_cuda():
    assert KERNELS.ragged_decode_path() == "cuda-fused"
    assert ragged_decode_self_check(ragged_decode_attention, make_plan) < SELF_CHECK_TOLERANCE
