"""mlx-lm models run unmodified on paged KVarN rows (kvarn.rows.make_cache + the attention seam,
or engine.engine.make_engine): the bundled model and random-weight tiny models built from
mlx-lm's own classes (qwen3 head_dim 128, gemma3_text head_dim 256 with sliding-window layers,
llama head_dim 64).

Each arm prefills in two chunks (every chunk attends with decode's view, the continuation
chunk over the dequantized history) and then decodes 201 tokens one at a time; the KVarN arm is
teacher-forced on the unquantized arm's greedy tokens, so logits are compared position by position.

Measured max |logits(k8v8) - logits(unquantized cache)| over prefill + 201 decode steps (bounds
are ~3x): qwen3 0.016 (|logits| <= 6), llama 0.011 (<= 6), gemma3_text 0.17 (<= 6; affine 8-bit
gives 0.25 on the same model: gemma's scaled embeddings amplify any KV error); bundled model via
the engine, log-probabilities of the sampled tokens 0.026 (bound 0.08).
"""

from __future__ import annotations

import importlib
import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache

from engine.engine import make_engine, make_layout
from engine.kv_config import KVConfig
from engine.loader import LoadedModel, load_model
from engine.request import FinishReason, Request, RequestId, SamplingParams
from engine.scheduler import SchedulerConfig
from kvarn.rows import SEAM_NAME, count_quantized_layers, install_attention_seam, make_cache
from kvarn.snapshots import restore, snapshot
from kvarn.baselines import FP16KVCache
from kvarn.layout import KVLayout
from kvarn.paged import PagedLayer
from tests.kvarn.row_contents import assert_same_bytes, row_contents

VOCAB = 512
PROMPT_CHUNKS = (100, 50)
DECODE_STEPS = 201
G = 64

TINY = {
    "qwen3": dict(model_type="qwen3", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6,
                  vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=1e6),
    "gemma3_text": dict(model_type="gemma3_text", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=256, vocab_size=VOCAB,
                        sliding_window=32, sliding_window_pattern=2, query_pre_attn_scalar=256),
    "llama": dict(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                  num_attention_heads=4, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-5,
                  vocab_size=VOCAB),
}
# max |logit difference| k8v8 vs unquantized, ~3x the worst measured over prompts (qwen3 0.025,
# gemma3_text 0.23, llama 0.012)
K8V8_BOUND = {"qwen3": 0.075, "gemma3_text": 0.7, "llama": 0.04}


def build(arch: str, **overrides) -> nn.Module:
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs(**{**TINY[arch], **overrides}))
    mx.eval(model.parameters())
    return model


def run_arm(model: nn.Module, cache: list, prompt: list[int], chunks: tuple[int, ...],
            forced: list[int] | None, steps: int) -> tuple[np.ndarray, list[int]]:
    """Prefill ``prompt`` in ``chunks``, then decode ``steps`` tokens (greedy, or ``forced``).
    Returns the logits of the last prompt position and of every decode step [steps + 1, vocab],
    and the tokens fed during decode."""
    assert sum(chunks) == len(prompt)
    start = 0
    for size in chunks:
        logits = model(mx.array([prompt[start:start + size]], dtype=mx.int32), cache=cache)[0, -1]
        start += size
    mx.eval(logits)
    out, fed = [logits], []
    for i in range(steps):
        token = int(mx.argmax(out[-1]).item()) if forced is None else forced[i]
        fed.append(token)
        logits = model(mx.array([[token]], dtype=mx.int32), cache=cache)[0, -1]
        mx.eval(logits)
        out.append(logits)
    return np.stack([np.array(x.astype(mx.float32)) for x in out]), fed


def expected_counts(n: int, g: int) -> tuple[int, int, int]:
    """(offset, committed records, tail) of an n-token sequence."""
    return n, max(0, n - g) // g, max(0, n - g) % g


def window_shape(view: PagedLayer) -> tuple[int, ...]:
    """One row's window (sink then tail) in its pool: [n_kv_heads, 2G, head_dim]."""
    return tuple(view.row.pool.layers[view.l].win_k.shape[1:])


def compare_arms(model: nn.Module, name: str, prompt: list[int], kvarn: KVLayout, reference: KVLayout):
    install_attention_seam(model)
    ref_cache = make_cache(model, reference)
    ref_logits, tokens = run_arm(model, ref_cache, prompt, PROMPT_CHUNKS, None, DECODE_STEPS)
    kv_cache = make_cache(model, kvarn)
    kv_logits, fed = run_arm(model, kv_cache, prompt, PROMPT_CHUNKS, tokens, DECODE_STEPS)
    assert fed == tokens
    assert np.all(np.isfinite(ref_logits)) and np.all(np.isfinite(kv_logits))
    diff = float(np.abs(kv_logits - ref_logits).max())
    return ref_cache, kv_cache, ref_logits, kv_logits, diff


# --------------------------------------------------------------------------------------------
# tiny random-weight models
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_tiny_full_attention_model(arch):
    model = build(arch)
    prompt = np.random.default_rng(1).integers(0, VOCAB, sum(PROMPT_CHUNKS)).tolist()
    layout = KVLayout.kvarn("k8v8", tile_size=G)
    ref_cache, kv_cache, ref_logits, kv_logits, diff = compare_arms(
        model, arch, prompt, layout, KVLayout.fp16("float32"))
    assert [type(c) for c in ref_cache] == [FP16KVCache] * 2
    assert [type(c) for c in kv_cache] == [PagedLayer] * 2
    assert kv_cache[1].row is kv_cache[0].row  # one row of a pool of its own, every layer
    n = len(prompt) + DECODE_STEPS
    for c in kv_cache:
        assert (c.offset, c.num_tiles, c.tail_len) == expected_counts(n, G) == (351, 4, 31)
        assert c.sink_len == G
        assert window_shape(c) == (TINY[arch]["num_key_value_heads"], 2 * G, TINY[arch]["head_dim"])
        assert c.nbytes == layout.sequence_bytes(n, TINY[arch]["head_dim"], TINY[arch]["num_key_value_heads"])
    assert diff < K8V8_BOUND[arch], diff
    assert np.array_equal(kv_logits.argmax(-1), ref_logits.argmax(-1))


@pytest.mark.reference_blas  # chunks and the whole prompt feed k2v2 the same keys only there (tests/openblas_plugin.py)
@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text", "llama"])
def test_prompt_logits_do_not_depend_on_chunking(arch):
    """Every prompt token attends with decode's view, the first chunk's too: a prompt's logits
    are the same in one chunk or in several (to the float noise of differently shaped matmuls).
    Before the first record is committed (positions < 2G - 1) every token sees float16 keys and
    values only, so the logits are the unquantized cache's to float16 rounding; after it they
    are not (the records are quantized: k2v2 here, so the difference is plain)."""
    model = build(arch)
    install_attention_seam(model)
    n, g = 150, 64
    prompt = mx.array([np.random.default_rng(6).integers(0, VOCAB, n).tolist()], dtype=mx.int32)
    want = np.array(model(prompt, cache=make_cache(model, KVLayout.fp16("float32"))))
    layout = KVLayout.kvarn("k2v2", tile_size=g)
    whole = np.array(model(prompt, cache=make_cache(model, layout)))
    for cuts in ([64], [37, 100, 128]):
        cache, parts = make_cache(model, layout), []
        for lo, hi in zip([0, *cuts], [*cuts, n]):
            parts.append(np.array(model(prompt[:, lo:hi], cache=cache)))
        assert np.abs(np.concatenate(parts, axis=1) - whole).max() < 3e-3, cuts  # measured <= 6.6e-4 (gemma3)
    early = np.abs(whole[:, : 2 * g - 1] - want[:, : 2 * g - 1]).max()
    late = np.abs(whole[:, 2 * g - 1:] - want[:, 2 * g - 1:]).max()
    # measured early: qwen3 0.0016, llama 0.0013, gemma3 0.011; late 0.5 to 4.5
    assert early < 0.03 and late > 10 * early, (early, late)


def test_tiny_gemma3_sliding_layers_keep_their_own_cache():
    model = build("gemma3_text")
    prompt = np.random.default_rng(2).integers(0, VOCAB, sum(PROMPT_CHUNKS)).tolist()
    layout = KVLayout.kvarn("k8v8", tile_size=G)
    assert count_quantized_layers(model, layout) == (2, 4)
    ref_cache, kv_cache, ref_logits, kv_logits, diff = compare_arms(
        model, "gemma3_text", prompt, layout, KVLayout.fp16("float32"))
    # layers 0 and 2 slide (window 32): mlx-lm's RotatingKVCache, unquantized, in both arms;
    # layers 1 and 3 are global: KVarN
    assert [type(c) for c in ref_cache] == [RotatingKVCache, FP16KVCache, RotatingKVCache, FP16KVCache]
    assert [type(c) for c in kv_cache] == [RotatingKVCache, PagedLayer, RotatingKVCache, PagedLayer]
    n = len(prompt) + DECODE_STEPS
    for i in (0, 2):
        c = kv_cache[i]
        assert c.max_size == 32 and c.offset == n and c.keys.dtype == mx.float32
    for i in (1, 3):
        c = kv_cache[i]
        assert (c.offset, c.num_tiles, c.tail_len) == expected_counts(n, G) == (351, 4, 31)
        assert c.sink_len == G and window_shape(c) == (1, 2 * G, 256)
        k_codes = c.row.pool.layers[c.l].records["k_codes"]  # [blocks, H, S, W, G*bits/32]
        assert k_codes.shape[1:4] == (1, 2, 128)  # two 128-channel slices per record
    assert diff < K8V8_BOUND["gemma3_text"], diff
    assert np.mean(kv_logits.argmax(-1) == ref_logits.argmax(-1)) >= 0.95


def test_tiny_model_decodes_with_every_preset_in_order_of_bits():
    """The default k4v2 (and k4v4) also run 200+ decode steps with finite logits; error falls with
    bits (llama, measured max |diff| k4v2 0.94, k4v4 0.22, k8v8 0.010; affine 4-bit 0.29)."""
    model = build("llama")
    prompt = np.random.default_rng(3).integers(0, VOCAB, sum(PROMPT_CHUNKS)).tolist()
    install_attention_seam(model)
    ref, tokens = run_arm(model, make_cache(model, KVLayout.fp16("float32")), prompt, PROMPT_CHUNKS, None,
                          DECODE_STEPS)
    diffs = {}
    for preset in ("k4v2", "k4v4", "k8v8"):
        cache = make_cache(model, KVLayout.kvarn(preset, tile_size=G))
        logits, _ = run_arm(model, cache, prompt, PROMPT_CHUNKS, tokens, DECODE_STEPS)
        assert np.all(np.isfinite(logits))
        assert [(c.offset, c.num_tiles) for c in cache] == [(351, 4)] * 2
        diffs[preset] = float(np.abs(logits - ref).max())
    assert diffs["k8v8"] < diffs["k4v4"] < diffs["k4v2"] < 3.0, diffs
    assert diffs["k8v8"] < K8V8_BOUND["llama"], diffs


def test_restored_caches_continue_a_model_identically():
    """A whole row snapshotted mid-decode (``kvarn.snapshots.snapshot``), its arrays copied out (as to
    disk) and restored into a fresh row of a pool of its own: the same bytes in every layer, then
    the same tokens give identical logits."""
    model = build("llama")
    install_attention_seam(model)
    layout = KVLayout.kvarn("k4v2", tile_size=G)
    prompt = np.random.default_rng(4).integers(0, VOCAB, 90).tolist()
    live = make_cache(model, layout)
    _, tokens = run_arm(model, live, prompt, (90,), None, 5)
    metas, arrays = snapshot(live)
    restored = restore(make_cache(model, layout), metas, [mx.array(np.array(a)) for a in arrays])
    assert restored[0].row is not live[0].row and restored[0].row.pool is not live[0].row.pool
    for x, y in zip(restored, live, strict=True):
        assert_same_bytes(row_contents(x), row_contents(y))
    more = np.random.default_rng(5).integers(0, VOCAB, 100).tolist()  # commits records at 128 and 192
    a = [model(mx.array([[t]], dtype=mx.int32), cache=live)[0, -1] for t in more[:1]]
    b = [model(mx.array([[t]], dtype=mx.int32), cache=restored)[0, -1] for t in more[:1]]
    for t in more[1:]:
        a.append(model(mx.array([[t]], dtype=mx.int32), cache=live)[0, -1])
        b.append(model(mx.array([[t]], dtype=mx.int32), cache=restored)[0, -1])
        mx.eval(a[-1], b[-1])
    assert live[0].num_tiles == restored[0].num_tiles == 2
    for x, y in zip(a, b):
        assert np.array_equal(np.array(x), np.array(y))
    for x, y in zip(restored, live, strict=True):
        assert_same_bytes(row_contents(x), row_contents(y))


# --------------------------------------------------------------------------------------------
# the bundled model, through the engine
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def loaded():
    return load_model()


def test_bundled_model_k8v8_engine_matches_unquantized_cache(loaded):
    engine = make_engine(loaded, SchedulerConfig(prefill_chunk_size=150), kv=KVConfig("kvarn", 8, 8))
    assert engine.layout == KVLayout(scheme="kvarn", key_bits=8, value_bits=8, tile_size=128,
                                     storage_dtype=loaded.compute_dtype)
    assert engine.describe_kv()["layers"] == 8 and engine.describe_kv()["layers_with_layout"] == 8
    text = json.loads((Path(__file__).resolve().parents[2] / "engine/data/kld_prompts.json").read_text())
    prompt = loaded.tokenizer.encode(text["prompts"][0]["text"], add_special_tokens=False)[:200]
    assert len(prompt) == 200
    steps = DECODE_STEPS + 1  # the first token comes from the prefill, then 201 decode forwards
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True, logprobs=True)
    request = Request(RequestId("long"), prompt, params)
    engine.add_request(request)
    logprobs, seen, cache = [], [], None
    while engine.has_work():
        for out in engine.step():
            logprobs.extend(out.logprobs)
            last = out
        row = engine.runner.rows.get(RequestId("long"))
        cache = row.cache if row is not None else cache  # the row is released as its request ends
        seen.append([(c.offset, c.num_tiles, c.tail_len) for c in cache])
    assert last.finish_reason is FinishReason.LENGTH and len(request.output_ids) == steps
    assert all(type(c) is PagedLayer for c in cache)  # the engine's rows are paged rows
    assert all(type(c) is PagedLayer for c in make_cache(loaded.model, engine.layout))
    # after the last step: prompt + every sampled token but the last went through the cache
    n = len(prompt) + steps - 1
    assert seen[-1] == [expected_counts(n, 128)] * 8 == [(401, 2, 17)] * 8
    assert seen[0] == [(150, 0, 22)] * 8  # after the first prefill chunk
    assert len(logprobs) == steps and all(np.isfinite(lp.logprob) for lp in logprobs)
    # the unquantized cache, teacher-forced on the engine's tokens, same prefill chunks
    ref_layout = make_layout(KVConfig("fp16"), loaded)
    ref_logits, _ = run_arm(loaded.model, make_cache(loaded.model, ref_layout), prompt, (150, 50),
                            list(request.output_ids[:-1]), steps - 1)
    assert np.all(np.isfinite(ref_logits))
    ref_lp = ref_logits - np.logaddexp.reduce(ref_logits.astype(np.float64), axis=-1, keepdims=True)
    sampled = np.array(request.output_ids)
    got = np.array([lp.logprob for lp in logprobs])
    diff = float(np.abs(got - ref_lp[np.arange(steps), sampled]).max())
    assert diff < 0.08, diff
    # greedy under k8v8 equals greedy under the unquantized cache at (nearly) every position
    assert np.mean(ref_logits.argmax(-1) == sampled) >= 0.98


# --------------------------------------------------------------------------------------------
# failing loudly
# --------------------------------------------------------------------------------------------

class NoSeamModel(nn.Module):
    """A model whose module (this test module) holds no ``scaled_dot_product_attention``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = [nn.Linear(4, 4)]

    def __call__(self, x, cache=None):
        return x


def test_install_attention_seam_refuses_a_module_without_the_seam():
    assert not hasattr(sys.modules[__name__], SEAM_NAME)
    with pytest.raises(RuntimeError, match=f"has no '{SEAM_NAME}'"):
        install_attention_seam(NoSeamModel())
    # also for a class defined in a separate module
    module = types.ModuleType("kvarn_test_no_seam_module")
    exec("import mlx.nn as nn\nclass M(nn.Module):\n    pass\n", module.__dict__)
    sys.modules[module.__name__] = module
    try:
        with pytest.raises(RuntimeError, match="kvarn_test_no_seam_module has no"):
            install_attention_seam(module.M())
    finally:
        del sys.modules[module.__name__]


def test_install_attention_seam_patches_model_modules_once():
    model = build("llama")
    first = install_attention_seam(model)
    llama = sys.modules["mlx_lm.models.llama"]
    seam = getattr(llama, SEAM_NAME)
    assert "mlx_lm.models.llama" in first and "mlx_lm.models.base" in first
    assert getattr(seam, "__kvarn_seam__", False)
    second = install_attention_seam(model)
    assert getattr(llama, SEAM_NAME) is seam  # not wrapped twice
    assert set(first) <= set(second)


def tiny_loaded(model: nn.Module, name: str) -> LoadedModel:
    return LoadedModel(model=model, tokenizer=SimpleNamespace(eos_token_ids=[0]), model_id=name, path=Path("."),
                       fingerprint=name, context_length=4096, compute_dtype="float32", vocab_size=VOCAB)


def test_make_engine_rejects_unsupported_head_dim():
    model = build("llama", head_dim=96)
    with pytest.raises(ValueError, match="KVarN supports head_dim 64, 128, 256 and 512, not 96"):
        make_engine(tiny_loaded(model, "tiny-llama-96"))
    # the unquantized and affine layouts do run it
    make_engine(tiny_loaded(model, "tiny-llama-96"), kv=KVConfig("fp16"))


def test_make_engine_describes_mixed_models():
    engine = make_engine(tiny_loaded(build("gemma3_text"), "tiny-gemma3"), kv=KVConfig("kvarn", tile=64))
    kv = engine.describe_kv()
    assert (kv["layers"], kv["layers_with_layout"], kv["key_bits"], kv["value_bits"], kv["tile"]) == (4, 2, 4, 2, 64)
    assert kv["stamp"] == engine.layout.stamp("tiny-gemma3")
