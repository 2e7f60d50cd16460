"""Which kernel runs: the one registry of verdicts (``Kernels``).

Each fused kernel is decided once (the commit once per layout) at its first use: the kernel of
this device's backend (CUDA: ``metal.cuda``; an Apple GPU: ``metal.msl``) where it has the shape
and passes a self-check against its pure-MLX reference on a small random case; else the
reference, with one logged warning per kind of kernel. A verdict never changes afterwards.

    kind of kernel   key                                          verdicts
    paged_decode     ()                                           cuda-fused | metal-fused | reference
    commit           (head_dim, tile_size, key_bits, value_bits, iters)   cuda-fused | metal-fused | cpu-native | reference
    ragged_decode    ()                                           cuda-fused | reference
    rotate           ()                                           cuda-fused | reference
    cpu              ()                                           cpu-native | reference

The CPU's kernels (``metal.cpu``: KVarN's decode attention, the softmax's exp) are one verdict:
built at first use on this machine (``metal.cpu.build``), then checked against the pure-MLX
references in float32 (the self-check's arrays are its own, so it runs inside an ``mx.compile``
trace too). The engine decides it when it is made. Where no GPU backend is found, a process's
backend is then the CPU's (``cpu_backend``): their quantizer is its commit, checked per layout
against the pure-MLX quantizer (``commit_self_check``) like a GPU's fused commit, verdict
"cpu-native".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import mlx.core as mx

from metal.cpu import build
from metal.cpu.kernels import CpuKernels
from metal.self_checks import commit_self_check, cpu_self_check, paged_decode_self_check, ragged_decode_self_check, \
    rope_mismatch, rotate_mismatch_cuda, swiglu_mismatch

log = logging.getLogger(__name__)
SELF_CHECK_TOLERANCE = 2e-2  # max |kernel - reference| / max |reference|: float16 noise is ~1e-3
COMMIT_SELF_CHECK_CODES = 0.99  # fraction of code words equal to the reference's
COMMIT_SELF_CHECK_FACTORS = 1e-2  # max |kernel - reference| / max |reference| per factor field (float16 ~1e-3)
CPU_SELF_CHECK_TOLERANCE = 1e-4  # float32 against float32: summation order only (~1e-7 measured)
FUSED = ("cuda-fused", "metal-fused")
CPU_NATIVE = "cpu-native"
KERNEL_COMMITS = (*FUSED, CPU_NATIVE)  # commit verdicts that run one kernel, not the pure-MLX quantizer
REFERENCE = "reference"


class RotateKernel(NamedTuple):
    """The rotation kernel's entry points, with ``metal.cuda.rotate``'s signatures: ``cast(x, dtype)``
    and ``pair(x, y, dtype)``."""

    cast: Callable[..., mx.array]
    pair: Callable[..., mx.array]


class CommitKernel(NamedTuple):
    """The fused commit's two entry points, with ``metal.cuda.commit``'s signatures."""

    tiles: Callable[..., dict[str, mx.array]]
    window_tails: Callable[..., dict[str, mx.array]]


@dataclass(frozen=True)
class Backend:
    """One GPU backend's kernels (``metal.cuda``'s signatures) and which shapes each has
    (``*_supported``: keyword arguments as ``metal.cuda``'s ``is_supported``); None: no such kernel.
    ``ragged_plan`` is the ragged kernel's ``make_plan`` (its self-check runs both kinds of plan)."""

    name: str  # in warnings: "CUDA" | "Metal"
    verdict: str  # what its kernels' verdicts read: "cuda-fused" | "metal-fused"
    paged_decode: Callable[..., mx.array] | None = None
    paged_decode_supported: Callable[..., bool] | None = None
    commit: CommitKernel | None = None
    commit_supported: Callable[..., bool] | None = None
    ragged_decode: Callable[..., mx.array] | None = None
    ragged_decode_supported: Callable[..., bool] | None = None
    ragged_plan: Callable | None = None
    rotate: RotateKernel | None = None


def cpu_backend(kernels: CpuKernels) -> Backend:
    """The CPU's kernels as a backend: their quantizer is the commit, checked as a GPU's fused one
    (their decode attention is planned as arrays, asked for through ``Kernels.cpu``)."""
    return Backend("CPU", CPU_NATIVE, commit=CommitKernel(kernels.quantize_tiles, kernels.quantize_window_tails),
                   commit_supported=kernels.quantizes)


def cuda_backend() -> Backend:
    from metal.cuda import commit, paged_decode, ragged_decode, rotate
    return Backend("CUDA", "cuda-fused", paged_decode.paged_decode_attention, paged_decode.is_supported,
                   CommitKernel(commit.quantize_tiles, commit.quantize_window_tails), commit.is_supported,
                   ragged_decode.ragged_decode_attention, ragged_decode.is_supported, ragged_decode.make_plan,
                   RotateKernel(rotate.rotate_cast, rotate.rotate_pair))


def metal_backend() -> Backend:
    from metal.msl import commit, paged_decode
    return Backend("Metal", "metal-fused", paged_decode.paged_decode_attention, paged_decode.is_supported,
                   CommitKernel(commit.quantize_tiles, commit.quantize_window_tails), commit.is_supported)


def detect_backend() -> Backend | None:
    """The backend of the device MLX runs on: CUDA, else an Apple GPU, else None (no fused kernels)."""
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return cuda_backend()
    if hasattr(mx, "metal") and mx.metal.is_available():
        return metal_backend()
    return None


@dataclass(frozen=True)
class Decision:
    path: str  # "cuda-fused" | "metal-fused" | "reference"
    warned: bool  # this decision logged its kind's one warning


class Kernels:
    """The verdicts of one process (or of one test): one dict from (kind of kernel, *key) to its
    ``Decision``, each made once, at first use, on the thread that runs the kernels. ``backend``:
    "auto" (detected at the first decision; on the CPU, its kernels), a ``Backend``, or None (every
    verdict the reference).
    The ``decided_*`` readers never decide, so other threads may ask them."""

    def __init__(self, backend: Backend | None | str = "auto"):
        self._backend_arg = backend
        self._decisions: dict[tuple, Decision] = {}
        self._cpu: CpuKernels | None = None
        self._pinned_rotate: str | None = None

    @cached_property
    def backend(self) -> Backend | None:
        if self._backend_arg != "auto":
            return self._backend_arg
        gpu = detect_backend()
        if gpu is not None:
            return gpu
        kernels = self.cpu()  # on the CPU: its kernels, once built and checked
        return cpu_backend(kernels) if kernels is not None else None

    def _settle(self, key: tuple, path: str, warning: tuple | None) -> str:
        """Record ``path`` for ``key``; log ``warning`` (a logging format and its arguments) only if
        no decision of the same kind warned before."""
        warned = warning is not None and not any(d.warned for k, d in self._decisions.items() if k[0] == key[0])
        if warned:
            log.warning(*warning)
        self._decisions[key] = Decision(path, warned)
        return path

    def _decided(self, kind: str) -> str | None:
        return next((d.path for k, d in self._decisions.items() if k[0] == kind), None)

    # ---- the paged KVarN decode attention ----
    def attention_path(self) -> str:
        """The KVarN decode attention in force: "cuda-fused" | "metal-fused" | "reference"."""
        key = ("paged_decode",)
        if key not in self._decisions:
            self._settle(key, *self._decide_attention())
        return self._decisions[key].path

    def _decide_attention(self) -> tuple[str, tuple | None]:
        b = self.backend
        if b is not None and b.verdict == CPU_NATIVE:  # the CPU: its C++ decode kernel is ``cpu``'s to decide
            return REFERENCE, None
        if b is None or b.paged_decode is None:
            return REFERENCE, ("kvarn: no GPU backend with a fused decode kernel; KVarN decode runs the pure-MLX "
                               "reference path",)
        try:
            err = paged_decode_self_check(b.paged_decode)
        except Exception as exc:  # a compile or launch failure: the reference still works
            return REFERENCE, ("kvarn: the fused %s decode kernel failed its self-check (%s); running the reference "
                               "path", b.name, exc)
        if not err <= SELF_CHECK_TOLERANCE:
            return REFERENCE, ("kvarn: the fused %s decode kernel is off its reference by %.3g (max relative); "
                               "running the reference path", b.name, err)
        return b.verdict, None

    def paged_decode(self, *, head_dim: int, tile_size: int, key_bits: int, value_bits: int,
                     n_rep: int) -> Callable[..., mx.array] | None:
        """The fused paged decode attention (``metal.cuda.paged_decode.paged_decode_attention``'s
        signature) where the verdict is fused and the kernel has this shape; else None: the
        caller runs its reference path. Decides the verdict at the first call."""
        if self.attention_path() not in FUSED:
            return None
        b = self.backend
        shape = dict(head_dim=head_dim, tile_size=tile_size, key_bits=key_bits, value_bits=value_bits, n_rep=n_rep)
        return b.paged_decode if b.paged_decode_supported(**shape) else None

    def decided_attention_path(self) -> str | None:
        return self._decided("paged_decode")

    def pin_attention_path(self, path: str) -> None:
        """Fix the decode attention's verdict without a self-check: "reference", or this backend's
        fused verdict (to compare both paths through the engine in one process). ValueError for a
        verdict this backend cannot give."""
        b = self.backend
        allowed = {REFERENCE} | ({b.verdict} if b is not None and b.paged_decode is not None else set())
        if path not in allowed:
            raise ValueError(f"attention path {path!r}: this backend gives one of {sorted(allowed)}")
        self._decisions[("paged_decode",)] = Decision(path, False)

    # ---- the tile commit ----
    def commit_path(self, *, reference: Callable[..., dict[str, mx.array]], head_dim: int = 128,
                    tile_size: int = 128, key_bits: int = 4, value_bits: int = 2, iters: int = 8) -> str:
        """The KVarN tile commit in force for this layout. ``reference``: the pure-MLX quantizer the
        kernel must match (``metal`` imports nothing of ``kvarn``), called as ``reference(keys=,
        values=, key_bits=, value_bits=, iters=)`` like ``metal.cuda.commit.quantize_tiles`` and
        returning the same record fields; not called where no backend has the kernel. One warning
        a process, whatever the number of layouts that fall back."""
        layout = (head_dim, tile_size, key_bits, value_bits, iters)
        key = ("commit", *layout)
        if key not in self._decisions:
            self._settle(key, *self._decide_commit(reference, *layout))
        return self._decisions[key].path

    def _decide_commit(self, reference, head_dim, tile_size, key_bits, value_bits, iters) -> tuple[str, tuple | None]:
        b = self.backend
        if b is None or b.commit is None:
            return REFERENCE, ("kvarn: no GPU backend with a fused commit kernel; KVarN commits run the pure-MLX "
                               "quantizer",)
        if not b.commit_supported(head_dim=head_dim, tile_size=tile_size, key_bits=key_bits, value_bits=value_bits):
            return REFERENCE, ("kvarn: no fused %s commit kernel for head_dim %d, tile %d, k%dv%d; commits run the "
                               "pure-MLX quantizer", b.name, head_dim, tile_size, key_bits, value_bits)
        try:
            same, worst = commit_self_check(reference, b.commit, head_dim=head_dim, tile_size=tile_size,
                                            key_bits=key_bits, value_bits=value_bits, iters=iters)
        except Exception as exc:  # a compile or launch failure: the reference still works
            return REFERENCE, ("kvarn: the fused %s commit kernel failed its self-check (%s); commits run the "
                               "pure-MLX quantizer", b.name, exc)
        if not (same >= COMMIT_SELF_CHECK_CODES and worst <= COMMIT_SELF_CHECK_FACTORS):
            return REFERENCE, ("kvarn: the fused %s commit kernel is off its reference (%.4f of code words equal, "
                               "factors off by %.3g); commits run the pure-MLX quantizer", b.name, same, worst)
        return b.verdict, None

    def commit(self, *, reference: Callable[..., dict[str, mx.array]], head_dim: int, tile_size: int,
               key_bits: int, value_bits: int, iters: int) -> CommitKernel | None:
        """The fused commit for this layout where its verdict (``commit_path``) is fused, else None:
        the caller runs ``reference``'s quantizer."""
        path = self.commit_path(reference=reference, head_dim=head_dim, tile_size=tile_size, key_bits=key_bits,
                                value_bits=value_bits, iters=iters)
        return self.backend.commit if path in KERNEL_COMMITS else None

    def decided_commit_path(self) -> str | None:
        """The first verdict ``commit_path`` reached, else None."""
        return self._decided("commit")

    # ---- the fp16 baseline's ragged decode attention ----
    def ragged_decode_path(self) -> str:
        """The fp16 baseline's ragged decode attention in force: "cuda-fused" | "reference"; never
        raises (a verdict must come back whatever happened)."""
        key = ("ragged_decode",)
        if key not in self._decisions:
            try:
                decision = self._decide_ragged()
            except Exception as exc:  # noqa: BLE001
                decision = REFERENCE, ("kvarn: deciding the ragged decode path failed (%s); running the reference "
                                       "path", exc)
            self._settle(key, *decision)
        return self._decisions[key].path

    def _decide_ragged(self) -> tuple[str, tuple | None]:
        b = self.backend
        if b is None or b.ragged_decode is None:
            return REFERENCE, ("kvarn: no CUDA backend with the fused ragged decode kernel; the fp16 baseline's "
                               "batched decode runs the pure-MLX reference path",)
        try:
            err = ragged_decode_self_check(b.ragged_decode, b.ragged_plan)
        except Exception as exc:  # a compile or launch failure: the reference still works
            return REFERENCE, ("kvarn: the fused %s ragged decode kernel failed its self-check (%s); running the "
                               "reference path", b.name, exc)
        if not err <= SELF_CHECK_TOLERANCE:
            return REFERENCE, ("kvarn: the fused %s ragged decode kernel is off its reference by %.3g (max "
                               "relative); running the reference path", b.name, err)
        return b.verdict, None

    def ragged_decode(self, *, head_dim: int, n_rep: int, dtype: mx.Dtype,
                      kv_dtype: mx.Dtype) -> Callable[..., mx.array] | None:
        """The fused ragged decode attention (``metal.cuda.ragged_decode.ragged_decode_attention``'s
        signature) where this backend has it for the shape and its verdict is fused, else None.
        Where the backend has no such kernel nothing is decided (an fp16 server off CUDA reports
        no verdict)."""
        b = self.backend
        if b is None or b.ragged_decode is None or not b.ragged_decode_supported(
                head_dim=head_dim, n_rep=n_rep, dtype=dtype, kv_dtype=kv_dtype):
            return None
        return b.ragged_decode if self.ragged_decode_path() in FUSED else None

    def decided_ragged_decode_path(self) -> str | None:
        return self._decided("ragged_decode")

    # ---- KVarN's rotation (GPU) ----
    def rotate(self, x_dtype: mx.Dtype, dtype: mx.Dtype, width: int) -> RotateKernel | None:
        """The rotation kernel (``metal.cuda.rotate``: one launch for a cast, the transform and a
        cast, MLX's bits) for inputs of ``x_dtype`` rotated in slices of ``width`` and rounded to
        ``dtype``, where this backend has it and it gives MLX's bits here for that combination
        (``rotate_mismatch_cuda``, checked at its first use: each combination is its own compiled
        kernel); else None: the caller runs MLX's operations."""
        key = ("rotate", x_dtype, dtype, width)
        if key not in self._decisions and self._pinned_rotate is not None:
            self._decisions[key] = Decision(self._pinned_rotate, False)
        if key not in self._decisions:
            b = self.backend
            if b is None or b.rotate is None:
                decision = REFERENCE, None  # nothing to warn about: MLX's operations are the rotation
            else:
                try:
                    ok = rotate_mismatch_cuda(b.rotate, x_dtype, dtype, width) == 0.0
                    decision = (b.verdict, None) if ok else (REFERENCE, (
                        "kvarn: the %s rotation kernel is off MLX's bits; rotations run MLX's operations", b.name))
                except Exception as exc:  # noqa: BLE001 (a kernel that raises is not used)
                    decision = REFERENCE, ("kvarn: the %s rotation kernel failed its self-check (%s); rotations run "
                                           "MLX's operations", b.name, exc)
            self._settle(key, *decision)
        return self.backend.rotate if self._decisions[key].path in FUSED else None

    def decided_rotate_path(self) -> str | None:
        """The first verdict ``rotate`` reached (any combination), else None."""
        return self._decided("rotate")

    def pin_rotate_path(self, path: str) -> None:
        """Fix every rotation verdict without a self-check: "reference" (MLX's operations), or this
        backend's fused verdict where it has the kernel (benchmarks compare both). ValueError else."""
        b = self.backend
        allowed = {REFERENCE} | ({b.verdict} if b is not None and b.rotate is not None else set())
        if path not in allowed:
            raise ValueError(f"rotation path {path!r}: this backend gives one of {sorted(allowed)}")
        self._pinned_rotate = path

    # ---- the CPU's kernels ----
    def cpu(self) -> CpuKernels | None:
        """KVarN's CPU kernels (``metal.cpu.kernels.CpuKernels``) where MLX runs on the CPU and
        they built and passed their self-check; else None (the pure-MLX paths run; always with
        ``backend=None``: no kernels at all). Decides the verdict at the first call."""
        if mx.default_device() != mx.cpu or self._backend_arg is None:
            return None
        key = ("cpu",)
        if key not in self._decisions:
            kernels, decision = self._decide_cpu()
            self._settle(key, *decision)
            self._cpu = kernels
        return self._cpu if self._decisions[key].path == CPU_NATIVE else None

    def _decide_cpu(self) -> tuple[CpuKernels | None, tuple[str, tuple | None]]:
        try:
            kernels = CpuKernels(build.load())
        except build.Unavailable as exc:
            return None, (REFERENCE, ("kvarn: no CPU kernels (%s); the CPU runs the pure-MLX paths", exc))
        try:
            err = cpu_self_check(kernels)
        except Exception as exc:  # noqa: BLE001 (a kernel that raises is not used)
            return None, (REFERENCE, ("kvarn: the CPU kernels failed their self-check (%s); the CPU runs the "
                                      "pure-MLX paths", exc))
        if not err <= CPU_SELF_CHECK_TOLERANCE:
            return None, (REFERENCE, ("kvarn: the CPU kernels are off their references by %.3g (max relative); the "
                                      "CPU runs the pure-MLX paths", err))
        return kernels, (CPU_NATIVE, None)

    def decided_cpu_path(self) -> str | None:
        return self._decided("cpu")

    def cpu_rope(self) -> CpuKernels | None:
        """The CPU kernels where they run (``cpu``) and their rope gives ``mx.fast.rope``'s bits
        (``rope_mismatch``, checked once); else None (the model keeps MLX's rope)."""
        return self._cpu_exact("cpu_rope", rope_mismatch, "rope is off mx.fast.rope's bits; the model keeps MLX's rope")

    def cpu_swiglu(self) -> CpuKernels | None:
        """The CPU kernels where they run (``cpu``) and their SwiGLU gives MLX's bits for
        ``nn.silu(gate) * up`` (``swiglu_mismatch``, checked once); else None (the model keeps
        mlx-lm's ``swiglu``)."""
        return self._cpu_exact("cpu_swiglu", swiglu_mismatch,
                               "SwiGLU is off MLX's bits; the model keeps mlx-lm's swiglu")

    def _cpu_exact(self, name: str, mismatch: Callable[[CpuKernels], float], off: str) -> CpuKernels | None:
        """The CPU kernels where they run and ``mismatch`` finds one of their model operations on
        MLX's bits (checked once, decided under ``name``); else None, with one warning."""
        kernels = self.cpu()
        if kernels is None:
            return None
        key = (name,)
        if key not in self._decisions:
            ok = mismatch(kernels) == 0.0
            self._settle(key, CPU_NATIVE if ok else REFERENCE, None if ok else ("kvarn: the CPU kernels' %s", off))
        return kernels if self._decisions[key].path == CPU_NATIVE else None
