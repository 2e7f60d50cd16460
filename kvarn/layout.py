"""KV layouts: everything that decides the bytes of a cached token, and the layout stamp.

The stamp is a short stable digest of the layout plus the model fingerprint; it salts every
prefix-cache key and is reported by ``/v1/models`` so clients can check what is in force.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

FORMAT_VERSION = 1
SCHEMES = ("fp16",)
_DTYPE_BITS = {"float32": 32, "float16": 16, "bfloat16": 16}


@dataclass(frozen=True)
class KVLayout:
    """The KV layout in force. ``fp16`` is the unquantized baseline: keys and values are kept
    in the model's compute dtype (``storage_dtype``), so its bits are that dtype's bits."""

    scheme: str = "fp16"
    storage_dtype: str = "float16"
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"KV scheme {self.scheme!r} is not available; choose one of {', '.join(SCHEMES)}")
        if self.storage_dtype not in _DTYPE_BITS:
            raise ValueError(f"unsupported KV storage dtype {self.storage_dtype!r}")

    @property
    def key_bits(self) -> int:
        return _DTYPE_BITS[self.storage_dtype]

    @property
    def value_bits(self) -> int:
        return _DTYPE_BITS[self.storage_dtype]

    def stamp(self, model_fingerprint: str) -> str:
        payload = json.dumps({"layout": asdict(self), "model": model_fingerprint}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def describe(self, model_fingerprint: str) -> dict[str, object]:
        """The verdict reported by ``/v1/models`` and ``/health``."""
        return {
            "scheme": self.scheme,
            "key_bits": self.key_bits,
            "value_bits": self.value_bits,
            "tile": None,
            "dtype": self.storage_dtype,
            "format_version": self.format_version,
            "stamp": self.stamp(model_fingerprint),
        }
