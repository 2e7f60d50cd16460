"""The kernels' CUDA and Metal text, kept in source files of their own (``metal/cuda/src``,
``metal/msl/src``) and read once, at import, by the module that launches each kernel.

The files are package data (``pyproject.toml``), read through ``importlib.resources`` so that an
installed wheel finds them as a checkout does. A file holds exactly the text the module hands to
``mx.fast.cuda_kernel`` / ``mx.fast.metal_kernel`` before ``metal.launch.minify``: a header, or a
body without its signature (MLX writes that from the input and output names and the template
arguments)."""

from __future__ import annotations

from importlib.resources import files

BACKENDS = ("cuda", "msl", "cpu")


def source(backend: str, name: str) -> str:
    """The text of ``metal/<backend>/src/<name>`` as stored (``backend``: "cuda" or "msl")."""
    return (_folder(backend) / name).read_text(encoding="utf-8")


def names(backend: str) -> list[str]:
    """The source files of one backend, sorted."""
    return sorted(p.name for p in _folder(backend).iterdir() if p.is_file())


def _folder(backend: str):  # -> importlib.resources.abc.Traversable
    if backend not in BACKENDS:
        raise ValueError(f"no kernel sources for backend {backend!r}; have {BACKENDS}")
    return files("metal") / backend / "src"
