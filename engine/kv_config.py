"""The KV layout a user asks for, in plain values (no MLX: the server builds it from flags)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVConfig:
    """The KV layout asked for, in plain values (``None`` bits: the scheme's default, k4v2 for
    kvarn and 4 bits for affine)."""

    scheme: str = "kvarn"
    key_bits: int | None = None
    value_bits: int | None = None
    tile: int = 128
    group_size: int = 64
