"""The model's RoPE through the CPU kernels (``engine/loader.py: use_cpu_rope``): the same logits as
mlx-lm's own model, and the swap only where it is exact."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.loader import CpuRoPE, load_model, use_cpu_rope
from metal.selector import Kernels

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU kernels run where MLX runs on the CPU")


def test_every_plain_rope_of_the_bundled_model_is_swapped_and_its_logits_keep_their_bits():
    ours, theirs = load_model(), load_model()
    assert use_cpu_rope(ours.model) == len(ours.model.layers)
    assert all(isinstance(layer.self_attn.rope, CpuRoPE) for layer in ours.model.layers)
    prompt = mx.array([[5, 77, 901, 33, 2048, 7, 7, 300, 12, 4000]])
    caches = [make_prompt_cache(ours.model), make_prompt_cache(theirs.model)]
    outs = [m.model(prompt, cache=c) for m, c in zip((ours, theirs), caches)]
    assert mx.array_equal(outs[0], outs[1]).item()
    for token in (17, 18, 19):  # decode tokens at growing offsets
        outs = [m.model(mx.array([[token]]), cache=c) for m, c in zip((ours, theirs), caches)]
        assert mx.array_equal(outs[0], outs[1]).item()


def test_traditional_scaled_or_half_precision_ropes_keep_mlx_s_own(monkeypatch):
    class Attention(nn.Module):
        def __init__(self, rope):
            super().__init__()
            self.rope = rope

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [Attention(nn.RoPE(64, traditional=True)), Attention(nn.RoPE(64)),
                           Attention(nn.Identity())]

    model = Model()
    assert use_cpu_rope(model) == 1
    assert type(model.layers[0].rope) is nn.RoPE and isinstance(model.layers[1].rope, CpuRoPE)
    x = mx.random.normal((1, 2, 3, 64)).astype(mx.float16)  # another dtype: mx.fast.rope itself
    assert mx.array_equal(model.layers[1].rope(x, offset=9), nn.RoPE(64)(x, offset=9)).item()
    monkeypatch.setattr("engine.loader.KERNELS", Kernels(backend=None))  # no kernels: nothing is swapped
    assert use_cpu_rope(Model()) == 0
