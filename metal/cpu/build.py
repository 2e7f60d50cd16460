"""Build KVarN's CPU kernels (``metal/cpu/src/kvarn_cpu.cpp``) as an MLX extension, once a machine.

MLX's CPU backend has no custom-kernel API, but its C++ API takes new primitives: a shared
library that defines them and binds them with nanobind in MLX's nanobind domain hands ``mx.array``
in and out like MLX's own ops (MLX's extension mechanism, ``mlx.extension``). The library is
compiled at first use, by the C++ compiler that MLX's own CPU ``mx.compile`` needs, for this CPU
(``-march=native``: MLX compiles its fused CPU kernels without it), and kept in a cache folder
named by everything that makes it (source, flags, MLX, nanobind and Python versions, the CPU's
features); concurrent builders (test workers, server processes) wait on one lock and find it
built. Any failure (no compiler, no nanobind, a compile error) returns None with its reason:
the caller runs the pure-MLX path.

    KVARN_CPU_KERNELS=0     never build or load them (the pure-MLX path everywhere)
    KVARN_CACHE_DIR         the cache folder's root (default ~/.cache/kvarn)
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType

from metal.sources import source

MODULE = "_kvarn_cpu"
SOURCE = "kvarn_cpu.cpp"
DISABLE_ENV = "KVARN_CPU_KERNELS"
CACHE_ENV = "KVARN_CACHE_DIR"
# -ffp-contract=off: no contraction into FMAs (the same bits as the pure-MLX exp polynomial);
# -fno-trapping-math: selects and maxima become vector blends (with it on, no loop with a float
# comparison vectorizes: the softmax's exp ran 6.5x slower); results are unchanged
FLAGS = ("-std=c++20", "-O3", "-march=native", "-ffp-contract=off", "-fno-trapping-math", "-fno-math-errno", "-fPIC",
         "-shared", "-fvisibility=hidden", "-DNDEBUG", "-DNB_DOMAIN=mlx")
BUILD_TIMEOUT_S = 600


class Unavailable(Exception):
    """Why the CPU kernels cannot be had here (in the selector's one warning)."""


def load() -> ModuleType:
    """The built extension module (building it first if this machine has none); raises
    ``Unavailable`` with the reason where it cannot be built or loaded."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        raise Unavailable(f"{DISABLE_ENV}=0")
    if sys.platform != "linux":
        raise Unavailable("built on Linux only (elsewhere MLX runs on a GPU)")
    try:
        import mlx.core
        import nanobind
    except ImportError as exc:
        raise Unavailable(f"nanobind is not installed ({exc})") from exc
    text = source("cpu", SOURCE)
    # the package folder that holds MLX's library and headers: mlx is a namespace package, and a folder
    # named mlx earlier on sys.path (MLX's own compile cache, /tmp/mlx, beside a script run from /tmp)
    # would come first in its __path__
    mlx_dir = Path(mlx.core.__file__).parent
    nb_dir = Path(nanobind.__file__).parent
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise Unavailable("no C++ compiler (g++) on PATH")
    key = hashlib.sha256("\0".join((text, " ".join(FLAGS), compiler, _version(mlx_dir), nanobind.__version__,
                                    sys.version, platform.machine(), _cpu_features())).encode()).hexdigest()[:20]
    folder = cache_root() / "cpu-kernels" / key
    target = folder / f"{MODULE}{sysconfig.get_config_var('EXT_SUFFIX')}"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder; the others wait and find it built
            if not target.exists():
                _compile(compiler, text, mlx_dir, nb_dir, target)
    spec = importlib.util.spec_from_file_location(MODULE, target)
    if spec is None or spec.loader is None:
        raise Unavailable(f"cannot load {target}")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise Unavailable(f"the built library does not load ({exc})") from exc
    return module


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvarn")


def include_flags(mlx_dir: Path, nb_dir: Path) -> list[str]:
    """The header folders the source compiles against: nanobind's, Python's and MLX's."""
    return [f"-I{nb_dir / 'include'}", f"-I{nb_dir / 'ext' / 'robin_map' / 'include'}",
            f"-I{sysconfig.get_paths()['include']}", f"-I{mlx_dir / 'include'}"]


def _compile(compiler: str, text: str, mlx_dir: Path, nb_dir: Path, target: Path) -> None:
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / SOURCE
        src.write_text(text, encoding="utf-8")
        out = Path(tmp) / target.name
        cmd = [compiler, *FLAGS, *include_flags(mlx_dir, nb_dir), str(src),
               str(nb_dir / "src" / "nb_combined.cpp"), f"-L{mlx_dir / 'lib'}", "-lmlx",
               f"-Wl,-rpath,{mlx_dir / 'lib'}", "-o", str(out)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise Unavailable(f"the compiler did not run ({exc})") from exc
        if done.returncode != 0:
            log = (done.stderr or done.stdout).strip()
            errors = [line for line in log.splitlines() if "error" in line]
            raise Unavailable(f"the build failed: {' | '.join(errors[:3]) or log[-800:]}")
        os.replace(out, target)  # whole or not at all: a reader never sees half a library


def _version(mlx_dir: Path) -> str:
    import mlx.core as mx
    return f"{mx.__version__} {mlx_dir}"


def _cpu_features() -> str:
    """The CPU's feature flags (``-march=native`` builds for them): a library is never loaded on a
    CPU other than the one it was built for, even from a shared home folder."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()
