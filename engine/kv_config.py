"""The KV layout a user asks for, in plain values (no MLX: the server builds it from flags)."""

from __future__ import annotations

from dataclasses import dataclass

from apc.events import KVEventsConfig


@dataclass(frozen=True)
class KVConfig:
    """The KV layout asked for, in plain values. ``None`` key bits mean 4; ``None`` value bits
    mean 2 for kvarn (k4v2) and the key width for affine (one width for both legs). Scheme
    ``"auto"``: the layout ``kvarn advise`` recommends for the model (``engine/advise.py``),
    resolved when the model is loaded. ``max_kv_size`` (``--max-kv-size``): every row's attention
    window in tokens, for any scheme (None: unbounded; ``kvarn.layout.KVLayout.max_kv_size``)."""

    scheme: str = "kvarn"
    key_bits: int | None = None
    value_bits: int | None = None
    tile: int = 128
    group_size: int = 64
    advise_prompts: int = 2  # scheme "auto" without stored advice: what is measured at start-up
    advise_tokens: int = 384
    max_kv_size: int | None = None


@dataclass(frozen=True)
class ApcConfig:
    """The automatic prefix cache, in plain values. ``memory_bytes``: a cap on what the cache keeps
    in memory beside running requests (None: no cap; it keeps what running requests leave of the
    KV budget and gives it back when admission needs it: never added to the budget);
    ``disk_dir`` None: memory only. ``kv_events``: publish what the cache holds to routers
    (``apc.events``; None: off, no socket); it needs the cache on."""

    enabled: bool = True
    memory_bytes: int | None = None
    disk_dir: str | None = None
    disk_bytes: int = 4 * 2**30
    kv_events: KVEventsConfig | None = None

    def __post_init__(self) -> None:
        if self.kv_events is not None and not self.enabled:
            raise ValueError("KV events report the prefix cache's contents: they need the prefix cache on")


def check_window(kv: KVConfig) -> None:
    """Raise ValueError if ``kv.max_kv_size`` is below its scheme's floor (KVarN: 2 tiles; fp16
    and affine: more than the 4 tokens a rotating cache keeps), before anything loads. A scheme
    "auto" is checked once the advice has picked one (``KVLayout``)."""
    if kv.max_kv_size is None or kv.scheme == "auto":
        return
    from kvarn.layout import KVLayout

    key_bits = kv.key_bits or 4
    value_bits = kv.value_bits or (key_bits if kv.scheme == "affine" else 2)
    KVLayout(scheme=kv.scheme, key_bits=key_bits, value_bits=value_bits, tile_size=kv.tile,
             group_size=kv.group_size, max_kv_size=kv.max_kv_size)
