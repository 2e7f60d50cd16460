"""KV layouts: everything that decides the bytes of a cached token, and the layout stamp.

The stamp is a short stable digest of the layout plus the model fingerprint; it salts every
prefix-cache key and is reported by ``/v1/models`` so clients can check what is in force.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, replace

FORMAT_VERSION = 2  # 2: a prompt's first chunk attends with decode's view (no full-precision chunk)
SCHEMES = ("kvarn", "affine", "fp16")
BITS = (2, 3, 4, 5, 6, 8)
PRESETS = {"k4v2": (4, 2), "k4v4": (4, 4), "k8v8": (8, 8), "k3v3": (3, 3), "k2v2": (2, 2)}
TILES = (64, 128)
AFFINE_GROUPS = (32, 64, 128)
DEFAULT_ITERS = 8
ROTATING_KEEP = 4  # tokens mlx-lm's max_kv_size keeps at the start of a rotating cache (fp16 / affine windows)
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class KVLayout:
    """The KV layout in force.

    ``kvarn``: K/V quantized in tiles of ``tile_size`` tokens (sink and tail in float16).
    ``affine``: mlx-lm's ``QuantizedKVCache`` (``key_bits == value_bits``, ``group_size``).
    ``fp16``: unquantized; K/V kept in ``storage_dtype`` (the model's compute dtype).

    ``max_kv_size`` (None: unbounded): the attention window of every row (``--max-kv-size``).
    KVarN rows keep their sink and the newest whole record blocks such that sink + records + tail
    <= N tokens (``kvarn.window``); fp16 / affine rows are rotating caches of N tokens keeping the
    first ``ROTATING_KEEP`` (as mlx-lm's ``max_kv_size``, ``kvarn.rotating``). RoPE positions stay
    the true ones. It is part of the stamp (a windowed row's blocks are not an unwindowed row's),
    left out of it when None so unwindowed stamps are what they were.
    """

    scheme: str = "kvarn"
    key_bits: int = 4
    value_bits: int = 2
    tile_size: int = 128
    group_size: int = 64
    iters: int = DEFAULT_ITERS
    storage_dtype: str = "float16"
    format_version: int = FORMAT_VERSION
    max_kv_size: int | None = None

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"KV scheme must be one of {', '.join(SCHEMES)}, not {self.scheme!r}")
        if self.storage_dtype not in _DTYPE_BYTES:
            raise ValueError(f"unsupported KV storage dtype {self.storage_dtype!r}")
        if self.max_kv_size is not None:
            low = self.min_window
            if isinstance(self.max_kv_size, bool) or not isinstance(self.max_kv_size, int) or self.max_kv_size < low:
                raise ValueError(f"max_kv_size must be an integer >= {low} for {self.scheme} "
                                 f"({self._window_floor_reason}), not {self.max_kv_size!r}")
        if self.scheme == "fp16":
            return
        for name, bits in (("key", self.key_bits), ("value", self.value_bits)):
            if bits not in BITS:
                raise ValueError(f"{name} bits must be one of {BITS}, not {bits}")
        if self.scheme == "kvarn" and self.tile_size not in TILES:
            raise ValueError(f"KVarN tile must be one of {TILES}, not {self.tile_size}")
        if self.scheme == "affine":
            if self.key_bits != self.value_bits:
                raise ValueError("the affine baseline uses one width for keys and values")
            if self.group_size not in AFFINE_GROUPS:
                raise ValueError(f"affine group size must be one of {AFFINE_GROUPS}")

    @classmethod
    def fp16(cls, storage_dtype: str = "float16") -> KVLayout:
        return cls(scheme="fp16", storage_dtype=storage_dtype)

    @classmethod
    def affine(cls, bits: int, group_size: int = 64, storage_dtype: str = "float16") -> KVLayout:
        return cls(scheme="affine", key_bits=bits, value_bits=bits, group_size=group_size,
                   storage_dtype=storage_dtype)

    @classmethod
    def kvarn(cls, preset_or_bits: str | tuple[int, int] = "k4v2", tile_size: int = 128) -> KVLayout:
        """A KVarN layout from a preset name, any ``kXvY`` (e.g. ``k5v3``), or (key_bits, value_bits)."""
        if isinstance(preset_or_bits, str):
            match = re.fullmatch(r"k(\d)v(\d)", preset_or_bits)
            if match is None:
                raise ValueError(f"KVarN widths are written kXvY (e.g. k4v2), not {preset_or_bits!r}")
            key_bits, value_bits = int(match[1]), int(match[2])
        else:
            key_bits, value_bits = preset_or_bits
        return cls(scheme="kvarn", key_bits=key_bits, value_bits=value_bits, tile_size=tile_size)

    def with_storage_dtype(self, dtype: str) -> KVLayout:
        return replace(self, storage_dtype=dtype)

    def with_window(self, max_kv_size: int | None) -> KVLayout:
        return replace(self, max_kv_size=max_kv_size)

    @property
    def min_window(self) -> int:
        """The smallest ``max_kv_size``: KVarN needs its sink and a whole tail (2 tiles); a
        rotating cache needs more than the tokens it keeps."""
        return 2 * self.tile_size if self.scheme == "kvarn" else ROTATING_KEEP + 1

    @property
    def _window_floor_reason(self) -> str:
        if self.scheme == "kvarn":
            return f"the float16 sink and tail: 2 tiles of {self.tile_size}"
        return f"more than the {ROTATING_KEEP} tokens a rotating cache keeps"

    @property
    def name(self) -> str:
        if self.scheme == "kvarn":
            return f"kvarn-k{self.key_bits}v{self.value_bits}-g{self.tile_size}" + (
                f"-w{self.max_kv_size}" if self.max_kv_size is not None else "")
        window = f"-w{self.max_kv_size}" if self.max_kv_size is not None else ""
        if self.scheme == "affine":
            return f"affine-{self.key_bits}-g{self.group_size}{window}"
        return f"fp16-{self.storage_dtype}{window}"

    @staticmethod
    def slice_width(head_dim: int) -> int:
        from kvarn.quantize import slice_width

        return slice_width(head_dim)

    # --- bytes (per layer; multiply by the number of layers that use this layout) ---
    def bytes_per_token(self, head_dim: int, n_kv_heads: int) -> float:
        """Steady-state bytes of one cached token of one layer (records only for KVarN)."""
        if self.scheme == "fp16":
            return 2 * head_dim * _DTYPE_BYTES[self.storage_dtype] * n_kv_heads
        if self.scheme == "affine":
            scale_bytes = _DTYPE_BYTES[self.storage_dtype]
            per_leg = head_dim * self.key_bits / 8 + 2 * scale_bytes * head_dim / self.group_size
            return 2 * per_leg * n_kv_heads
        width, g = self.slice_width(head_dim), self.tile_size
        per_slice = (self.key_bits + self.value_bits) * width / 8 + 2 * (3 * width + 3 * g) / g
        return per_slice * (head_dim // width) * n_kv_heads

    def sequence_bytes(self, num_tokens: int, head_dim: int, n_kv_heads: int) -> int:
        """Exact bytes one sequence of ``num_tokens`` holds in one layer.

        KVarN: sink (G tokens) + tail buffer (G tokens), both allocated at the first token, in
        ``window_dtype``, plus one record per full tile after the sink:
            tokens  |<- sink G ->|<- record ->|<- record ->|<- tail (< G) ->|
        """
        if num_tokens <= 0:
            return 0
        if self.scheme != "kvarn":
            return int(round(num_tokens * self.bytes_per_token(head_dim, n_kv_heads)))
        g = self.tile_size
        buffers = 2 * (2 * g * head_dim * _DTYPE_BYTES[self.window_dtype]) * n_kv_heads  # sink + tail, K and V
        num_tiles = max(0, num_tokens - g) // g
        return buffers + int(num_tiles * g * self.bytes_per_token(head_dim, n_kv_heads))

    @property
    def window_dtype(self) -> str:
        """What a KVarN row's sink and tail are stored in: float16 values (keys and values are
        rounded to float16 on arrival), held as float32 where that is the compute dtype (MLX's CPU
        backend: it converts float16 at ~0.6 ns an element, which made reading the window cost as
        much as the attention itself); float16 everywhere else."""
        return "float32" if self.storage_dtype == "float32" else "float16"

    def stamp(self, model_fingerprint: str) -> str:
        fields = asdict(self)
        if fields["max_kv_size"] is None:  # unwindowed stamps are those of layouts before windows
            del fields["max_kv_size"]
        payload = json.dumps({"layout": fields, "model": model_fingerprint}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def describe(self, model_fingerprint: str) -> dict[str, object]:
        """The verdict reported by ``/v1/models`` and ``/health``."""
        fp16 = self.scheme == "fp16"
        bits = 8 * _DTYPE_BYTES[self.storage_dtype]
        return {
            "scheme": self.scheme,
            "key_bits": bits if fp16 else self.key_bits,
            "value_bits": bits if fp16 else self.value_bits,
            "tile": self.tile_size if self.scheme == "kvarn" else None,
            "group_size": self.group_size if self.scheme == "affine" else None,
            "dtype": self.storage_dtype if fp16 else ("float16" if self.scheme == "kvarn" else self.storage_dtype),
            "iters": self.iters if self.scheme == "kvarn" else None,
            "format_version": self.format_version,
            "stamp": self.stamp(model_fingerprint),
            **({"max_kv_size": self.max_kv_size} if self.max_kv_size is not None else {}),
        }
