"""The model's operations through the CPU kernels (``engine/loader.py``): gated MLPs' SwiGLU
(``use_cpu_swiglu``: the same parameters and the same logits as mlx-lm's own model, swapped only where
the MLP's code is mlx-lm's ``down_proj(swiglu(gate_proj(x), up_proj(x)))``), and the Linear layers'
products of a few rows (``use_cpu_rows_matmul``: float32 rounding, prompts untouched)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama, qwen3
from mlx_lm.models.activations import swiglu
from mlx_lm.models.cache import make_prompt_cache

from engine.loader import load_model, use_cpu_rope, use_cpu_rows_matmul, use_cpu_swiglu
from metal.selector import Kernels

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU kernels run where MLX runs on the CPU")


def test_every_mlp_of_the_bundled_model_is_swapped_and_its_logits_keep_their_bits():
    ours, theirs = load_model(), load_model()
    assert use_cpu_swiglu(ours.model) == len(ours.model.layers)
    use_cpu_rope(ours.model), use_cpu_rope(theirs.model)
    assert all(isinstance(layer.mlp, llama.MLP) and type(layer.mlp) is not llama.MLP for layer in ours.model.layers)
    assert [k for k, _ in tree_flatten(ours.model.parameters())] == [k for k, _ in tree_flatten(theirs.model.parameters())]
    prompt = mx.array([[5, 77, 901, 33, 2048, 7, 7, 300, 12, 4000] * 4])  # a prompt takes the threaded path
    caches = [make_prompt_cache(ours.model), make_prompt_cache(theirs.model)]
    outs = [m.model(prompt, cache=c) for m, c in zip((ours, theirs), caches)]
    assert mx.array_equal(outs[0], outs[1]).item()
    for token in (17, 18, 19):
        outs = [m.model(mx.array([[token]]), cache=c) for m, c in zip((ours, theirs), caches)]
        assert mx.array_equal(outs[0], outs[1]).item()


class Gated(nn.Module):
    """mlx-lm's MLP line in a class of its own (a model family's copy of it)."""

    def __init__(self, dim: int = 16, hidden: int = 24):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def __call__(self, x):  # noqa: ANN001, ANN204 (mlx-lm's line as it writes it)
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class Scaled(Gated):
    def __call__(self, x):  # noqa: ANN001, ANN204 (another activation: not mlx-lm's line)
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)) * 2)


class Gelu(Gated):
    def __call__(self, x):  # noqa: ANN001, ANN204
        return self.down_proj(nn.gelu(self.gate_proj(x)) * self.up_proj(x))


def test_only_mlx_lm_s_swiglu_line_is_swapped_and_other_dtypes_keep_mlx_s_path(monkeypatch):
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [Gated(), Scaled(), Gelu(), qwen3.MLP(16, 24)]

    model = Model()
    x = mx.random.normal((3, 16), key=mx.random.key(1)) * 3
    want = [layer(x) for layer in model.layers]
    assert use_cpu_swiglu(model) == 2
    assert [type(layer).__name__ for layer in model.layers] == ["CpuSwiGLUGated", "Scaled", "Gelu", "CpuSwiGLUMLP"]
    assert all(mx.array_equal(layer(x), w).item() for layer, w in zip(model.layers, want))
    model.set_dtype(mx.float16)  # another dtype: mlx-lm's swiglu itself
    half = x.astype(mx.float16)
    assert mx.array_equal(model.layers[0](half), Gated.__call__(model.layers[0], half)).item()
    monkeypatch.setattr("engine.loader.KERNELS", Kernels(backend=None))  # no kernels: nothing is swapped
    assert use_cpu_swiglu(Model()) == 0


def test_a_few_rows_take_the_rows_matmul_and_a_prompt_keeps_openblas_s_bits():
    """Every Linear layer and the tied LM head are given the kernel; a decode token's logits are
    the model's to float32 rounding, a prompt chunk's (more rows than the kernel takes) keep their
    bits."""
    ours, theirs = load_model(), load_model()
    assert use_cpu_rows_matmul(ours.model) == 7 * len(ours.model.layers) + 1
    assert type(ours.model.model.embed_tokens).__name__ == "CpuRowsEmbedding"
    # an 8-bit model's float32 weights are bfloat16 values: read from a bfloat16 copy, outside the parameters
    assert ours.model.model.embed_tokens.decode_weight.array.dtype == mx.bfloat16
    assert [k for k, _ in tree_flatten(ours.model.parameters())] == [k for k, _ in tree_flatten(theirs.model.parameters())]
    prompt = mx.array([[5, 77, 901, 33, 2048, 7, 7, 300, 12, 4000]])
    caches = [make_prompt_cache(ours.model), make_prompt_cache(theirs.model)]
    outs = [m.model(prompt, cache=c) for m, c in zip((ours, theirs), caches)]
    assert mx.array_equal(outs[0], outs[1]).item()
    for token in (17, 18):
        outs = [m.model(mx.array([[token]]), cache=c) for m, c in zip((ours, theirs), caches)]
        assert mx.allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4).item()
        assert mx.argmax(outs[0][0, -1]).item() == mx.argmax(outs[1][0, -1]).item()
    x = mx.random.normal((1, 3, ours.model.args.hidden_size), key=mx.random.key(9))
    layer = ours.model.layers[0].mlp.gate_proj
    assert mx.allclose(layer(x), x @ layer.weight.T, rtol=1e-5, atol=1e-5).item()
    half = x.astype(mx.float16)  # another dtype: MLX's own matmul
    assert mx.array_equal(layer(half), nn.Linear.__call__(layer, half)).item()


def test_a_weight_that_is_not_bfloat16_keeps_its_float32_copy():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Linear(16, 8), nn.Linear(16, 8, bias=False)]

    model = Model()
    model.layers[1].weight = model.layers[1].weight.astype(mx.bfloat16).astype(mx.float32)
    assert use_cpu_rows_matmul(model) == 2
    assert [layer.decode_weight.array.dtype for layer in model.layers] == [mx.float32, mx.bfloat16]
    x = mx.random.normal((2, 16), key=mx.random.key(4))
    for layer in model.layers:
        assert mx.allclose(layer(x), nn.Linear.__call__(layer, x), rtol=1e-5, atol=1e-5).item()


def test_under_mlx_s_reference_blas_the_products_stay_mlx_s(monkeypatch):
    """The reference BLAS sums every output in one order whatever the row count (what
    tests/openblas_plugin.py relies on): a kernel for a few rows would break that, so it is not used."""
    monkeypatch.setenv("LD_PRELOAD", "")
    model = nn.Sequential(nn.Linear(16, 8))
    assert use_cpu_rows_matmul(model) == 0 and type(model.layers[0]) is nn.Linear
