"""The KV layout a user asks for, in plain values (no MLX: the server builds it from flags)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVConfig:
    """The KV layout asked for, in plain values. ``None`` key bits mean 4; ``None`` value bits
    mean 2 for kvarn (k4v2) and the key width for affine (one width for both legs). Scheme
    ``"auto"``: the layout ``kvarn advise`` recommends for the model (``engine/advise.py``),
    resolved when the model is loaded."""

    scheme: str = "kvarn"
    key_bits: int | None = None
    value_bits: int | None = None
    tile: int = 128
    group_size: int = 64
    advise_prompts: int = 2  # scheme "auto" without stored advice: what is measured at start-up
    advise_tokens: int = 384


@dataclass(frozen=True)
class ApcConfig:
    """The automatic prefix cache, in plain values. ``memory_bytes``: a cap on what the cache keeps
    in memory beside running requests (None: no cap; it keeps what running requests leave of the
    KV budget and gives it back when admission needs it: never added to the budget);
    ``disk_dir`` None: memory only."""

    enabled: bool = True
    memory_bytes: int | None = None
    disk_dir: str | None = None
    disk_bytes: int = 4 * 2**30
