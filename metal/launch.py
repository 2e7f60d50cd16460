"""What every launch builder shares, CUDA or Metal: the kernel text as it is compiled, and the small
constant inputs made once per value (not one array from host data per layer of every step)."""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx


def minify(source: str) -> str:
    """The kernel text without comments, indentation and blank lines (MLX rebuilds and hashes the
    kernel's whole text on every call: the per-call host cost grows with its length)."""
    lines = []
    for line in source.splitlines():
        line = line.split("//", 1)[0].strip()
        if line:
            lines.append(line)
    return "\n".join(lines) + "\n"


@lru_cache(maxsize=256)
def scalar_inputs(count: int, scale: float) -> tuple[mx.array, mx.array]:
    """A decode kernel's two scalar inputs: an int (the table width of the paged decode, T_cap of
    the ragged one) and the softmax scale."""
    return mx.array([count], dtype=mx.int32), mx.array([scale], dtype=mx.float32)


@lru_cache(maxsize=1)
def no_slots() -> mx.array:
    """The ``slots`` input of a commit over tiles given as such (the kernel does not read it)."""
    return mx.zeros((1,), dtype=mx.int32)
