"""KVarNKVCache mechanics (kvarn/cache.py): chunking invariance, exact bytes, state round trips,
trim. Every comparison of cache contents here is exact (bytes), never a tolerance."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from kvarn.attention import decode_attention
from kvarn.cache import KVarNKVCache
from kvarn.layout import FORMAT_VERSION, KVLayout
from kvarn.record import RecordArrays

FIELDS = tuple(f.name for f in dataclasses.fields(RecordArrays))
H, D = 2, 128


def tokens(seed: int, n: int, b: int = 1, h: int = H, d: int = D) -> tuple[np.ndarray, np.ndarray]:
    """Raw (unrotated) keys and values [b, h, n, d] with outlier channels and token scales."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((b, h, n, d)).astype(np.float32)
    k[..., : d // 16] *= 8.0
    k *= np.exp(rng.normal(0, 0.5, (b, h, n, 1))).astype(np.float32)
    v = rng.standard_normal((b, h, n, d)).astype(np.float32)
    return k, v


def feed(cache: KVarNKVCache, k: np.ndarray, v: np.ndarray, chunk: int | None = None,
         start: int = 0, stop: int | None = None) -> KVarNKVCache:
    """Feed tokens [start, stop) in chunks of ``chunk`` (None: all at once)."""
    stop = k.shape[2] if stop is None else stop
    step = (stop - start) if chunk is None else chunk
    for i in range(start, stop, max(step, 1)):
        j = min(i + step, stop)
        cache.update_and_fetch(mx.array(k[:, :, i:j]), mx.array(v[:, :, i:j]))
    mx.eval([a for a in cache.state])
    return cache


def contents(cache: KVarNKVCache) -> dict[str, np.ndarray]:
    """Everything a cache holds that attention reads: valid sink and tail, committed records."""
    out = {"sink_k": np.array(cache.sink_k[..., : cache.sink_len, :]),
           "sink_v": np.array(cache.sink_v[..., : cache.sink_len, :]),
           "tail_k": np.array(cache.tail_k[..., : cache.tail_len, :]),
           "tail_v": np.array(cache.tail_v[..., : cache.tail_len, :])}
    view = cache.records.view()
    for name in FIELDS:
        out[name] = None if view is None else np.array(getattr(view, name))
    return out


def assert_same_cache(a: KVarNKVCache, b: KVarNKVCache) -> None:
    assert (a.offset, a.tail_len, a.sink_len, a.records.num_tiles) == (b.offset, b.tail_len, b.sink_len,
                                                                       b.records.num_tiles)
    assert a.layout == b.layout
    assert a.nbytes == b.nbytes
    ca, cb = contents(a), contents(b)
    for name in ca:
        if ca[name] is None or cb[name] is None:
            assert ca[name] is None and cb[name] is None, name
            continue
        assert ca[name].dtype == cb[name].dtype and ca[name].shape == cb[name].shape, name
        assert np.array_equal(ca[name], cb[name]), name


def lengths(g: int) -> list[int]:
    return [g - 1, g, g + 1, 2 * g - 1, 2 * g, 2 * g + 1, 5 * g + 3]


def expected_counts(n: int, g: int) -> tuple[int, int, int]:
    """(sink_len, num_tiles, tail_len) of a sequence of n tokens."""
    if n <= g:
        return n, 0, 0
    return g, (n - g) // g, (n - g) % g


# --------------------------------------------------------------------------------------------
# chunking invariance and bytes
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("g", [64, 128])
def test_chunking_gives_byte_identical_records(g):
    layout = KVLayout.kvarn("k4v2", tile_size=g)
    k, v = tokens(g, 5 * g + 3)
    for n in lengths(g):
        whole = feed(KVarNKVCache(layout), k, v, None, stop=n)
        sink_len, num_tiles, tail_len = expected_counts(n, g)
        assert (whole.offset, whole.sink_len, whole.records.num_tiles, whole.tail_len) == (
            n, sink_len, num_tiles, tail_len)
        assert whole.size() == n and not whole.empty()
        for chunk in (1, 7, 100, 300):
            assert_same_cache(whole, feed(KVarNKVCache(layout), k, v, chunk, stop=n))
        # nbytes is exactly what capacity pricing charges
        assert whole.nbytes == layout.sequence_bytes(n, D, H), n
        # the stored sink/tail are the rotated inputs rounded to fp16
        rot = np.array(mx.hadamard_transform(mx.array(k[:, :, :n])).astype(mx.float16))
        np.testing.assert_array_equal(contents(whole)["sink_k"], rot[:, :, :sink_len])
        np.testing.assert_array_equal(contents(whole)["tail_k"], rot[:, :, n - tail_len: n])


@settings(max_examples=15, deadline=None, derandomize=True)
@given(chunks=st.lists(st.integers(1, 150), min_size=1, max_size=12), g=st.sampled_from([64, 128]),
       preset=st.sampled_from(["k4v2", "k3v3", "k8v8"]))
def test_random_chunkings_give_byte_identical_records(chunks, g, preset):
    layout = KVLayout.kvarn(preset, tile_size=g)
    n = sum(chunks)
    k, v = tokens(n, n, d=64)
    whole = feed(KVarNKVCache(layout), k, v)
    pieces = KVarNKVCache(layout)
    i = 0
    for c in chunks:
        pieces.update_and_fetch(mx.array(k[:, :, i:i + c]), mx.array(v[:, :, i:i + c]))
        i += c
    assert_same_cache(whole, pieces)
    assert pieces.nbytes == layout.sequence_bytes(n, 64, H)


@pytest.mark.parametrize("g", [64, 128])
def test_batched_rows_equal_single_rows_and_bytes_scale_with_rows(g):
    """Section 5: a record is byte-identical whichever batch produced it."""
    layout = KVLayout.kvarn("k4v2", tile_size=g)
    b = 3
    n = 3 * g + 17
    k, v = tokens(7, 5 * g + 3, b=b)
    for m in lengths(g):
        assert feed(KVarNKVCache(layout), k, v, None, stop=m).nbytes == b * layout.sequence_bytes(m, D, H), m
    batch = feed(KVarNKVCache(layout), k, v, 50, stop=n)
    assert batch.nbytes == b * layout.sequence_bytes(n, D, H)
    cb = contents(batch)
    for row in range(b):
        one = feed(KVarNKVCache(layout), k[row:row + 1], v[row:row + 1], None, stop=n)
        assert one.nbytes == layout.sequence_bytes(n, D, H)
        for name, arr in contents(one).items():
            assert np.array_equal(cb[name][row:row + 1], arr), (row, name)


@pytest.mark.parametrize("d", [64, 256, 512])
def test_nbytes_equals_sequence_bytes_for_every_head_dim(d):
    layout = KVLayout.kvarn("k3v3", tile_size=64)
    k, v = tokens(d, 3 * 64 + 5, d=d)
    cache = KVarNKVCache(layout)
    assert cache.nbytes == 0 == layout.sequence_bytes(0, d, H)
    for stop in (1, 64, 128, 3 * 64 + 5):
        feed(cache, k, v, None, start=cache.offset, stop=stop)
        assert cache.nbytes == layout.sequence_bytes(stop, d, H), stop


def test_rejects_non_kvarn_layouts():
    with pytest.raises(ValueError, match="kvarn layout"):
        KVarNKVCache(KVLayout.fp16())
    with pytest.raises(ValueError, match="kvarn layout"):
        KVarNKVCache(KVLayout.affine(4))


# --------------------------------------------------------------------------------------------
# state round trips
# --------------------------------------------------------------------------------------------

def copied_state(cache: KVarNKVCache) -> list[mx.array]:
    """The state as it comes back from memory or disk: fresh arrays with the same bytes."""
    return [mx.array(np.array(a)) for a in cache.state]


@pytest.mark.parametrize("n", [0, 37, 64, 100, 128, 129, 5 * 64 + 3])
def test_state_round_trip_is_bit_exact(n):
    layout = KVLayout.kvarn("k4v2", tile_size=64)
    k, v = tokens(n, max(n, 1))
    cache = feed(KVarNKVCache(layout), k, v, 33, stop=n) if n else KVarNKVCache(layout)
    state, meta = cache.state, cache.meta_state
    assert meta == ("4", "2", "64", "8", str(FORMAT_VERSION), "float16", str(n), str(cache.tail_len))
    assert len(state) == (0 if n == 0 else 4 if n < 128 else 4 + len(FIELDS))
    restored = KVarNKVCache.from_state(copied_state(cache), meta)
    assert restored.meta_state == meta
    assert restored.chunk is None
    assert len(restored.state) == len(state)
    for a, b in zip(state, restored.state):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert np.array_equal(np.array(a), np.array(b))
    assert restored.nbytes == cache.nbytes == layout.sequence_bytes(n, D, H)
    if n:
        assert_same_cache(cache, restored)
    else:
        assert restored.sink_k is None and restored.offset == 0 and restored.empty()


@pytest.mark.parametrize("g", [64, 128])
def test_restored_cache_continues_identically(g):
    """Round trip mid-tail, then keep writing across tile boundaries and decoding: records, sink,
    tail and attention outputs equal the uninterrupted cache's, bit for bit."""
    layout = KVLayout.kvarn("k4v2", tile_size=g)
    k, v = tokens(g + 1, 4 * g + 9)
    q = mx.array(np.random.default_rng(0).standard_normal((1, 2 * H, 1, D)).astype(np.float32))
    for cut in (g // 2, g + 5, 2 * g):
        live = feed(KVarNKVCache(layout), k, v, None, stop=cut)
        restored = KVarNKVCache.from_state(copied_state(live), live.meta_state)
        for start in range(cut, 4 * g + 9, 23):
            stop = min(start + 23, 4 * g + 9)
            feed(live, k, v, None, start=start, stop=stop)
            feed(restored, k, v, None, start=start, stop=stop)
            assert_same_cache(live, restored)
            a = np.array(decode_attention(q, live, D ** -0.5))
            b = np.array(decode_attention(q, restored, D ** -0.5))
            assert np.array_equal(a, b)


ALIASING = ("BUG: KVarNKVCache.state returns the live sink/tail buffers and the state setter adopts the "
            "given arrays, while update_and_fetch writes into those buffers in place (a[...] = x mutates "
            "the shared Python object)")


def test_state_snapshot_is_not_changed_by_the_live_cache():
    g = 64
    layout = KVLayout.kvarn("k4v2", tile_size=g)
    k, v = tokens(1, 3 * g)
    cut = g + 30  # 30 tokens in the tail
    live = feed(KVarNKVCache(layout), k, v, None, stop=cut)
    snapshot, meta = live.state, live.meta_state
    # 84 more tokens: one record committed, the tail rewritten from position 0 with 50 tokens
    feed(live, k, v, None, start=cut, stop=2 * g + 50)
    assert live.records.num_tiles == 1 and live.tail_len == 50
    assert_same_cache(KVarNKVCache.from_state(snapshot, meta), feed(KVarNKVCache(layout), k, v, None, stop=cut))


def test_caches_forked_from_one_state_are_independent():
    g = 64
    layout = KVLayout.kvarn("k4v2", tile_size=g)
    k, v = tokens(1, 3 * g)
    k2, v2 = tokens(2, 3 * g)
    for cut in (40, g + 30):  # a partial sink, a partial tail
        live = feed(KVarNKVCache(layout), k, v, None, stop=cut)
        fork_a = KVarNKVCache.from_state(live.state, live.meta_state)
        fork_b = KVarNKVCache.from_state(live.state, live.meta_state)
        feed(fork_a, k, v, None, start=cut, stop=cut + 10)
        feed(fork_b, k2, v2, None, start=cut, stop=cut + 10)  # a different continuation
        assert_same_cache(fork_a, feed(KVarNKVCache(layout), k, v, None, stop=cut + 10))


def test_from_state_restores_layout_from_meta_state():
    layout = KVLayout.kvarn("k3v3", tile_size=128)
    k, v = tokens(3, 300, d=256)
    cache = feed(KVarNKVCache(layout), k, v)
    restored = KVarNKVCache.from_state(copied_state(cache), cache.meta_state)
    assert restored.layout == layout
    assert (restored.layout.key_bits, restored.layout.value_bits, restored.layout.tile_size) == (3, 3, 128)
    assert restored.records.layout == layout
    assert_same_cache(cache, restored)


@pytest.mark.xfail(strict=True, raises=KeyError, reason=(
    "mlx-lm 0.32.2's save_prompt_cache stores only `state` (no meta_state: offset, tail_len and "
    "the layout are lost) and load_prompt_cache rebuilds classes by name from mlx_lm.models.cache "
    "globals via cls.from_state(state): KeyError 'KVarNKVCache'"))
def test_mlx_lm_prompt_cache_file_round_trip(tmp_path):
    layout = KVLayout.kvarn("k4v2", tile_size=64)
    k, v = tokens(4, 200)
    cache = feed(KVarNKVCache(layout), k, v)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, [cache])
    (restored,) = load_prompt_cache(path)
    assert_same_cache(cache, restored)


# --------------------------------------------------------------------------------------------
# trim
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("g", [64, 128])
def test_trim_removes_only_tail_tokens(g):
    layout = KVLayout.kvarn("k4v2", tile_size=g)
    k, v = tokens(g + 2, 3 * g)
    assert KVarNKVCache(layout).is_trimmable()
    # inside the sink: nothing is removable
    for n in (1, g // 2, g):
        cache = feed(KVarNKVCache(layout), k, v, stop=n)
        assert cache.trim(1) == 0 and cache.trim(5) == 0
        assert (cache.offset, cache.sink_len, cache.tail_len) == (n, n, 0)
    # within the tail
    cache = feed(KVarNKVCache(layout), k, v, stop=g + 20)
    assert cache.trim(5) == 5
    assert (cache.offset, cache.tail_len, cache.records.num_tiles) == (g + 15, 15, 0)
    # past the sink boundary: only the tail goes
    assert cache.trim(100) == 15
    assert (cache.offset, cache.tail_len, cache.sink_len) == (g, 0, g)
    assert cache.trim(1) == 0
    # past a committed record boundary: only what is in the tail
    cache = feed(KVarNKVCache(layout), k, v, stop=2 * g + 7)
    before = contents(cache)
    assert cache.records.num_tiles == 1 and cache.tail_len == 7
    assert cache.trim(g) == 7
    assert (cache.offset, cache.tail_len, cache.records.num_tiles) == (2 * g, 0, 1)
    assert cache.trim(3) == 0 and cache.offset == 2 * g
    after = contents(cache)
    for name in ("sink_k", "sink_v", *FIELDS):
        assert np.array_equal(before[name], after[name]), name
    assert cache.nbytes == layout.sequence_bytes(2 * g, D, H)


@pytest.mark.parametrize("g", [64, 128])
@pytest.mark.parametrize("kept,extra", [(20, 9), (5, 0), (0, 30)])
def test_decoding_after_trim_equals_never_seeing_the_tokens(g, kept, extra):
    """Tokens written then trimmed leave no trace: the cache equals one that never saw them, and
    stays equal (records byte-identical) as decoding continues across tile boundaries."""
    layout = KVLayout.kvarn("k4v2", tile_size=g)
    base = g + kept  # tokens kept
    k, v = tokens(kept + extra, base + 2 * g + 5)
    junk_k, junk_v = tokens(999, extra + 1)
    trimmed = feed(KVarNKVCache(layout), k, v, None, stop=base)
    if extra:
        trimmed.update_and_fetch(mx.array(junk_k[:, :, :extra]), mx.array(junk_v[:, :, :extra]))
    assert trimmed.trim(extra) == extra
    clean = feed(KVarNKVCache(layout), k, v, None, stop=base)
    assert_same_cache(trimmed, clean)
    q = mx.array(np.random.default_rng(1).standard_normal((1, H, 1, D)).astype(np.float32))
    for i in range(base, base + 2 * g + 5):  # one token at a time, as decoding
        for cache in (trimmed, clean):
            cache.update_and_fetch(mx.array(k[:, :, i:i + 1]), mx.array(v[:, :, i:i + 1]))
        if i % 17 == 0 or i == base + 2 * g + 4:
            assert_same_cache(trimmed, clean)
            assert np.array_equal(np.array(decode_attention(q, trimmed, D ** -0.5)),
                                  np.array(decode_attention(q, clean, D ** -0.5)))
    assert trimmed.records.num_tiles == (base + 2 * g + 5 - g) // g


def test_mask_protocol():
    layout = KVLayout.kvarn("k4v2", tile_size=64)
    cache = KVarNKVCache(layout)
    assert cache.make_mask(5) == "causal" and cache.make_mask(1) is None
    k, v = tokens(0, 70)
    feed(cache, k, v)
    m = np.array(cache.make_mask(3, return_array=True))
    assert m.shape == (3, 73)
    np.testing.assert_array_equal(m, np.arange(73)[None, :] <= (70 + np.arange(3))[:, None])
    w = np.array(cache.make_mask(3, window_size=8))
    np.testing.assert_array_equal(w.sum(-1), [8, 8, 8])


def test_meta_state_keeps_the_storage_dtype_and_so_the_stamp():
    layout = KVLayout.kvarn("k4v2").with_storage_dtype("float32")
    k, v = tokens(200, 200)
    cache = feed(KVarNKVCache(layout), k, v, 50, stop=200)
    restored = KVarNKVCache.from_state(copied_state(cache), cache.meta_state)
    assert restored.layout == layout
    assert restored.layout.stamp("0123456789abcdef") == layout.stamp("0123456789abcdef")
