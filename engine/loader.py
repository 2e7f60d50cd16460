"""Loading a local mlx-lm model folder: weights, tokenizer, context length and a fingerprint.

On MLX's CPU backend the weights are dequantized and cast to float32 at load: measured on the
bundled model (docs/benchmarks.md), float32 with OpenBLAS prefills ~5x and decodes ~2x faster
than bfloat16, and ~10x faster than MLX's CPU quantized matmul.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import dequantize_model
from mlx_lm.utils import load as mlx_lm_load

from metal import KERNELS
from metal.cpu.kernels import MAX_ROWS

logger = logging.getLogger(__name__)

BUNDLED_MODEL_DIR = Path(__file__).resolve().parent / "bundled" / "fixture-chat-29m-q8"
DTYPES = ("auto", "native", "float32", "float16", "bfloat16")
_FINGERPRINT_SAMPLE_BYTES = 1 << 20
_CONFIG_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run. ``compute_dtype`` is the activations' dtype (and the fp16-scheme KV
    cache's storage dtype); ``fingerprint`` identifies the weights and config across restarts."""

    model: nn.Module
    tokenizer: TokenizerWrapper
    model_id: str
    path: Path
    fingerprint: str
    context_length: int
    compute_dtype: str
    vocab_size: int


def model_fingerprint(path: Path) -> str:
    """A stable digest of a model folder: config and tokenizer files in full, and for every
    weight file its name, size, safetensors header and first/last MiB (hashing multi-GB
    weights in full would cost seconds at every start)."""
    digest = hashlib.sha256()
    for name in _CONFIG_FILES:
        file = path / name
        if file.exists():
            digest.update(name.encode() + b"\0" + file.read_bytes())
    for file in sorted(path.glob("*.safetensors")):
        size = file.stat().st_size
        digest.update(f"{file.name}\0{size}\0".encode())
        with file.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            digest.update(f.read(min(header_len, size)))
            digest.update(f.read(_FINGERPRINT_SAMPLE_BYTES))
            f.seek(max(0, size - _FINGERPRINT_SAMPLE_BYTES))
            digest.update(f.read())
    return digest.hexdigest()[:16]


def context_length_of(config: dict[str, Any], tokenizer: TokenizerWrapper) -> int:
    for key in ("max_position_embeddings", "max_seq_len", "max_sequence_length", "n_positions"):
        value = config.get(key) or config.get("text_config", {}).get(key)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    if isinstance(value, int) and 0 < value < 10**7:
        return value
    raise ValueError("cannot tell the model's context length from its config")


def resolve_dtype(dtype: str) -> str | None:
    """The compute dtype to cast to, or None to keep the weights as stored ("native")."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if dtype == "auto":
        return "float32" if mx.default_device() == mx.cpu else None
    return None if dtype == "native" else dtype


def load_model(path: str | Path | None = None, dtype: str = "auto", model_id: str | None = None) -> LoadedModel:
    """Load a local mlx-lm model folder (the bundled model when ``path`` is None)."""
    folder = Path(path).expanduser().resolve() if path is not None else BUNDLED_MODEL_DIR
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a model folder (no config.json)")
    target = resolve_dtype(dtype)
    model, tokenizer, config = mlx_lm_load(str(folder), return_config=True)
    if target is not None:
        model = dequantize_model(model)
        model.set_dtype(getattr(mx, target))
    mx.eval(model.parameters())
    compute_dtype = target or _native_dtype(model)
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id or folder.name,
        path=folder,
        fingerprint=model_fingerprint(folder),
        context_length=context_length_of(config, tokenizer),
        compute_dtype=compute_dtype,
        vocab_size=_vocab_size(config, model),
    )
    logger.info("loaded %s (%s, context %d, %s)", loaded.model_id, folder, loaded.context_length, compute_dtype)
    return loaded


def _native_dtype(model: nn.Module) -> str:
    for _, value in nn.utils.tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return str(value.dtype).removeprefix("mlx.core.")
    return "float32"


def _vocab_size(config: dict[str, Any], model: nn.Module) -> int:
    value = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
    if isinstance(value, int):
        return value
    logits = model(mx.array([[0]]))
    return int(logits.shape[-1])


# --- the model's body and head, apart ---

def _candidate(model: Any) -> tuple[Callable, Callable] | None:
    body = getattr(model, "model", None)
    if not callable(body):
        return None
    head = getattr(model, "lm_head", None)
    if head is None:
        embed = getattr(body, "embed_tokens", None)
        head = getattr(embed, "as_linear", None)
    return (body, head) if callable(head) else None


def split_head(model: Any) -> tuple[Callable, Callable] | None:
    """(body, head) such that ``head(body(x, cache=c))`` is ``model(x, cache=c)``, checked on a
    three-token probe over a fresh mlx-lm cache; None where the model does not split so."""
    split = _candidate(model)
    if split is None:
        return None
    body, head = split
    probe = mx.array([[1, 2, 3]], dtype=mx.int32)
    try:
        whole = model(probe, cache=make_prompt_cache(model))
        parts = head(body(probe, cache=make_prompt_cache(model)))
        mx.eval(whole, parts)
    except Exception:  # a model whose body wants other arguments: it runs whole
        logger.debug("the model's head does not split off", exc_info=True)
        return None
    if whole.shape != parts.shape or not mx.allclose(whole, parts, rtol=1e-5, atol=1e-5).item():
        return None
    return split


class CpuRoPE(nn.Module):
    """mlx-lm's ``nn.RoPE`` (not traditional) through the CPU kernels' rope: the same bits
    (``metal.self_checks.rope_mismatch``) as one graph node a call instead of MLX's CPU fallback's
    ~20 (a decode step of the bundled model: ~180 of its ~740 nodes). Anything it does not take
    (another dtype or rank) runs ``mx.fast.rope`` as ``nn.RoPE`` does."""

    def __init__(self, rope: nn.RoPE, kernels: Any) -> None:
        super().__init__()
        self.dims, self.traditional, self.base, self.scale = rope.dims, rope.traditional, rope.base, rope.scale
        self._kernels = kernels

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        if x.dtype != mx.float32 or x.ndim != 4:
            return mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale,
                                offset=offset)
        offset = offset.astype(mx.int32) if isinstance(offset, mx.array) else mx.array(offset, dtype=mx.int32)
        return self._kernels.rope(x, offset, dims=self.dims, base=self.base, scale=self.scale)


def use_cpu_rows_matmul(model: nn.Module) -> int:
    """On the CPU, where the CPU kernels run, each of the model's plain ``nn.Linear`` layers and
    its tied embedding's ``as_linear`` (the LM head) with float32 weights take the kernels'
    ``rows_matmul`` for inputs of up to ``MAX_ROWS`` rows (a decode step of a few rows; a
    prompt chunk or a larger batch keeps OpenBLAS): each weight read once, where OpenBLAS's sgemm
    copies the whole matrix a call. A weight whose every value is a bfloat16 (a bfloat16 or 8-bit
    model computing in float32) is read from a bfloat16 copy kept beside it: the same values, half
    the bytes. Returns how many modules were given the kernel. Only where OpenBLAS computes MLX's
    CPU products (preloaded, ``server/blas.py``): MLX's own reference BLAS sums every output in one
    order whatever the row count (``tests/openblas_plugin.py``), which a kernel for a few rows would
    break."""
    kernels = KERNELS.cpu()
    if kernels is None or "openblas" not in os.environ.get("LD_PRELOAD", ""):
        return 0
    swapped = 0
    for _, module in model.named_modules():
        cls = type(module)
        if cls in (nn.Linear, nn.Embedding) and module.weight.dtype == mx.float32:
            narrow = module.weight.astype(mx.bfloat16)
            exact = mx.array_equal(narrow.astype(mx.float32), module.weight).item()
            module.__class__ = _rows_matmul_class(cls, kernels)
            module.decode_weight = DecodeWeight(narrow if exact else module.weight)
            swapped += 1
    return swapped


class DecodeWeight:
    """The weight a module's few-row products read (``use_cpu_rows_matmul``): held outside the
    module's parameters, so its tree, ``parameters()`` and what is saved are the model's own."""

    def __init__(self, array: mx.array) -> None:
        self.array = array


def _rows_matmul_class(cls: type, kernels: Any) -> type:
    def few_rows(x: mx.array) -> bool:
        return x.dtype == mx.float32 and x.ndim > 0 and 0 < x.size <= MAX_ROWS * x.shape[-1]

    def body() -> dict[str, Any]:
        if cls is nn.Linear:
            def __call__(self: Any, x: mx.array) -> mx.array:
                if not few_rows(x) or self.weight.dtype != mx.float32:
                    return nn.Linear.__call__(self, x)
                y = kernels.rows_matmul(x, self.decode_weight.array)
                return y + self.bias if "bias" in self else y

            return {"__call__": __call__}

        def as_linear(self: Any, x: mx.array) -> mx.array:
            if not few_rows(x) or self.weight.dtype != mx.float32:
                return nn.Embedding.as_linear(self, x)
            return kernels.rows_matmul(x, self.decode_weight.array)

        return {"as_linear": as_linear}

    return _kernel_class("CpuRows", cls, kernels, body)


_KERNEL_CLASSES: dict[tuple[str, type, Any], type] = {}  # by name, the class it extends and the kernels it calls


def _kernel_class(name: str, cls: type, kernels: Any, body: Callable[[], dict[str, Any]]) -> type:
    """``cls`` with ``body()``'s methods, named ``name + cls.__name__``: made once per name, class
    and kernels, so every module of one class shares one class (a model's layers, several models)."""
    key = (name, cls, kernels)
    made = _KERNEL_CLASSES.get(key)
    if made is None:
        made = _KERNEL_CLASSES[key] = type(f"{name}{cls.__name__}", (cls,), body())
    return made


def use_cpu_swiglu(model: nn.Module) -> int:
    """On the CPU, where the CPU kernels run and their SwiGLU gives MLX's bits, each of the model's
    gated MLPs whose ``__call__`` is mlx-lm's ``down_proj(swiglu(gate_proj(x), up_proj(x)))`` (the
    same bytecode and the same ``swiglu``: Llama, Qwen, Mistral and ~45 other mlx-lm families) made
    a ``CpuSwiGLU`` of its class: the same parameters and the same bits, with the activation in one
    vectorized kernel (``metal/cpu/src/kvarn_cpu.cpp: SwiGLU``) instead of MLX's scalar exp an
    element; returns how many were. Any other MLP keeps its own."""
    kernels = KERNELS.cpu_swiglu()
    if kernels is None:
        return 0
    swapped = 0
    for _, module in model.named_modules():
        cls = type(module)
        if _is_swiglu_mlp(cls):
            module.__class__ = _cpu_swiglu_class(cls, kernels)
            swapped += 1
    return swapped


def _is_swiglu_mlp(cls: type) -> bool:
    call = vars(cls).get("__call__")
    code, want = getattr(call, "__code__", None), _SwiGLUMLP.__call__.__code__
    return (code is not None and code.co_code == want.co_code and code.co_names == want.co_names
            and code.co_consts == want.co_consts and call.__globals__.get("swiglu") is swiglu)


class _SwiGLUMLP(nn.Module):
    """The gated MLP's ``__call__`` as mlx-lm writes it (``mlx_lm.models.llama.MLP``): what
    ``_is_swiglu_mlp`` compares a class's with."""

    def __call__(self, x):  # noqa: ANN001, ANN204 (mlx-lm's own line, annotations and all, would change the bytecode)
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _cpu_swiglu_class(cls: type, kernels: Any) -> type:
    def __call__(self: Any, x: mx.array) -> mx.array:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if gate.dtype != mx.float32 or up.dtype != mx.float32 or gate.shape != up.shape:
            return self.down_proj(swiglu(gate, up))
        return self.down_proj(kernels.swiglu(gate, up))

    return _kernel_class("CpuSwiGLU", cls, kernels, lambda: {"__call__": __call__})


def use_cpu_rope(model: nn.Module) -> int:
    """On the CPU, where the CPU kernels run and their rope matches ``mx.fast.rope`` bit for bit,
    each of the model's plain ``nn.RoPE`` modules (not traditional, a base, float32 compute)
    replaced by ``CpuRoPE``; returns how many were. Scaled variants (Llama 3, YaRN, ...) keep
    their own."""
    kernels = KERNELS.cpu_rope()
    if kernels is None:
        return 0
    swapped = 0
    for _, module in model.named_modules():
        rope = getattr(module, "rope", None)
        if type(rope) is nn.RoPE and not rope.traditional and rope.base is not None:
            module.rope = CpuRoPE(rope, kernels)
            swapped += 1
    return swapped
