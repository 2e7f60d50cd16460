"""engine/memory.py: MLX's buffer cache kept large enough on the CPU, emptied when idle."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine.memory import CPU_BUFFER_CACHE_BYTES, keep_cpu_buffers, release_memory


@pytest.fixture
def cache_limit():
    """Restores the process's cache limit after the test."""
    before = mx.set_cache_limit(CPU_BUFFER_CACHE_BYTES)
    mx.set_cache_limit(before)
    yield before
    mx.set_cache_limit(before)


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU backend's cache limit")
def test_cpu_cache_limit_is_raised_and_a_larger_one_kept(cache_limit):
    mx.set_cache_limit(32 << 20)
    keep_cpu_buffers()
    assert mx.set_cache_limit(CPU_BUFFER_CACHE_BYTES) == CPU_BUFFER_CACHE_BYTES
    mx.set_cache_limit(4 * CPU_BUFFER_CACHE_BYTES)
    keep_cpu_buffers()
    assert mx.set_cache_limit(4 * CPU_BUFFER_CACHE_BYTES) == 4 * CPU_BUFFER_CACHE_BYTES


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU backend's cache limit")
def test_freed_intermediates_stay_cached_until_release(cache_limit):
    mx.set_cache_limit(32 << 20)
    keep_cpu_buffers()
    release_memory()
    for _ in range(3):  # three 48 MiB intermediates: more than MLX's 32 MiB CPU default
        x = mx.ones((3, 1 << 22))
        y = x * 2 + 1
        mx.eval(y)
        del x, y
    assert mx.get_cache_memory() >= 48 << 20
    release_memory()
    assert mx.get_cache_memory() == 0
