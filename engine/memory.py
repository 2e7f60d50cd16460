"""Giving freed memory back to the operating system.

Two places keep freed memory for reuse, so a process's RSS stays at its high-water mark after a
burst of work: MLX's buffer cache (every intermediate of every shape a step ever ran), and
glibc's malloc, whose per-thread arenas keep what a tokenizer or a JSON parser freed.
``release_memory`` empties both, on the engine thread, once the engine has gone idle (after the
block pool's arrays shrank: ``Engine.release_idle_memory``); ``trim_host_memory`` is the malloc
half alone, safe on any thread.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from functools import cache
from typing import Any

logger = logging.getLogger(__name__)


@cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None (macOS, musl: their allocators return memory themselves)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim_host_memory() -> None:
    """Hand the free pages of every malloc arena back to the OS (a no-op where there is no glibc)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def release_memory() -> None:
    """MLX's cached buffers, then malloc's free pages, back to the OS. Engine thread only (MLX)."""
    import mlx.core as mx

    mx.clear_cache()
    trim_host_memory()


CPU_BUFFER_CACHE_BYTES = 1 << 30


def keep_cpu_buffers() -> None:
    """On MLX's CPU backend, keep up to 1 GiB of freed buffers for reuse (MLX's CPU default is
    32 MiB, less than one prompt chunk's attention intermediates: every chunk then handed its
    buffers back to malloc and faulted fresh pages in, a quarter of a 3,000-token KVarN prefill's
    time). GPUs keep MLX's own limit; ``release_memory`` still empties the cache when idle."""
    import mlx.core as mx

    if mx.default_device() == mx.cpu:
        previous = mx.set_cache_limit(CPU_BUFFER_CACHE_BYTES)
        if previous > CPU_BUFFER_CACHE_BYTES:
            mx.set_cache_limit(previous)


def mlx_memory() -> dict[str, int]:
    """MLX's allocator counters in bytes: arrays alive (``mlx_active_bytes``), freed buffers kept
    for reuse (``mlx_cache_bytes``), the highest active since start (``mlx_peak_bytes``)."""
    import mlx.core as mx

    return {"mlx_active_bytes": mx.get_active_memory(), "mlx_cache_bytes": mx.get_cache_memory(),
            "mlx_peak_bytes": mx.get_peak_memory()}
