"""The verdict registry (metal/selector.py): a fresh ``Kernels`` decides each kernel once (the
commit once per layout) by its self-check, hands callers the kernel or None, falls back to the
reference with one warning per kind of kernel, and decides nothing where no backend has a kernel.
The backends here are stand-ins built from the references (they pass their self-checks) or from
the references made wrong (they fail them), so the selection logic runs on any machine."""

from __future__ import annotations

import logging
from dataclasses import replace

import mlx.core as mx
import pytest

from kvarn.layout import KVLayout
from kvarn.pool import quantize_blocks_reference
from metal.cuda.ragged_decode import make_plan as make_ragged_plan
from metal.reference import reference_paged_decode_attention, reference_ragged_decode_attention
from metal.selector import Backend, CommitKernel, Kernels

PAGED_SHAPE = dict(head_dim=128, tile_size=128, key_bits=4, value_bits=2, n_rep=4)
LAYOUT = dict(head_dim=64, tile_size=64, key_bits=4, value_bits=2, iters=8)


def quantizer(*, keys, values, key_bits, value_bits, iters):
    """The pure-MLX quantizer, called as the commit's self-check calls its reference."""
    layout = KVLayout(scheme="kvarn", key_bits=key_bits, value_bits=value_bits, tile_size=keys.shape[2], iters=iters)
    return quantize_blocks_reference(keys, values, layout)


class Counting:
    """Stand-in kernels with the real signatures, counting their calls; ``wrong``: off the reference."""

    def __init__(self, wrong: bool = False):
        self.calls: list[str] = []
        self.wrong = wrong

    def paged_decode(self, **kw):
        self.calls.append("paged_decode")
        out = reference_paged_decode_attention(**kw)
        return out * 2 if self.wrong else out

    def tiles(self, **kw):
        self.calls.append("tiles")
        out = quantizer(**kw)
        return dict(out, k_codes=out["k_codes"] ^ mx.array(0x55555555, dtype=mx.uint32)) if self.wrong else out

    def window_tails(self, *, win_k, win_v, slots, key_bits, value_bits, iters):
        self.calls.append("window_tails")
        G = win_k.shape[2] // 2
        return quantizer(keys=win_k[slots][:, :, G:], values=win_v[slots][:, :, G:], key_bits=key_bits,
                         value_bits=value_bits, iters=iters)

    def ragged_decode(self, **kw):
        self.calls.append("ragged_decode")
        out = reference_ragged_decode_attention(**kw)
        return out * 2 if self.wrong else out

    def backend(self) -> Backend:
        return Backend("CUDA", "cuda-fused", self.paged_decode, lambda **kw: kw["head_dim"] != 96,
                       CommitKernel(self.tiles, self.window_tails), lambda **kw: kw["head_dim"] != 96,
                       self.ragged_decode, lambda **kw: kw["dtype"] in (mx.float16, mx.bfloat16), make_ragged_plan)


def test_a_fresh_registry_decides_each_kernel_once():
    k = Counting()
    kernels = Kernels(k.backend())
    assert kernels.decided_attention_path() is None  # nothing decided until asked
    assert kernels.paged_decode(**PAGED_SHAPE) == k.paged_decode
    assert kernels.paged_decode(**PAGED_SHAPE) == k.paged_decode and kernels.attention_path() == "cuda-fused"
    assert k.calls == ["paged_decode"]  # one self-check, then the verdict is kept
    assert kernels.paged_decode(**dict(PAGED_SHAPE, head_dim=96)) is None  # no template: the caller's reference
    assert kernels.decided_attention_path() == "cuda-fused"


def test_the_commit_is_decided_once_per_layout():
    k = Counting()
    kernels = Kernels(k.backend())
    assert kernels.commit(reference=quantizer, **LAYOUT) == CommitKernel(k.tiles, k.window_tails)
    assert k.calls == ["tiles", "window_tails"]  # the self-check: tiles, then the same tiles as window tails
    kernels.commit(reference=quantizer, **LAYOUT)
    assert kernels.commit_path(reference=quantizer, **LAYOUT) == "cuda-fused" and len(k.calls) == 2
    other = dict(LAYOUT, key_bits=2)
    assert kernels.commit(reference=quantizer, **other) is not None and len(k.calls) == 4  # a second layout
    unsupported = dict(LAYOUT, head_dim=96)
    assert kernels.commit(reference=quantizer, **unsupported) is None and len(k.calls) == 4  # no self-check
    assert kernels.decided_commit_path() == "cuda-fused"


def test_the_ragged_decode_is_decided_once():
    k = Counting()
    kernels = Kernels(k.backend())
    shape = dict(head_dim=128, n_rep=4, dtype=mx.float16, kv_dtype=mx.float16)
    assert kernels.ragged_decode(**shape) == k.ragged_decode
    assert kernels.ragged_decode(**shape) == k.ragged_decode
    assert k.calls == ["ragged_decode", "ragged_decode"]  # one self-check: a split plan and a one-item plan
    assert kernels.ragged_decode(**dict(shape, dtype=mx.float32)) is None
    assert kernels.decided_ragged_decode_path() == "cuda-fused"


def test_failing_self_checks_give_the_reference_and_warn_once_a_kind(caplog):
    k = Counting(wrong=True)
    kernels = Kernels(k.backend())
    with caplog.at_level(logging.WARNING, logger="metal.selector"):
        assert kernels.paged_decode(**PAGED_SHAPE) is None and kernels.paged_decode(**PAGED_SHAPE) is None
        assert kernels.commit(reference=quantizer, **LAYOUT) is None
        assert kernels.commit(reference=quantizer, **dict(LAYOUT, key_bits=2)) is None  # another layout: no warning
        assert kernels.ragged_decode(head_dim=128, n_rep=4, dtype=mx.float16, kv_dtype=mx.float16) is None
    assert (kernels.attention_path(), kernels.decided_commit_path(), kernels.ragged_decode_path()) == \
        ("reference", "reference", "reference")
    assert k.calls.count("paged_decode") == 1 and k.calls.count("tiles") == 2
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3, warnings
    assert "decode kernel is off its reference" in warnings[0]
    assert "commit kernel is off its reference (0.0000 of code words equal" in warnings[1]
    assert "ragged decode kernel is off its reference" in warnings[2]


def test_a_kernel_that_raises_gives_the_reference(caplog):
    def broken(**kw):
        raise RuntimeError("too many resources requested for launch")

    kernels = Kernels(replace(Counting().backend(), paged_decode=broken, commit=CommitKernel(broken, broken),
                              ragged_decode=broken))
    with caplog.at_level(logging.WARNING, logger="metal.selector"):
        assert kernels.attention_path() == "reference"
        assert kernels.commit_path(reference=quantizer, **LAYOUT) == "reference"
        assert kernels.ragged_decode_path() == "reference"
    assert all("failed its self-check (too many resources" in r.getMessage() for r in caplog.records)
    assert len(caplog.records) == 3


def test_without_a_backend_everything_is_the_reference_and_nothing_is_run(caplog):
    called = []
    kernels = Kernels(backend=None)
    with caplog.at_level(logging.WARNING, logger="metal.selector"):
        assert kernels.paged_decode(**PAGED_SHAPE) is None
        assert kernels.commit(reference=lambda **kw: called.append(1), **LAYOUT) is None
        assert kernels.ragged_decode(head_dim=128, n_rep=4, dtype=mx.float16, kv_dtype=mx.float16) is None
    assert not called and len(caplog.records) == 2  # no reference run; the paged decode's and the commit's warning
    assert kernels.decided_ragged_decode_path() is None  # nothing decided where no backend has the kernel
    assert kernels.ragged_decode_path() == "reference"  # asked outright, it decides


def test_a_backend_without_the_ragged_kernel_decides_nothing_for_it():
    kernels = Kernels(replace(Counting().backend(), ragged_decode=None, ragged_decode_supported=None))
    assert kernels.ragged_decode(head_dim=128, n_rep=4, dtype=mx.float16, kv_dtype=mx.float16) is None
    assert kernels.decided_ragged_decode_path() is None


def test_the_attention_verdict_can_be_pinned_to_what_the_backend_gives():
    k = Counting()
    kernels = Kernels(k.backend())
    kernels.pin_attention_path("reference")
    assert kernels.paged_decode(**PAGED_SHAPE) is None and not k.calls
    kernels.pin_attention_path("cuda-fused")
    assert kernels.paged_decode(**PAGED_SHAPE) == k.paged_decode and not k.calls
    with pytest.raises(ValueError):
        kernels.pin_attention_path("metal-fused")
    with pytest.raises(ValueError):
        Kernels(backend=None).pin_attention_path("cuda-fused")


def test_registries_are_independent():
    first, second = Kernels(Counting(wrong=True).backend()), Kernels(Counting().backend())
    assert first.attention_path() == "reference" and second.attention_path() == "cuda-fused"
