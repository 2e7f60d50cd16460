"""``kvarn kld``: fidelity of KV layouts against the unquantized cache, in the decode regime.

All prompts are cut to the same number of tokens and run as one batch. The reference arm
(unquantized KV) generates greedily; every other arm is teacher-forced through the same tokens
one token at a time, so its cache is quantized as it grows, exactly as when serving. At each
position we record KL(reference || arm) of the next-token distributions and whether the arm's
top-1 token equals the reference's. Until the first top-1 disagreement an arm's free-running
greedy output equals the reference's, so that position is its greedy agreement length.

Window arms (``kvarn:k4v2:w1024``, or ``--max-kv-size N`` for every arm without one): the arm's
cache attends at most N tokens (``kvarn.window``, ``kvarn.rotating``) while the reference keeps
the whole context, so the KLD of a windowed fp16 arm is what the window alone costs and a
windowed KVarN arm's is the window and the quantization together.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from engine.engine import make_layout
from engine.kv_config import KVConfig
from engine.loader import LoadedModel, use_cpu_rope, use_cpu_rows_matmul, use_cpu_swiglu
from kvarn.rows import RowStore, install_attention_seam, make_batch_cache, make_cache
from kvarn.batch import ChunkRows
from kvarn.layout import KVLayout

PROMPTS_FILE = Path(__file__).resolve().parent / "data" / "kld_prompts.json"
DEFAULT_ARMS = ("kvarn:k8v8", "kvarn:k4v4", "kvarn:k4v2", "kvarn:k3v3", "kvarn:k2v2", "affine:8", "affine:4")


def parse_arm(spec: str) -> KVConfig:
    """``fp16[:wN]``, ``kvarn:k4v2[:g64][:wN]`` or ``affine:4[:g32][:wN]`` (``:wN``: an attention
    window of N tokens, ``--max-kv-size N``)."""
    parts = spec.split(":")
    tail = {p[0]: int(p[1:]) for p in parts[1 if parts[0] == "fp16" else 2:] if p[:1] in ("g", "w") and p[1:].isdigit()}
    window = tail.get("w")
    if parts[0] == "fp16" and parts[1:] == ([f"w{window}"] if window is not None else []):
        return KVConfig("fp16", max_kv_size=window)
    if parts[0] == "kvarn" and len(parts) >= 2 and parts[1].startswith("k") and "v" in parts[1]:
        key, value = parts[1][1:].split("v")
        return KVConfig("kvarn", int(key), int(value), tile=tail.get("g", 128), max_kv_size=window)
    if parts[0] == "affine" and len(parts) >= 2 and parts[1].isdigit():
        return KVConfig("affine", int(parts[1]), int(parts[1]), group_size=tail.get("g", 64), max_kv_size=window)
    raise ValueError(f"bad arm {spec!r}: use fp16[:wN], kvarn:kXvY[:gG][:wN] or affine:B[:gG][:wN]")


def arm_config(spec: str, max_kv_size: int | None = None) -> tuple[str, KVConfig]:
    """(the arm's name in reports, its layout): ``max_kv_size`` windows an arm that names no
    window of its own, and the name then says so (``kvarn:k4v2:w1024``)."""
    kv = parse_arm(spec)
    if kv.max_kv_size is None and max_kv_size is not None:
        return f"{spec}:w{max_kv_size}", replace(kv, max_kv_size=max_kv_size)
    return spec, kv


@dataclass(frozen=True)
class KldConfig:
    arms: tuple[str, ...] = DEFAULT_ARMS
    num_prompts: int = 8
    prompt_tokens: int = 256
    gen_tokens: int = 2048
    max_kv_size: int | None = None  # windows every arm without one of its own (the reference stays unbounded)


@dataclass
class ArmResult:
    arm: str
    layout: dict[str, Any]
    bytes_per_token: float
    kld: np.ndarray = field(repr=False)  # [prompts, positions]
    top1: np.ndarray = field(repr=False)

    def summary(self, fp16_bytes: float) -> dict[str, Any]:
        flat = self.kld.reshape(-1)
        disagree = ~self.top1
        first = [int(np.argmax(row)) if row.any() else row.size for row in disagree]
        return {
            "arm": self.arm, "mean_kld": float(flat.mean()), "median_kld": float(np.median(flat)),
            "p99_kld": float(np.percentile(flat, 99)), "max_kld": float(flat.max()),
            "top1_agreement": float(self.top1.mean()), "greedy_agree_tokens_mean": float(np.mean(first)),
            "greedy_agree_tokens_min": int(min(first)), "bytes_per_token": self.bytes_per_token,
            "compression_vs_fp16": fp16_bytes / self.bytes_per_token,
        }


def load_prompts(loaded: LoadedModel, config: KldConfig) -> mx.array:
    prompts = json.loads(PROMPTS_FILE.read_text())["prompts"]
    if config.num_prompts > len(prompts):
        raise ValueError(f"only {len(prompts)} prompts ship with kvarn")
    rows = []
    for prompt in prompts[: config.num_prompts]:
        ids = loaded.tokenizer.encode(prompt["text"], add_special_tokens=False)
        if len(ids) < config.prompt_tokens:
            raise ValueError(f"prompt {prompt['name']} has only {len(ids)} tokens")
        rows.append(ids[: config.prompt_tokens])
    if config.prompt_tokens + config.gen_tokens > loaded.context_length:
        raise ValueError("prompt_tokens + gen_tokens exceeds the model's context")
    return mx.array(rows, dtype=mx.int32)


def _layer_geometry(loaded: LoadedModel) -> tuple[int, int, int]:
    """(head_dim, n_kv_heads, layers) read from a probe cache."""
    cache = make_cache(loaded.model, KVLayout.fp16(loaded.compute_dtype))
    mx.eval(loaded.model(mx.array([[0]], dtype=mx.int32), cache=cache))
    keys = cache[0].state[0]
    return keys.shape[-1], keys.shape[1], len(cache)


def _prefill(model: Any, layout: KVLayout, prompts: mx.array) -> tuple[list[Any], mx.array]:
    """The prompts [B, T] through a fresh cache of ``layout``: (the cache the decode steps run on,
    the last position's logits). KVarN rows are one sequence each, rows of one pool: the prompts
    run as one forward of their chunks (``ChunkRows``) and decode as one batch; the baselines'
    caches take the batch as it is."""
    if layout.scheme != "kvarn":
        cache = make_cache(model, layout)
        return cache, model(prompts, cache=cache)[:, -1]
    store = RowStore(model, layout)
    rows = [store.new_row(None) for _ in range(prompts.shape[0])]
    B, T = prompts.shape
    chunk = [ChunkRows([row[l] for row in rows], [T] * B) for l in range(len(rows[0]))]
    logits = model(prompts, cache=chunk)[:, -1]
    mx.eval(logits)
    return [make_batch_cache([row[l] for row in rows]) for l in range(len(rows[0]))], logits


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def run_kld(loaded: LoadedModel, config: KldConfig, progress: Callable[[int], None] = lambda _: None
            ) -> tuple[list[ArmResult], float]:
    """Run every arm in lockstep with the reference; returns results and fp16 bytes per token."""
    install_attention_seam(loaded.model)
    use_cpu_rope(loaded.model)
    use_cpu_swiglu(loaded.model)
    use_cpu_rows_matmul(loaded.model)
    prompts = load_prompts(loaded, config)
    head_dim, n_kv, n_layers = _layer_geometry(loaded)
    named = [arm_config(a, config.max_kv_size) for a in config.arms]
    layouts = [make_layout(kv, loaded) for _, kv in named]
    reference = make_cache(loaded.model, KVLayout.fp16(loaded.compute_dtype))
    model = loaded.model
    ref_logits = model(prompts, cache=reference)[:, -1]
    caches, arm_logits = [], []
    for layout in layouts:
        cache, logits = _prefill(model, layout, prompts)
        caches.append(cache)
        arm_logits.append(logits)
    kld = np.zeros((len(layouts), prompts.shape[0], config.gen_tokens), np.float32)
    top1 = np.zeros(kld.shape, bool)
    for t in range(config.gen_tokens):
        ref_lp = _log_softmax(ref_logits)
        token = mx.argmax(ref_logits, axis=-1)
        stats = [(mx.sum(mx.exp(ref_lp) * (ref_lp - _log_softmax(a)), axis=-1), mx.argmax(a, axis=-1) == token)
                 for a in arm_logits]
        mx.eval(token, stats)
        for i, (k, same) in enumerate(stats):
            kld[i, :, t] = np.maximum(np.array(k), 0.0)
            top1[i, :, t] = np.array(same)
        step = token[:, None]
        ref_logits = model(step, cache=reference)[:, -1]
        arm_logits = [model(step, cache=c)[:, -1] for c in caches]
        progress(1)
    # bytes as deployed with a half-precision model (fp16 KV, fp16 affine scales), whatever the
    # compute dtype of this run
    fp16_bytes = KVLayout.fp16("float16").bytes_per_token(head_dim, n_kv) * n_layers
    results = [ArmResult(name, layout.describe(loaded.fingerprint),
                         layout.with_storage_dtype("float16").bytes_per_token(head_dim, n_kv) * n_layers,
                         kld[i], top1[i])
               for i, ((name, _), layout) in enumerate(zip(named, layouts))]
    return results, fp16_bytes
