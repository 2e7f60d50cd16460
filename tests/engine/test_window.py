"""``--max-kv-size`` through the real engine on the bundled model (context 4,096): fp16 greedy
tokens equal to mlx-lm's own ``generate_step(..., max_kv_size=N)``, KVarN rows that hold flat
bytes generating 3x past the window, windowed rows batched as alone, ``n > 1`` forks, pricing at
the window, and a prefix cache that never serves across windows."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from engine.engine import make_engine
from engine.kv_config import ApcConfig, KVConfig
from engine.request import FinishReason, Request, RequestId, SamplingParams
from engine.scheduler import SchedulerConfig
from tests.engine.test_batching import NEAR_TIE, run

WINDOW = 256  # two KVarN tiles: the smallest KVarN window, and mlx-lm's rotating cache of 256
NO_APC = ApcConfig(enabled=False)
CONFIG = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=320, prefill_chunk_size=256)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def drain(engine, check=None) -> None:
    while engine.has_work():
        engine.step()
        assert engine.runner.kv_nbytes() <= engine.scheduler.reserved_bytes
        if check is not None:
            check()


def test_fp16_window_greedy_tokens_equal_mlx_lms_generate_with_max_kv_size(loaded):
    prompt = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3, add_special_tokens=False)
    gen = 3 * WINDOW
    want = [int(t) for t, _ in generate_step(mx.array(prompt), loaded.model, max_tokens=gen, max_kv_size=WINDOW)]
    engine = make_engine(loaded, CONFIG, KVConfig("fp16", max_kv_size=WINDOW), NO_APC)
    request = Request(RequestId("w"), list(prompt), greedy(gen))
    engine.add_request(request)
    held = []
    drain(engine, lambda: held.append(engine.runner.kv_nbytes()) if not request.is_finished else None)
    assert request.output_ids == want
    flat = engine.pricing.sequence_bytes(WINDOW)  # min(T, N) tokens: 256 x 2 x 2 heads x 128 x 4 B x 8 layers
    assert flat == WINDOW * 2 * 2 * 128 * 4 * 8
    assert held[0] < flat and set(held[1:]) == {flat}  # after the prompt; from the first decode step on: flat
    assert engine.describe_kv()["max_kv_size"] == WINDOW


def test_kvarn_window_holds_flat_bytes_generating_3x_past_it(loaded):
    """A prompt longer than the window (its chunks attend window by window), then 3x the window
    generated: the row never holds more than the window's blocks, the pool's arrays stop
    growing, and what it holds is within its price at the window (exactly at its peak)."""
    engine = make_engine(loaded, CONFIG, KVConfig("kvarn", 4, 2, max_kv_size=WINDOW), NO_APC)
    pool = engine.runner.store.pool
    rng = np.random.default_rng(3)
    request = Request(RequestId("k"), rng.integers(16, 8000, 300).tolist(), greedy(3 * WINDOW))
    engine.add_request(request)
    held, arrays = [], []
    drain(engine, lambda: None if request.is_finished else (held.append(engine.runner.kv_nbytes()),
                                                             arrays.append(pool.nbytes())))
    price = engine.pricing.sequence_bytes(300 + 3 * WINDOW)
    assert price == engine.pricing.sequence_bytes(WINDOW) == pool.window_bytes() + pool.block_bytes()
    assert max(held) == price and set(held) == {price, pool.window_bytes()}  # 0 or 1 record: N = 2G
    assert len(set(arrays[1:])) == 1
    assert request.finish_reason is FinishReason.LENGTH and len(request.output_ids) == 3 * WINDOW
    assert pool.records.num_held == 0 and engine.scheduler.reserved_bytes == 0


# kvarn under MLX's reference BLAS (tests/openblas_plugin.py: OpenBLAS rounds a row alone and in a
# batch differently, and a 2-bit code within that noise flips: 0.064 against 0.05 measured here)
@pytest.mark.parametrize("scheme", ["fp16", pytest.param("kvarn", marks=pytest.mark.reference_blas)])
def test_windowed_rows_in_a_batch_match_their_runs_alone(loaded, scheme, monkeypatch):
    """Ragged rows, some prompts past the window, staggered arrivals, every row past it by the
    end: batched logits equal each row alone (float tolerance; a divergence only right after a
    near-tie)."""
    arrivals = [(40, 230, 0), (300, 40, 0), (600, 30, 2), (130, 140, 5)]
    rng = np.random.default_rng(4)
    prompts = [rng.integers(16, 8000, n).tolist() for n, _, _ in arrivals]
    engine = make_engine(loaded, CONFIG, KVConfig(scheme, 4, 2, max_kv_size=WINDOW), NO_APC)
    alone = {}
    for i, (prompt, (_, m, _)) in enumerate(zip(prompts, arrivals)):
        request = Request(RequestId(f"r{i}"), prompt, greedy(m))
        logits, _ = run(engine, [request], [0], monkeypatch)
        alone[request.request_id] = (logits[request.request_id], list(request.output_ids))
    requests = [Request(RequestId(f"r{i}"), p, greedy(m)) for i, (p, (_, m, _)) in enumerate(zip(prompts, arrivals))]
    logits, widest = run(engine, requests, [a for _, _, a in arrivals], monkeypatch)
    assert widest == 4
    tolerance = 1e-4 if scheme == "fp16" else 0.05
    for request in requests:
        want_logits, want_tokens = alone[request.request_id]
        diverged = next((k for k, (a, b) in enumerate(zip(request.output_ids, want_tokens)) if a != b), None)
        for step in range(len(want_tokens) if diverged is None else diverged + 1):
            np.testing.assert_allclose(logits[request.request_id][step], want_logits[step], rtol=0, atol=tolerance)
        if diverged is not None:
            top2 = np.sort(want_logits[diverged])[-2:]
            assert top2[1] - top2[0] < NEAR_TIE, (request.request_id, diverged, top2)


@pytest.mark.parametrize("scheme", ["kvarn", "fp16", "affine"])
def test_forks_of_windowed_rows_share_the_prompt_and_run_past_the_window(loaded, scheme):
    engine = make_engine(loaded, CONFIG, KVConfig(scheme, 4, 2 if scheme == "kvarn" else 4, max_kv_size=WINDOW),
                         NO_APC)
    prompt = np.random.default_rng(5).integers(16, 8000, 280).tolist()
    gen = WINDOW + 40  # the prompt past the window, then the shared blocks all replaced by the choices' own
    single = Request(RequestId("one"), prompt, greedy(gen))
    engine.add_request(single)
    drain(engine)
    parent = Request(RequestId("p"), prompt, greedy(gen))
    forks = tuple(Request(RequestId(f"p-{i}"), prompt, greedy(gen), index=i) for i in (1, 2))
    engine.add_request(parent, forks)
    pool = engine.runner.store.pool
    peak = []
    drain(engine, lambda: peak.append(pool.records.num_held if pool is not None else 0))
    for request in (parent, *forks):
        assert request.finish_reason is FinishReason.LENGTH and len(request.output_ids) == gen
        assert request.output_ids == parent.output_ids  # the same greedy rows in one batch
    same = next((k for k, (a, b) in enumerate(zip(parent.output_ids, single.output_ids)) if a != b), None)
    assert same is None or same > 50  # batched 3 rows vs alone: float noise at most, late
    if pool is not None:
        assert max(peak) <= 3 * (WINDOW - 128) // 128 and pool.records.num_held == 0
    assert engine.runner.rows == {} and engine.scheduler.reserved_bytes == 0


@pytest.mark.parametrize("scheme", ["kvarn", "fp16"])
def test_a_windowed_request_is_priced_at_its_window(loaded, scheme):
    plain = make_engine(loaded, CONFIG, KVConfig(scheme), NO_APC)
    windowed = make_engine(loaded, CONFIG, KVConfig(scheme, max_kv_size=1024), NO_APC)
    for tokens in (100, 1024, 1500, 4096):
        assert windowed.pricing.sequence_bytes(tokens) == plain.pricing.sequence_bytes(min(tokens, 1024))
    long, short = windowed.cost_alone(200, 3000), windowed.cost_alone(200, 100)
    assert long < plain.cost_alone(200, 3000) and short == plain.cost_alone(200, 100)
    assert windowed.cost_alone(200, 3000, n=3) == 3 * windowed.pricing.sequence_bytes(1024) \
        + windowed.pricing.transient_bytes(3200)
    # a budget a full context cannot fit: refused unwindowed, admitted windowed
    budget = plain.cost_alone(100, 3000) - 1
    for kv, fits in ((KVConfig(scheme), False), (KVConfig(scheme, max_kv_size=1024), True)):
        engine = make_engine(loaded, SchedulerConfig(kv_budget_bytes=budget), kv, NO_APC)
        assert engine.scheduler.fits_alone(Request(RequestId("x"), [1] * 100, greedy(3000))) is fits


def test_the_prefix_cache_never_serves_across_windows(loaded, tmp_path):
    """Blocks a windowed row published (only those within its first N tokens: nothing was
    evicted before them) serve the same window, from memory and from disk after a restart; an
    unwindowed engine and another window on the same disk folder find nothing."""
    prompt = np.random.default_rng(6).integers(16, 8000, 700).tolist()
    disk = ApcConfig(disk_dir=str(tmp_path))

    def ask(kv: KVConfig, engine=None) -> tuple[int, object]:
        """Cached tokens of the prompt in ``engine`` (default: a fresh engine, closed after: its
        disk writes land)."""
        mine = engine or make_engine(loaded, CONFIG, kv, disk)
        request = Request(RequestId(f"q{id(request_ids)}-{len(request_ids)}"), prompt, greedy(8))
        request_ids.append(request.request_id)
        mine.add_request(request)
        drain(mine)
        if engine is None:
            mine.close()
        return request.num_cached_tokens, mine

    request_ids: list = []
    window = KVConfig("kvarn", 4, 2, max_kv_size=512)
    first = make_engine(loaded, CONFIG, window, disk)
    assert ask(window, first)[0] == 0
    pool = first.runner.store.pool
    assert len(pool.records.hash_of) == 3 and len(pool.sinks.hash_of) == 1  # blocks 0..3: 512 tokens
    assert ask(window, first)[0] == 512  # memory
    first.close()
    assert ask(window)[0] == 512  # disk, in a fresh engine
    assert ask(KVConfig("kvarn", 4, 2))[0] == 0  # unwindowed
    assert ask(KVConfig("kvarn", 4, 2, max_kv_size=1024))[0] == 0  # another window
    fp16 = KVConfig("fp16", max_kv_size=512)  # rotating rows: whole-row snapshots, salted the same way
    assert ask(fp16)[0] == 0
    assert ask(fp16)[0] == len(prompt) - 1
    assert ask(KVConfig("fp16"))[0] == 0
