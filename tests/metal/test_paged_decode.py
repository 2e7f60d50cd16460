"""The fused paged decode attention (metal/cuda/paged_decode.py): its reference against a float64
NumPy attention, the kernel against the reference (GPU; and its CUDA source run by a CPU emulator),
the split plan (metal/paged_plan.py), and the dispatch's verdict."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from metal import KERNELS
from metal.cuda.paged_decode import MAX_SHARED, Variant, mma_shared_bytes, mma_stages, mma_supported, \
    paged_decode_attention
from metal.paged_plan import DecodePlan as KernelPlan
from metal.paged_plan import RowLengths, make_plan, plan_splits, static_plan, static_splits
from metal.reference import reference_paged_decode_attention
from metal.selector import Kernels, cuda_backend
from tests.metal import cuda_emulator
from tests.metal.cases import make_case, max_rel_error, numpy_attention

HAS_CUDA = hasattr(mx, "cuda") and mx.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU: the fused kernel runs only there")
TOL = 1e-2  # max |a - b| / max |b|; float16 rounding of K, V and the output is ~1e-3
SMS = 132  # the multiprocessors the plan tests aim at (the H200's, where the policy was measured)

# rows around tile boundaries: inside the sink, exactly one sink, one more, full records, a tail of G - 1
def ragged(G: int) -> list[int]:
    return [1, G - 1, G, G + 1, 2 * G, 3 * G - 1, 4 * G + 3]


REFERENCE_CASES = [
    (64, 64, 4, 2, 4), (64, 128, 3, 3, 2), (128, 128, 4, 2, 4), (128, 64, 2, 8, 1), (256, 128, 8, 4, 2),
    (256, 64, 3, 2, 4),
]


@pytest.mark.parametrize("D,G,kb,vb,n_rep", REFERENCE_CASES)
def test_reference_matches_float64(D, G, kb, vb, n_rep):
    case = make_case(ragged(G), n_kv_heads=2, n_rep=n_rep, head_dim=D, tile_size=G, key_bits=kb, value_bits=vb)
    want = numpy_attention(case)
    got = np.array(reference_paged_decode_attention(**case.kwargs()).astype(mx.float32))
    assert max_rel_error(got, want) < TOL


def test_reference_sees_a_wrong_block():
    """The tolerance discriminates: two rows' blocks swapped in the table is far off."""
    case = make_case([3 * 128 + 5, 2 * 128 + 9], n_kv_heads=1, n_rep=2, head_dim=128, tile_size=128, key_bits=4,
                     value_bits=2, seed=3)
    want = numpy_attention(case)
    t = np.array(case.table)
    t[0, 0], t[1, 0] = t[1, 0], t[0, 0]
    case.table = mx.array(t)
    got = np.array(reference_paged_decode_attention(**case.kwargs()).astype(mx.float32))
    assert max_rel_error(got, want) > 10 * TOL


@pytest.mark.parametrize("num_rows", [1, 64])
def test_reference_many_rows(num_rows):
    rng = np.random.default_rng(num_rows)
    tokens = [int(t) for t in rng.integers(1, 5 * 64, size=num_rows)]
    case = make_case(tokens, n_kv_heads=1, n_rep=2, head_dim=64, tile_size=64, key_bits=3, value_bits=4)
    got = np.array(reference_paged_decode_attention(**case.kwargs()).astype(mx.float32))
    assert max_rel_error(got, numpy_attention(case)) < TOL


def test_plan_covers_every_tile_once():
    num_tiles, tail = [0, 3, 255, 40, 0], [0, 7, 5, 0, 0]
    work = plan_splits(num_tiles, tail, n_kv_heads=8, num_sms=SMS)
    for b, (n, t) in enumerate(zip(num_tiles, tail)):
        spans = sorted((lo, hi) for row, lo, hi in work if row == b)
        assert spans[0][0] == 0 and spans[-1][1] == 1 + n + (t > 0)
        assert all(a[1] == c[0] and a[0] < a[1] for a, c in zip(spans, spans[1:]))
    assert max(hi - lo for _, lo, hi in work) <= 2 * min(hi - lo for b, lo, hi in work if b == 2)
    assert len([w for w in work if w[0] == 2]) > 1  # the long row is split


def test_plan_policy_one_item_a_row_or_about_one_wave_of_splits():
    """One work item a row (one launch) for a wave of rows; fewer rows, short or long, in splits
    of about one wave (measured through the engine's step: metal/paged_plan.py)."""
    def items(B, T, H=8):
        n, t = (T - 128) // 128, (T - 128) % 128
        return plan_splits([n] * B, [t] * B, H, num_sms=SMS)
    assert len(items(1, 4096)) == 32 and len(items(16, 4096)) == 48  # short rows, less than a wave: split
    assert len(items(1, 16384)) > 40 and len(items(4, 32768)) > 40   # a few long rows: split
    assert len(items(64, 8192)) == 64                                # a wave of row-heads
    work = items(16, 32768)                                          # 128 row-heads of 258 tiles: split
    assert 40 <= len(work) <= 60 and all(hi - lo <= 90 for _, lo, hi in work)
    assert len(plan_splits([255], [5], 8, single=True)) == 1
    assert len(plan_splits([255], [5], 8, num_sms=SMS, single=False)) > 1


def test_verdict_on_this_backend():
    kernels = Kernels()
    path = kernels.attention_path()
    assert path in ("cuda-fused", "metal-fused", "reference")
    assert kernels.attention_path() == path  # decided once
    if not HAS_CUDA:
        assert path == "reference"


# ---- the kernel ----
KERNEL_CASES = [(D, G, kb, vb) for kb in (2, 3, 4, 8) for vb in (2, 4, 8) for D, G in ((128, 128),)] + [
    (64, 64, 3, 2), (64, 128, 4, 8), (256, 128, 4, 2), (256, 64, 3, 4), (128, 64, 8, 8), (64, 64, 2, 3),
    (256, 128, 2, 3)]


@needs_cuda
@pytest.mark.parametrize("D,G,kb,vb", KERNEL_CASES)
def test_kernel_matches_reference(D, G, kb, vb):
    case = make_case(ragged(G), n_kv_heads=2, n_rep=4, head_dim=D, tile_size=G, key_bits=kb, value_bits=vb)
    ref = np.array(reference_paged_decode_attention(**case.kwargs()).astype(mx.float32))
    got = np.array(paged_decode_attention(**case.kwargs()).astype(mx.float32))
    assert max_rel_error(got, ref) < TOL
    assert max_rel_error(got, numpy_attention(case)) < TOL


@needs_cuda
@pytest.mark.parametrize("num_rows,n_rep,dtype", [(1, 1, mx.float16), (17, 8, mx.bfloat16), (64, 4, mx.float16)])
def test_kernel_many_rows(num_rows, n_rep, dtype):
    rng = np.random.default_rng(num_rows)
    tokens = [int(t) for t in rng.integers(1, 12 * 128, size=num_rows)]
    case = make_case(tokens, n_kv_heads=8, n_rep=n_rep, head_dim=128, tile_size=128, key_bits=4, value_bits=2,
                     dtype=dtype)
    ref = np.array(reference_paged_decode_attention(**case.kwargs()).astype(mx.float32))
    got = np.array(paged_decode_attention(**case.kwargs()).astype(mx.float32))
    assert max_rel_error(got, ref) < TOL


@needs_cuda
def test_kernel_sees_a_wrong_block():
    case = make_case([3 * 128 + 5, 2 * 128 + 9], n_kv_heads=1, n_rep=2, head_dim=128, tile_size=128, key_bits=4,
                     value_bits=2, seed=3)
    ref = np.array(reference_paged_decode_attention(**case.kwargs()).astype(mx.float32))
    t = np.array(case.table)
    t[0, 0], t[1, 0] = t[1, 0], t[0, 0]
    case.table = mx.array(t)
    got = np.array(paged_decode_attention(**case.kwargs()).astype(mx.float32))
    assert max_rel_error(got, ref) > 10 * TOL


@needs_cuda
@pytest.mark.parametrize("variant", [Variant(), Variant(fold_k=1, fold_v=1), Variant(stages=3), Variant(kind="scalar")],
                         ids=["mma", "mma-fold", "mma-3stage", "scalar"])
def test_kernel_variants_on_long_rows(variant):
    """Both bodies and the tensor-core knobs, rows of several steps, each row against float64."""
    case = make_case([9 * 128 + 5, 12 * 128, 130, 40 * 128 + 77], n_kv_heads=8, n_rep=4, head_dim=128,
                     tile_size=128, key_bits=4, value_bits=2, seed=11)
    ref = np.array(reference_paged_decode_attention(**case.kwargs()).astype(mx.float32))
    got = np.array(paged_decode_attention(**case.kwargs(), variant=variant).astype(mx.float32))
    want = numpy_attention(case)
    assert max_rel_error(got, ref) < TOL
    for b in range(got.shape[0]):
        assert max_rel_error(got[b], want[b]) < TOL


@needs_cuda
@pytest.mark.parametrize("kb,vb,n_rep,dtype", [(4, 2, 4, mx.float16), (8, 4, 8, mx.bfloat16), (2, 2, 1, mx.float16)])
def test_kernel_single_launch_when_every_row_is_one_work_item(kb, vb, n_rep, dtype):
    """A plan of one work item a row: the attention launch writes the output itself (no combine)."""
    case = make_case(ragged(128) + [20 * 128 + 3], n_kv_heads=2, n_rep=n_rep, head_dim=128, tile_size=128,
                     key_bits=kb, value_bits=vb, dtype=dtype, seed=5)
    L = case.lengths
    plan = make_plan(L.slots, L.sink_len, L.tail_len, L.num_tiles, 2, min_split=10**6)
    assert plan.num_items == len(L.slots)
    ref = np.array(reference_paged_decode_attention(**case.kwargs()).astype(mx.float32))
    got = np.array(paged_decode_attention(**case.kwargs(), plan=plan).astype(mx.float32))
    assert max_rel_error(got, ref) < TOL and max_rel_error(got, numpy_attention(case)) < TOL


# ---- which body runs ----
def test_the_tensor_core_body_takes_its_shapes_and_the_scalar_body_the_rest():
    shape = dict(head_dim=128, tile_size=128, key_bits=4, value_bits=2, n_rep=4)
    assert mma_supported(**shape) and mma_stages(Variant(), **shape) == 2
    assert mma_stages(Variant(kind="scalar"), **shape) == 0
    for other in (dict(head_dim=64), dict(head_dim=256), dict(key_bits=3), dict(value_bits=3),
                  dict(tile_size=64, key_bits=2)):
        assert not mma_supported(**{**shape, **other}) and mma_stages(Variant(), **{**shape, **other}) == 0
        with pytest.raises(ValueError):
            mma_stages(Variant(kind="mma"), **{**shape, **other})
    big = dict(shape, key_bits=2, value_bits=8)  # 4 tiles a step of 22 KB: 3 stages pass the 227 KB a block may have
    assert mma_shared_bytes(**big, stages=3) > MAX_SHARED and mma_stages(Variant(stages=3), **big) == 2


# ---- the kernels' CUDA source, run by the CPU emulator (slow: a few configurations) ----
# (D, G, kb, vb, n_rep, dtype, variant): the tensor-core body (rows of several pipeline steps), then
# the scalar body (head dims and bits the tensor-core body does not take, and one it does)
EMULATED = [(128, 128, 4, 2, 4, mx.float16, Variant()), (128, 64, 8, 4, 2, mx.bfloat16, Variant(stages=3)),
            (128, 128, 2, 8, 5, mx.float16, Variant(fold_k=1, fold_v=1)),
            (64, 64, 3, 3, 2, mx.float16, Variant()), (256, 64, 8, 3, 8, mx.bfloat16, Variant()),
            (128, 128, 4, 2, 4, mx.float16, Variant(kind="scalar"))]


@pytest.mark.skipif(not cuda_emulator.available(), reason="no g++ for the CUDA emulator")
@pytest.mark.parametrize("D,G,kb,vb,n_rep,dtype,variant", EMULATED)
def test_emulated_kernel_matches_float64(D, G, kb, vb, n_rep, dtype, variant):
    tokens = [1, G + 1, 3 * G - 1] + ([9 * G + 5] if D == 128 else [])
    case = make_case(tokens, n_kv_heads=1, n_rep=n_rep, head_dim=D, tile_size=G, key_bits=kb, value_bits=vb,
                     dtype=dtype)
    got = cuda_emulator.emulated_paged_decode_attention(variant=variant, **case.kwargs())
    want = numpy_attention(case)
    for b in range(len(tokens)):  # each row on its own scale: the long row's records are measured too
        assert max_rel_error(got[b], want[b]) < TOL


@pytest.mark.skipif(not cuda_emulator.available(), reason="no g++ for the CUDA emulator")
def test_emulated_single_launch_matches_float64():
    case = make_case([1, 130, 5 * 128 + 9], n_kv_heads=1, n_rep=4, head_dim=128, tile_size=128, key_bits=4,
                     value_bits=2, seed=2)
    L = case.lengths
    plan = make_plan(L.slots, L.sink_len, L.tail_len, L.num_tiles, 1, min_split=10**6)
    got = cuda_emulator.emulated_paged_decode_attention(plan=plan, **case.kwargs())
    want = numpy_attention(case)
    for b in range(3):
        assert max_rel_error(got[b], want[b]) < TOL


def _static(case, splits: int) -> KernelPlan:
    L = case.lengths
    work, row_work, rows = static_plan(L.slots, L.sink_len, L.tail_len, L.num_tiles, splits)
    return KernelPlan(work=work, row_work=row_work, rows=rows, num_items=len(L.slots) * splits)


def test_static_plan_gives_every_row_the_same_items_covering_its_tiles_once():
    case = make_case([1, 130, 5 * 128 + 9], n_kv_heads=2, n_rep=2, head_dim=128, tile_size=128, key_bits=4,
                     value_bits=2)
    L = case.lengths
    for splits in (1, 3, 8):
        work, row_work, rows = static_plan(L.slots, L.sink_len, L.tail_len, L.num_tiles, splits)
        assert row_work.tolist() == [b * splits for b in range(4)]
        assert rows.tolist() == [list(r) for r in zip(L.slots, L.sink_len, L.tail_len, L.num_tiles)]
        for b, (n, t) in enumerate(zip(L.num_tiles, L.tail_len)):
            items = [tuple(w) for w in work.tolist()[b * splits: (b + 1) * splits]]
            assert all(i[0] == b for i in items)
            covered = [k for _, lo, hi in items for k in range(lo, hi)]
            assert covered == list(range(1 + n + (t > 0)))  # each tile once, in order (some items empty)
            # an empty item neither starts at the sink (tile 0) nor ends at a row's tail tile
            assert all(lo > 0 and (hi < 1 + n + 1 or t == 0) for _, lo, hi in items if lo == hi)
    assert static_splits(1, 4, 8, num_sms=SMS) == 6  # a short row, less than a wave: every tile an item
    assert static_splits(64, 200, 8, num_sms=SMS) == 1  # a wave of rows already
    assert 1 < static_splits(1, 200, 8, num_sms=SMS) <= 202


@pytest.mark.skipif(not cuda_emulator.available(), reason="no g++ for the CUDA emulator")
@pytest.mark.parametrize("splits", [1, 4, 11])
def test_emulated_kernel_with_a_static_plan_and_empty_items_matches_float64(splits):
    """A plan of fixed size (a compiled step's): rows shorter than its items leave some empty;
    11 items a row run the combine's unrolled loops past one group of 8."""
    case = make_case([1, 130, 5 * 128 + 9], n_kv_heads=1, n_rep=4, head_dim=128, tile_size=128, key_bits=4,
                     value_bits=2, seed=4)
    got = cuda_emulator.emulated_paged_decode_attention(plan=_static(case, splits), **case.kwargs())
    want = numpy_attention(case)
    for b in range(3):
        assert max_rel_error(got[b], want[b]) < TOL


@needs_cuda
@pytest.mark.parametrize("splits", [1, 4])
def test_kernel_with_a_static_plan_matches_reference(splits):
    case = make_case(ragged(128), n_kv_heads=2, n_rep=4, head_dim=128, tile_size=128, key_bits=4, value_bits=2)
    kw = case.kwargs()
    got = paged_decode_attention(**{**kw, "lengths": None}, plan=_static(case, splits))
    want = reference_paged_decode_attention(**kw)
    assert max_rel_error(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32))) < TOL


@pytest.mark.skipif(not cuda_emulator.available(), reason="no g++ for the CUDA emulator")
def test_emulated_kernel_sees_a_wrong_block():
    case = make_case([3 * 128 + 5, 2 * 128 + 9], n_kv_heads=1, n_rep=4, head_dim=128, tile_size=128, key_bits=4,
                     value_bits=2, seed=3)
    want = numpy_attention(case)
    t = np.array(case.table)
    t[0, 0], t[1, 0] = t[1, 0], t[0, 0]
    case.table = mx.array(t)
    got = cuda_emulator.emulated_paged_decode_attention(**case.kwargs())
    assert max_rel_error(got, want) > 10 * TOL


def test_row_lengths_names_each_rows_counts():
    lengths = RowLengths((3,), (1,), (0,), (2,))
    assert (lengths.slots, lengths.sink_len, lengths.tail_len, lengths.num_tiles) == ((3,), (1,), (0,), (2,))


def test_the_decided_verdict_is_what_attention_path_said():
    path = KERNELS.attention_path()
    assert KERNELS.decided_attention_path() == path
    from engine import attention_in_force
    cpu_kernels = path == "reference" and mx.default_device() == mx.cpu and KERNELS.cpu() is not None
    assert attention_in_force() == ("cpu-native" if cpu_kernels else path)


@needs_cuda
def test_decode_attention_dispatches_to_the_kernel_through_a_paged_batch(monkeypatch):
    """Paged rows (ragged, committing tiles during the steps) decode through PagedBatch (the pool's
    decode step, layer by layer): the step takes the kernel with its fixed-size launch plan, and its
    output matches the float64 reference over what the rows hold (``tests/kvarn/row_contents.py``)."""
    import kvarn.decode_graph as decode_graph
    import kvarn.attention as kvarn_attention
    from kvarn.layout import KVLayout
    from kvarn.paged import PagedBatch, PagedRow
    from kvarn.pool import KVarNPool
    from tests.kvarn.row_contents import paged_attention as attend, reference_decode
    calls = []
    counting = lambda **kw: calls.append(1) or paged_decode_attention(**kw)  # noqa: E731
    kernels = Kernels(replace(cuda_backend(), paged_decode=counting))
    assert kernels.attention_path() == "cuda-fused" and len(calls) == 1  # its self-check
    monkeypatch.setattr(decode_graph, "KERNELS", kernels)
    monkeypatch.setattr(kvarn_attention, "KERNELS", kernels)
    rng = np.random.default_rng(5)
    G, H, D = 64, 2, 128
    layout = KVLayout.kvarn("k4v2", tile_size=G)
    pool = KVarNPool(layout, num_layers=1)
    rows = []
    for n in (5, G - 2, 3 * G - 1):
        k = mx.array(rng.standard_normal((1, H, n, D)).astype(np.float16))
        v = mx.array(rng.standard_normal((1, H, n, D)).astype(np.float16))
        row = PagedRow(pool, [0])
        row.layers[0].update_and_fetch(k, v)
        rows.append(row)
    batch = PagedBatch([r.layers[0] for r in rows])
    for _ in range(4):  # rows cross G and commit a tile on the way
        k = mx.array(rng.standard_normal((3, H, 1, D)).astype(np.float16))
        v = mx.array(rng.standard_normal((3, H, 1, D)).astype(np.float16))
        q = mx.array(rng.standard_normal((3, 4 * H, 1, D)).astype(np.float16))
        batch.update_and_fetch(k, v)
        out = np.array(attend(q, batch, D ** -0.5, None).astype(mx.float32))
        assert max_rel_error(out, reference_decode(q, batch.rows, D ** -0.5)) < TOL
    assert [r.layers[0].num_tiles for r in rows] == [0, 0, 2]
    assert len(calls) == 1 + 4  # the self-check, then one call a step
