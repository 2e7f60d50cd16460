"""Prompt chunks of several rows in one forward (``kvarn.batch.ChunkRows``): each row writes and
attends exactly what its chunk alone would (byte for byte, for every row kind the engine makes),
the padding is never written, shared buffers are updated in place, and through mlx-lm models
(plain attention, and gemma3's sliding-window layers) a batched chunk gives each row's logits
of its chunk alone."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import base

from kvarn.rows import RowStore, install_attention_seam, make_dispatch
from kvarn.batch import ChunkRows, RowMasks
from kvarn.layout import KVLayout
from kvarn.slots import SlotStore
from tests.kvarn.test_models import build

G = 64
LAYOUTS = {"fp16": KVLayout.fp16(), "affine-4": KVLayout.affine(4, 64), "kvarn-k4v2": KVLayout.kvarn("k4v2", tile_size=G)}
# tokens before the chunk, and the chunk: empty rows, a row one token short of a tile, rows with
# records; chunks that stay in the window, fill a tile exactly, cross one and several boundaries
HISTORY = (0, 63, 130, 300, 0)
CHUNKS = (5, 65, 126, 200, 64)
ATTEND = make_dispatch(base.scaled_dot_product_attention)


def kv(rng: np.random.Generator, rows: int, n: int, H: int, D: int) -> tuple[mx.array, mx.array]:
    shape = (rows, H, n, D)
    return (mx.array(rng.standard_normal(shape).astype(np.float32)),
            mx.array((rng.standard_normal(shape) * 0.5).astype(np.float32)))


def pad(x: mx.array, T: int) -> mx.array:
    return mx.pad(x, [(0, 0), (0, 0), (0, T - x.shape[2]), (0, 0)]) if x.shape[2] < T else x


def stores(layout: KVLayout):
    model = build("llama")  # 1 KV head, head_dim 64, 2 layers
    install_attention_seam(model)
    return model, RowStore(model, layout), RowStore(model, layout)


def layer_bytes(store: RowStore, rows: list[list], l: int) -> list[bytes]:
    """What layer ``l`` of the rows holds, as bytes: the pool's arrays (block ids are taken in the
    same order either way), else each row's slot contents up to its offset."""
    if store.pool is not None:
        arrays = rows[0][l].state
    else:
        arrays = [a for _, a in tree_flatten([row[l].fetch() for row in rows])]
    mx.eval(arrays)
    return [np.array(a).tobytes() for a in arrays]


@pytest.mark.parametrize("arm", list(LAYOUTS))
def test_a_chunk_batch_writes_and_attends_each_row_exactly_as_alone(arm):
    """Ragged chunks over ragged histories, right-padded to the longest: every row's outputs at
    its own positions are byte-identical to its chunk run alone, its padding outputs are zero,
    and the rows hold the same bytes afterwards (the padding was never written)."""
    rng = np.random.default_rng(3)
    model, alone_store, batch_store = stores(LAYOUTS[arm])
    H, D, n_q = 1, 64, 4
    alone = [alone_store.new_row(1024) for _ in HISTORY]
    batched = [batch_store.new_row(1024) for _ in HISTORY]
    l = 0
    for a, b, n in zip(alone, batched, HISTORY):  # the same history in both, written alone
        if n:
            k, v = kv(rng, 1, n, H, D)
            a[l].update_and_fetch(k, v)
            b[l].update_and_fetch(k, v)
            mx.eval(a[l].state, b[l].state)
    T = max(CHUNKS)
    keys = [kv(rng, 1, n, H, D) for n in CHUNKS]
    queries = [mx.array(rng.standard_normal((1, n_q, n, D)).astype(np.float32)) for n in CHUNKS]
    scale = D ** -0.5
    q_all = mx.concatenate([pad(q, T) for q in queries])
    mx.eval(q_all)  # before the runs alone: mlx-lm's quantized attention scales its queries in place
    want = []
    for row, (k, v), q, n in zip(alone, keys, queries, CHUNKS):
        mask = row[l].make_mask(n)
        got_k, got_v = row[l].update_and_fetch(k, v)
        out = ATTEND(q, got_k, got_v, row[l], scale, mask)
        mx.eval(out, row[l].state)
        want.append(np.array(out))
    chunk = ChunkRows([row[l] for row in batched], CHUNKS)
    assert np.array_equal(np.array(chunk.offset), HISTORY)
    mask = chunk.make_mask(T)
    assert isinstance(mask, RowMasks) and len(mask.masks) == len(CHUNKS)
    k_all = mx.concatenate([pad(k, T) for k, _ in keys])
    v_all = mx.concatenate([pad(v, T) for _, v in keys])
    got_k, got_v = chunk.update_and_fetch(k_all, v_all)
    out = np.array(ATTEND(q_all, got_k, got_v, chunk, scale, mask))
    assert out.shape == (len(CHUNKS), n_q, T, D)
    for b, n in enumerate(CHUNKS):
        assert out[b, :, :n].tobytes() == want[b].tobytes(), f"row {b}"
        assert not out[b, :, n:].any()
    assert [row[l].offset for row in batched] == [h + n for h, n in zip(HISTORY, CHUNKS)]
    assert layer_bytes(batch_store, batched, l) == layer_bytes(alone_store, alone, l)


def test_chunk_batch_rejects_what_does_not_fit():
    _, store, _ = stores(LAYOUTS["fp16"])
    rows = [store.new_row(64)[0] for _ in range(2)]
    with pytest.raises(ValueError):
        ChunkRows(rows, [3])
    with pytest.raises(ValueError):
        ChunkRows(rows, [3, 0])
    chunk = ChunkRows(rows, [3, 5])
    with pytest.raises(ValueError):
        chunk.make_mask(4)
    k = mx.zeros((2, 1, 4, 64))
    with pytest.raises(ValueError):
        chunk.update_and_fetch(k, k)


def test_chunk_batch_writes_shared_slots_in_place():
    """Four rows' chunks into one slot buffer of 16 MiB: no write copies the buffer (each row is
    read back after every row wrote, so no view of a buffer is alive across a write). A copy
    costs a whole buffer; the rows read back cost a fraction of one (on MLX's CPU under an
    eighth, on its CUDA backend, which makes the sliced views contiguous, a quarter)."""
    rng = np.random.default_rng(5)
    store = SlotStore(slots=4)
    rows = [store.new_row(8192) for _ in range(4)]
    for row, n in zip(rows, (100, 3000, 50, 700)):
        row.update_and_fetch(*kv(rng, 1, n, 2, 128))
    mx.eval(store._buffers)
    buffer = store.nbytes // 2
    lengths = [40, 128, 7, 90]
    k, v = kv(rng, 4, 128, 2, 128)
    mx.eval(k, v)
    mx.reset_peak_memory()
    start = mx.get_active_memory()
    chunk = ChunkRows(rows, lengths)
    chunk.update_and_fetch(k, v)
    mx.eval([a.sum() for pair in chunk.fetched for a in pair])
    assert mx.get_peak_memory() - start < buffer / 2
    assert [row.offset for row in rows] == [140, 3128, 57, 790]


@pytest.mark.parametrize("arch,arm", [("llama", "kvarn-k4v2"), ("llama", "fp16"), ("qwen3", "affine-4"),
                                      ("gemma3_text", "kvarn-k4v2"), ("gemma3_text", "fp16")])
def test_a_batched_prompt_chunk_gives_each_row_its_logits_alone(arch, arm):
    """Through a model: rows with histories take ragged chunks in one [B, T] forward; each row's
    logits at its last token match its chunk run alone (the batched matmuls sum in another
    order: float32 noise), and the next decode step of each row agrees too."""
    model = build(arch)
    install_attention_seam(model)
    rng = np.random.default_rng(11)
    layout = LAYOUTS[arm]
    first = [0, 70, 10, 130]
    chunks = [50, 61, 9, 128]
    prompts = [rng.integers(1, 512, f + n).tolist() for f, n in zip(first, chunks)]
    results = []
    for batched in (False, True):
        store = RowStore(model, layout)
        rows = [store.new_row(512) for _ in prompts]
        for row, prompt, f in zip(rows, prompts, first):
            if f:
                mx.eval(model(mx.array([prompt[:f]], dtype=mx.int32), cache=row))
        if batched:
            T = max(chunks)
            tokens = mx.array([p[f:] + [0] * (T - n) for p, f, n in zip(prompts, first, chunks)], dtype=mx.int32)
            cache = [ChunkRows([row[l] for row in rows], chunks) for l in range(len(rows[0]))]
            out = model(tokens, cache=cache)
            logits = out[mx.arange(len(rows)), mx.array([n - 1 for n in chunks])]
        else:
            logits = mx.concatenate([model(mx.array([p[f:]], dtype=mx.int32), cache=row)[:, -1]
                                     for row, p, f in zip(rows, prompts, first)])
        mx.eval(logits)
        nxt = mx.argmax(logits, axis=-1)
        step = mx.concatenate([model(nxt[b].reshape(1, 1).astype(mx.int32), cache=row)[:, -1]
                               for b, row in enumerate(rows)])
        results.append((np.array(logits), np.array(step)))
        assert [row[0].offset for row in rows] == [f + n + 1 for f, n in zip(first, chunks)]
    (want, want_step), (got, got_step) = results
    # quantized rows amplify float noise at rounding boundaries; MLX's CUDA backend runs float32
    # matmuls as TF32 (a 10-bit mantissa), so there the differently summed products differ ~10x more
    fp16_atol = 1e-3 if mx.default_device() == mx.cpu else 1e-2
    atol = fp16_atol if arm == "fp16" else 0.05
    np.testing.assert_allclose(got, want, rtol=0, atol=atol)
    np.testing.assert_allclose(got_step, want_step, rtol=0, atol=atol)
    assert np.array_equal(np.argmax(got, -1), np.argmax(want, -1))
