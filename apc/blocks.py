"""Cached payloads (a kind, MLX arrays and a short text of metadata) to and from the disk tier's
parts. Runs on the engine thread (it reads and makes MLX arrays); the bytes it makes are what the
writer thread writes."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from apc.disk_tier import Part

_BFLOAT16 = "bfloat16"  # NumPy has no bfloat16: stored as its 16-bit patterns


@dataclass(frozen=True)
class Payload:
    """What the prefix cache keeps for one block or snapshot. ``arrays`` are owned by the payload
    (never views of a live row's buffers, which they would keep alive), so ``nbytes`` is exactly
    what keeping it costs. ``meta``: anything needed to rebuild it (JSON text, may be empty)."""

    kind: str
    arrays: tuple[mx.array, ...]
    meta: str = ""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays) + len(self.meta)


def to_parts(kind: str, arrays: Sequence[mx.array], meta: str = "") -> list[Part]:
    """Little-endian bytes of each array, then the meta text (if any) as a last part."""
    parts = []
    for i, a in enumerate(arrays):
        if a.dtype == mx.bfloat16:
            host = np.ascontiguousarray(np.array(a.view(mx.uint16))).astype("<u2", copy=False)
            parts.append(Part(f"{kind}.{i}", _BFLOAT16, tuple(host.shape), host.tobytes()))
            continue
        host = np.ascontiguousarray(np.array(a))
        host = host.astype(host.dtype.newbyteorder("<"), copy=False)
        parts.append(Part(f"{kind}.{i}", host.dtype.str, tuple(host.shape), host.tobytes()))
    if meta:
        data = meta.encode()
        parts.append(Part(f"{kind}.meta", "|u1", (len(data),), data))
    return parts


def from_parts(parts: Sequence[Part]) -> tuple[str, tuple[mx.array, ...]]:
    """(kind, arrays) of a block's parts (the meta part, if any, is left out: see ``payload_from_parts``)."""
    payload = payload_from_parts(parts)
    return payload.kind, payload.arrays


def payload_from_parts(parts: Sequence[Part]) -> Payload:
    kind, host, meta = host_arrays(parts)
    arrays = [mx.array(a).view(mx.bfloat16) if bf16 else mx.array(a) for a, bf16 in host]
    return Payload(kind, tuple(arrays), meta)


def host_arrays(parts: Sequence[Part]) -> tuple[str, list[tuple[np.ndarray, bool]], str]:
    """(kind, [(NumPy array, whether its 16-bit patterns are bfloat16)], meta) of a block's parts,
    without making MLX arrays (a caller that stacks many blocks makes one array per field)."""
    kind = parts[0].name.split(".", 1)[0]
    arrays, meta = [], ""
    for p in parts:
        if p.name.endswith(".meta"):
            meta = bytes(p.data).decode()
        elif p.dtype == _BFLOAT16:
            arrays.append((np.frombuffer(p.data, dtype="<u2").reshape(p.shape), True))
        else:
            arrays.append((np.frombuffer(p.data, dtype=_np_dtype(p.dtype)).reshape(p.shape), False))
    return kind, arrays, meta


@functools.lru_cache(maxsize=None)
def _np_dtype(name: str) -> np.dtype:
    return np.dtype(name)


def payload_to_parts(payload: Payload) -> list[Part]:
    return to_parts(payload.kind, payload.arrays, payload.meta)
