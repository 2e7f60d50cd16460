"""Block payloads (a kind and a tuple of MLX arrays, e.g. ``kvarn.cache.Block``'s) to and from the
disk tier's parts. Runs on the engine thread (it reads and makes MLX arrays); the bytes it makes are
what the writer thread writes."""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from apc.disk_tier import Part


def to_parts(kind: str, arrays: Sequence[mx.array]) -> list[Part]:
    """Little-endian bytes of each array (float16, float32 and uint32 map to NumPy as they are)."""
    parts = []
    for i, a in enumerate(arrays):
        host = np.ascontiguousarray(np.array(a))
        host = host.astype(host.dtype.newbyteorder("<"), copy=False)
        parts.append(Part(f"{kind}.{i}", host.dtype.str, tuple(host.shape), host.tobytes()))
    return parts


def from_parts(parts: Sequence[Part]) -> tuple[str, tuple[mx.array, ...]]:
    kind = parts[0].name.split(".", 1)[0]
    return kind, tuple(mx.array(np.frombuffer(p.data, dtype=np.dtype(p.dtype)).reshape(p.shape)) for p in parts)
