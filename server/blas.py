"""Use OpenBLAS on Linux when it is installed: MLX's Linux CPU wheel links a reference BLAS.

Preloading Debian's ``libopenblas0-pthread`` made float32 prompt products ~50x faster here
(docs/benchmarks.md). The library must be preloaded before MLX is imported, so the ``kvarn``
command re-executes itself once with ``LD_PRELOAD`` set. ``--no-openblas`` or
``KVARN_NO_OPENBLAS=1`` turns this off.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

DISABLE_ENV = "KVARN_NO_OPENBLAS"
_DONE_ENV = "KVARN_OPENBLAS_REEXEC"
_MULTIARCH = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu", "arm64": "aarch64-linux-gnu"}


def find_openblas() -> Path | None:
    triplet = _MULTIARCH.get(platform.machine())
    if not sys.platform.startswith("linux") or triplet is None:
        return None
    for folder in (f"/usr/lib/{triplet}/openblas-pthread", f"/usr/lib/{triplet}/openblas-openmp"):
        lib = Path(folder) / "libblas.so.3"
        if lib.is_file():
            return lib
    return None


def openblas_active() -> bool:
    lib = find_openblas()
    return lib is not None and str(lib) in os.environ.get("LD_PRELOAD", "")


def maybe_reexec_with_openblas(disabled: bool = False) -> None:
    """Re-execute this process with OpenBLAS preloaded, once. Call it before importing MLX."""
    if disabled or os.environ.get(DISABLE_ENV) or os.environ.get(_DONE_ENV) or "mlx" in sys.modules:
        return
    lib = find_openblas()
    if lib is None or openblas_active():
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (str(lib), env.get("LD_PRELOAD", "")) if p)
    env[_DONE_ENV] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
