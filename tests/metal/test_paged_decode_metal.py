"""The Metal twin of the fused paged decode attention (metal/msl/paged_decode.py): its Metal
source run by the CPU emulator (tests/metal/metal_emulator.py) against the pure-MLX reference and
a float64 NumPy attention, the self-check that decides it (passing on the body, failing on a
broken one), and, on an Apple GPU only, the real kernel against the reference."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from metal import KERNELS
from metal.launch import minify
from metal.msl import paged_decode as pm
from metal.msl.paged_decode import ATTENTION_SOURCE
from metal.paged_plan import make_plan
from metal.reference import reference_paged_decode_attention
from metal.selector import SELF_CHECK_TOLERANCE, Kernels, metal_backend, paged_decode_self_check
from tests.metal import metal_emulator
from tests.metal.cases import make_case, max_rel_error, numpy_attention

HAS_METAL = hasattr(mx, "metal") and mx.metal.is_available()
needs_metal = pytest.mark.skipif(not HAS_METAL, reason="no Apple GPU: the Metal kernel runs only there")
needs_gxx = pytest.mark.skipif(not metal_emulator.available(), reason="no g++ for the Metal emulator")
TOL = 1e-2  # max |a - b| / max |b|; float16 rounding of K, V and the output is ~1e-3


def test_threadgroup_memory_fits_every_supported_shape():
    """The body's threadgroup memory is under Apple's 32 KB at every shape it takes (the largest:
    D 256, G 128, 8 heads a KV head), and is_supported says so."""
    sizes = [pm.threadgroup_bytes(D, G, NR) for D in (64, 128, 256) for G in (64, 128) for NR in range(1, 9)]
    assert max(sizes) == pm.threadgroup_bytes(256, 128, 8) <= pm.MAX_THREADGROUP_MEMORY
    assert pm.is_supported(head_dim=256, tile_size=128, key_bits=8, value_bits=8, n_rep=8)
    assert not pm.is_supported(head_dim=96, tile_size=128, key_bits=4, value_bits=2, n_rep=4)
    assert not pm.is_supported(head_dim=128, tile_size=128, key_bits=4, value_bits=2, n_rep=9)
    assert not pm.is_supported(head_dim=128, tile_size=128, key_bits=5, value_bits=2, n_rep=4)


def test_the_signature_is_mlx_s():
    """The emulator compiles the text MLX would: small inputs in the constant address space, the
    thread attributes the body names, the template and its explicit instantiation."""
    case = make_case([1, 70], n_kv_heads=1, n_rep=2, head_dim=64, tile_size=64, key_bits=4, value_bits=2)
    L = case.lengths
    plan = make_plan(L.slots, L.sink_len, L.tail_len, L.num_tiles, 1)
    call = pm.attention_launch(case.queries, case.records, case.win_k, case.win_v, case.table, plan, case.scale, (4, 2))
    text, _, attrs = metal_emulator.kernel_source(call.name, call.header, call.source, call.input_names,
                                                  [(tuple(a.shape), a.dtype) for a in call.inputs],
                                                  call.output_names, call.output_dtypes, call.template)
    assert "template <typename QT, typename WT, int D, int G, int KB, int VB, int NR>" in text
    assert "const constant int32_t* meta [[buffer(14)]]" in text and "const device float16_t* win_k" in text
    assert "device float* part_ml [[buffer(17)]]" in text
    assert [a for a, _, _ in attrs] == ["simdgroup_index_in_threadgroup", "thread_index_in_simdgroup",
                                        "thread_index_in_threadgroup", "threadgroup_position_in_grid",
                                        "threadgroups_per_grid"]
    assert 'template [[host_name("custom_kernel_kvarn_paged_decode__float16_t_float16_t_64_64_4_2_2_' in text


# ---- the Metal source run by the CPU emulator (one std::thread per GPU thread: small shapes) ----
# (D, G, kb, vb, n_rep, dtype, rows): bits 2/4/8 keys and values, D 64/128, G 64/128, rows around
# tile boundaries (sink only, an exact sink, one past it, an empty tail after records, a long tail)
EMULATED = [
    (64, 64, 4, 2, 2, mx.float16, [1, 64, 65, 3 * 64, 3 * 64 - 1]),
    (64, 64, 8, 8, 3, mx.bfloat16, [5, 2 * 64 + 63]),
    (128, 128, 2, 4, 4, mx.float16, [128, 2 * 128 + 1]),
    (128, 64, 4, 8, 1, mx.float16, [64 + 1, 4 * 64]),
]


@needs_gxx
@pytest.mark.parametrize("D,G,kb,vb,n_rep,dtype,tokens", EMULATED,
                         ids=lambda v: None if isinstance(v, list) else str(v))
@pytest.mark.parametrize("single", [False, True], ids=["split", "single"])
def test_emulated_kernel_matches_reference(D, G, kb, vb, n_rep, dtype, tokens, single):
    """Every row against the pure-MLX reference and float64, with the rows split into several
    work items (the combine merges them) and with one work item a row."""
    case = make_case(tokens, n_kv_heads=2 if D == 64 else 1, n_rep=n_rep, head_dim=D, tile_size=G, key_bits=kb,
                     value_bits=vb, dtype=dtype, seed=D + G + kb)
    L = case.lengths
    H = case.win_k.shape[1]
    plan = make_plan(L.slots, L.sink_len, L.tail_len, L.num_tiles, H, single=single, blocks_per_sm=1000)
    if not single and max(L.num_tiles) > 0:
        assert plan.num_items > len(tokens)  # a row is cut into splits
    got = metal_emulator.emulated_paged_decode_attention(plan=plan, **case.kwargs())
    ref = np.array(reference_paged_decode_attention(**case.kwargs()).astype(mx.float32)).astype(np.float64)
    want = numpy_attention(case)
    for b in range(len(tokens)):  # each row on its own scale
        assert max_rel_error(got[b], ref[b]) < TOL
        assert max_rel_error(got[b], want[b]) < TOL


@needs_gxx
def test_emulated_kernel_sees_a_wrong_block():
    case = make_case([3 * 64 + 5, 2 * 64 + 9], n_kv_heads=1, n_rep=2, head_dim=64, tile_size=64, key_bits=4,
                     value_bits=2, seed=3)
    want = numpy_attention(case)
    t = np.array(case.table)
    t[0, 0], t[1, 0] = t[1, 0], t[0, 0]
    case.table = mx.array(t)
    got = metal_emulator.emulated_paged_decode_attention(**case.kwargs())
    assert max_rel_error(got, want) > 10 * TOL


def _emulated_kernel(source=None):
    def kernel(**kw):
        kw.pop("variant", None)
        return mx.array(metal_emulator.emulated_paged_decode_attention(source=source, **kw).astype(np.float32))
    return kernel


# broken bodies: no rescale of the running output when a later tile raises the maximum; the key
# codes of neighbouring tokens swapped; the value codes of neighbouring channels swapped
NO_RESCALE = ("o[j][r] = o[j][r] * corr[r] + cv * (acc[r] + pb);", "o[j][r] = o[j][r] + cv * (acc[r] + pb);")
K_SWAP = ("kv_code<KB>(kc + d * KGW, g * KB)", "kv_code<KB>(kc + d * KGW, (g ^ 1) * KB)")
V_SWAP = ("kv_code<VB>(vc + gi * VDW, d * VB)", "kv_code<VB>(vc + gi * VDW, (d ^ 1) * VB)")


def broken(change: tuple[str, str]) -> str:
    body = ATTENTION_SOURCE.replace(*change)
    assert body != ATTENTION_SOURCE
    return minify(body)


@needs_gxx
@pytest.mark.parametrize("change", [NO_RESCALE, K_SWAP], ids=["no-rescale", "k-swap"])
def test_emulated_broken_bodies_are_caught(change):
    """The comparison discriminates: a broken body is far off float64 on rows of several tiles
    (one work item a row, so each item runs its online softmax across tiles)."""
    case = make_case([3 * 64 + 5, 2 * 64 + 9], n_kv_heads=1, n_rep=2, head_dim=64, tile_size=64, key_bits=4,
                     value_bits=2, seed=3)
    L = case.lengths
    plan = make_plan(L.slots, L.sink_len, L.tail_len, L.num_tiles, 1, single=True)
    got = metal_emulator.emulated_paged_decode_attention(source=broken(change), **case.kwargs(), plan=plan)
    assert max_rel_error(got, numpy_attention(case)) > 10 * TOL


@needs_gxx
def test_emulated_self_check_passes_on_the_body_and_fails_on_a_broken_one():
    """The selector on an Apple GPU (``Kernels`` with the Metal backend) with the emulated Metal
    body: its self-check within the tolerance, the verdict "metal-fused"; with value channels
    swapped: past it, the verdict the reference. (The self-check's random records are small next
    to its windows: it passes the two bodies above, 5e-4 and 2e-3 off; the tests on real records
    are what catch them.)"""
    good = Kernels(replace(metal_backend(), paged_decode=_emulated_kernel()))
    assert good.attention_path() == "metal-fused"
    shape = dict(head_dim=128, tile_size=128, key_bits=4, value_bits=2, n_rep=4)
    assert good.paged_decode(**shape) is good.backend.paged_decode
    bad = Kernels(replace(metal_backend(), paged_decode=_emulated_kernel(broken(V_SWAP))))
    assert bad.attention_path() == "reference" and bad.paged_decode(**shape) is None
    assert paged_decode_self_check(_emulated_kernel(broken(V_SWAP))) > SELF_CHECK_TOLERANCE


@needs_gxx
def test_emulated_launch_refuses_too_much_threadgroup_memory():
    """The emulator enforces Apple's 32 KB: a body asking for more fails to launch."""
    case = make_case([1], n_kv_heads=1, n_rep=1, head_dim=64, tile_size=64, key_bits=4, value_bits=2)
    big = ATTENTION_SOURCE.replace("static_assert(TG * 4 <= 32768", "static_assert(true").replace(
        "threadgroup float tg[TG];", "threadgroup float tg[TG + 8192];")
    with pytest.raises(RuntimeError, match="threadgroup memory"):
        metal_emulator.emulated_paged_decode_attention(source=minify(big), **case.kwargs())


def test_verdict_off_metal_is_not_metal_fused():
    path = Kernels().attention_path()
    if not HAS_METAL:
        assert path != "metal-fused"


# ---- the real kernel on an Apple GPU ----
@needs_metal
@pytest.mark.parametrize("D,G,kb,vb,n_rep", [(128, 128, 4, 2, 4), (64, 64, 3, 8, 2), (256, 128, 8, 4, 8),
                                             (128, 64, 2, 2, 1)])
def test_kernel_matches_reference(D, G, kb, vb, n_rep):
    case = make_case([1, G, G + 1, 3 * G - 1, 9 * G + 5], n_kv_heads=2, n_rep=n_rep, head_dim=D, tile_size=G,
                     key_bits=kb, value_bits=vb)
    ref = np.array(reference_paged_decode_attention(**case.kwargs()).astype(mx.float32))
    got = np.array(pm.paged_decode_attention(**case.kwargs()).astype(mx.float32))
    assert max_rel_error(got, ref) < TOL
    assert max_rel_error(got, numpy_attention(case)) < TOL


@needs_metal
def test_metal_verdict():
    assert KERNELS.attention_path() in ("metal-fused", "reference")
    assert paged_decode_self_check(pm.paged_decode_attention) <= SELF_CHECK_TOLERANCE
